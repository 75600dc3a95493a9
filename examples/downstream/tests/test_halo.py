"""The halo exchange on its own: each band gets its neighbours' edge rows, and a halo row's
gradient comes back to the band that owns the row."""

from __future__ import annotations

import torch
from harness import Topology

from tinyclimate import exchange_rows, latitude_band

NLAT, NLON = 9, 4


def exchange_on_rank() -> dict[str, torch.Tensor]:
    """Runs on every rank: exchange rows of a field whose value is its latitude index."""
    topo = Topology.create()
    rows = latitude_band(NLAT, topo.spatial_rank, topo.spatial_size)
    field = torch.arange(NLAT, dtype=torch.float64)[:, None].expand(NLAT, NLON)
    x = field[rows].clone().requires_grad_(True)
    from_north, from_south = exchange_rows(x, topo.spatial_group)
    # weights 1 (north halo) and 2 (south halo) tell the two gradient paths apart
    (from_north.sum() + 2 * from_south.sum()).backward()
    return {
        "rows": torch.arange(NLAT)[rows],
        "north": from_north.detach(),
        "south": from_south.detach(),
        "grad": x.grad,
    }


def test_each_band_receives_its_neighbours_edge_rows_and_returns_their_gradient(spatial):
    results = spatial.run(exchange_on_rank)
    last = len(results) - 1
    for rank, r in enumerate(results):
        lo, hi = int(r["rows"][0]), int(r["rows"][-1])
        north_row = lo - 1 if rank > 0 else 0.0  # zeros at the poles
        south_row = hi + 1 if rank < last else 0.0
        assert torch.all(r["north"] == north_row), f"rank {rank}: north halo {r['north']}"
        assert torch.all(r["south"] == south_row), f"rank {rank}: south halo {r['south']}"
        # my first row is the northern band's south halo (weight 2), my last row the
        # southern band's north halo (weight 1)
        expected = torch.zeros_like(r["grad"])
        if rank > 0:
            expected[0] += 2
        if rank < last:
            expected[-1] += 1
        assert torch.equal(r["grad"], expected), f"rank {rank}: gradient {r['grad']}"
