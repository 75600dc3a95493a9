"""tinyclimate split over latitude bands computes what the serial model computes.

``TinyClimateCase`` tells the harness how to build the model on a rank, what each rank's
share of the batch is, and where its output lives on the globe. ``spatial.check`` runs it
serially and on ``--spatial-ranks`` ranks, compares loss, every gradient, the output field
and the parameters after two SGD steps, then checks the serial run against the golden file.
"""

from __future__ import annotations

import pytest
import torch
from harness import Outputs, Shard, SpatialCase, Topology, data_share
from harness.collectives import reduce_loss

from tinyclimate import TinyClimate, area_weights, latitude_band
from tinyclimate.parallel import resolve_bug, sum_gradients


class TinyClimateCase(SpatialCase):
    name, dtype = "tinyclimate", torch.float64  # float64: the check is about logic

    def __init__(self, nlat: int = 10, nlon: int = 16, channels: int = 2, batch_size: int = 2):
        self.nlat, self.nlon, self.channels, self.batch_size = nlat, nlon, channels, batch_size
        # read $TINYCLIMATE_BUG here, in the test process: the case travels to the ranks
        self.bug = resolve_bug(None)

    def build(self, topo: Topology) -> torch.nn.Module:
        model = TinyClimate(
            self.nlat, self.nlon, self.channels, group=topo.spatial_group, bug=self.bug
        )
        # the model's own hooks: summed over the bands, averaged over data groups
        sum_gradients(model, topo.spatial_group, topo.data_group)
        return model

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        # the whole globe on every rank (seeded identically), then this rank's share
        shape = (self.batch_size, self.channels, self.nlat, self.nlon)
        x, target = torch.randn(shape), torch.randn(shape)
        samples, rows = data_share(self.batch_size, topo), self.rows(topo)
        return {"x": x[samples, :, rows], "target": target[samples, :, rows]}

    def forward(self, model, batch, topo: Topology) -> Outputs:
        y = model(batch["x"])
        area = area_weights(self.nlat, self.nlon)[self.rows(topo), None]
        # area-weighted MSE: the bands' parts add up to the global value (identity backward)
        part = (area * (y - batch["target"]) ** 2).sum()
        loss = reduce_loss(part, topo) / (y.shape[0] * self.channels)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        return Outputs(
            loss, {"y": Shard.grid(y, self.rows(topo), slice(None), self.nlat, self.nlon)}
        )

    def rows(self, topo: Topology) -> slice:
        return latitude_band(self.nlat, topo.spatial_rank, topo.spatial_size)

    def describe(self, topo: Topology | None = None) -> str:
        return f"{self.nlat}x{self.nlon} grid in latitude bands"


@pytest.mark.parametrize(
    "nlat", [pytest.param(8, id="even-bands"), pytest.param(10, id="uneven-bands")]
)
def test_tinyclimate_split_in_latitude_bands_matches_serial(spatial, nlat):
    spatial.check(TinyClimateCase(nlat=nlat), golden=True)


def test_tinyclimate_matches_serial_with_two_data_parallel_groups(spatial):
    if spatial.ranks % 2:
        pytest.skip(f"needs an even number of ranks, got --spatial-ranks {spatial.ranks}")
    spatial.check(TinyClimateCase(batch_size=4), spatial_size=spatial.ranks // 2, golden=True)
