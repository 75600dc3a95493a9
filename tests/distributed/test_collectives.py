"""Each collective, forward and backward, on 1-4 ranks against the single-process computation.

Everything runs in float64 and is compared with rtol = atol = 1e-11: the partitioned and
the single-process computation differ only in the order of their sums (about 1e-16 relative
per addition), while every bug these collectives can have (a gradient S times too large, a
missing share, a shard in the wrong place) is an O(1) relative error. A loose tolerance
would only hide bugs that are small because the test data happen to be small.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ConfigError, RankError, Topology
from harness.collectives import (
    all_gather_uneven,
    assemble,
    grid_halo_exchange,
    halo_exchange,
    reduce_gradients,
    reduce_loss,
    spatial_sum,
    sync_gradients,
)
from harness.partition import CellPartition, LatLonPartition, split_sizes
from harness.strategies import cell_partitions, latlon_partitions

TOL = {"rtol": 1e-11, "atol": 1e-11}
DISTRIBUTED = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,  # a distributed run is costly: the same few examples every time
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _shard(n: int, topo: Topology) -> slice:
    sizes = split_sizes(n, topo.spatial_size)
    lo = sum(sizes[: topo.spatial_rank])
    return slice(lo, lo + sizes[topo.spatial_rank])


def _detach(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in out.items()}


# ---------------------------------------------------------------- rank functions: sums


def loss_chain(kind: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    """A global sum inside the model feeding every position, then the loss.

    kind "right": spatial_sum inside, reduce_loss for the loss; "sum-loss": spatial_sum for
    both; "reduce-inside": reduce_loss for both.
    """
    topo = Topology.create()
    x_all, w, c = _randn(seed, n), _randn(seed + 1, n), _randn(seed + 2, n)
    sl = _shard(n, topo)
    x = x_all[sl].clone().requires_grad_()
    inner = reduce_loss if kind == "reduce-inside" else spatial_sum
    outer = spatial_sum if kind == "sum-loss" else reduce_loss
    s = inner((x**2).sum(), topo)  # replicated: the global sum of squares
    loss = outer((s * w[sl] * c[sl]).sum(), topo)
    loss.backward()
    return _detach({"s": s, "loss": loss, "grad": x.grad})


def _loss_chain_reference(n: int, seed: int) -> dict[str, torch.Tensor]:
    x, w, c = _randn(seed, n).requires_grad_(), _randn(seed + 1, n), _randn(seed + 2, n)
    s = (x**2).sum()
    loss = (s * w * c).sum()
    loss.backward()
    return _detach({"s": s, "loss": loss, "grad": x.grad})


# ---------------------------------------------------------------- rank functions: gathers


def gather_and_mix(how: str, n: int, channels: int, seed: int) -> dict[str, torch.Tensor]:
    """Gather the field, then compute this rank's output positions from all of it.

    how "all_gather": contiguous shards, (n, C) layout, dim 0. "assemble": each rank owns a
    scattered set of positions (a permutation), (C, n) layout, dim -1.
    """
    topo = Topology.create()
    field, mix, c = _randn(seed, n, channels), _randn(seed + 1, n, n), _randn(seed + 2, n)
    if how == "all_gather":
        own = torch.arange(n)[_shard(n, topo)]
        x = field[own].clone().requires_grad_()
        full = all_gather_uneven(x, topo, dim=0)  # (n, C), replicated
        out = mix[own] @ full  # (n_r, C): this rank's outputs need every position
    else:
        own = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[_shard(n, topo)]
        x = field.T[:, own].clone().requires_grad_()
        full = assemble(x, own, n, topo, dim=-1).T  # (n, C) again, replicated
        out = mix[own] @ full
    loss = reduce_loss((out**2 * c[own, None]).sum(), topo)
    loss.backward()
    grad = x.grad if how == "all_gather" else x.grad.T
    return _detach({"full": full, "loss": loss, "grad": grad, "own": own})


def _gather_reference(n: int, channels: int, seed: int) -> dict[str, torch.Tensor]:
    field, mix, c = _randn(seed, n, channels), _randn(seed + 1, n, n), _randn(seed + 2, n)
    field.requires_grad_()
    loss = ((mix @ field) ** 2 * c[:, None]).sum()
    loss.backward()
    return _detach({"full": field, "loss": loss, "grad": field.grad})


# ---------------------------------------------------------------- rank functions: halo


def halo_conv(part: CellPartition, channels: int, seed: int) -> dict[str, torch.Tensor]:
    """A 9-point stencil over each rank's cells, neighbours fetched by halo_exchange."""
    topo = Topology.create()
    r = topo.spatial_rank
    field, kernel, c = _halo_data(part.npix, channels, seed)
    own = slice(part.bounds[r], part.bounds[r + 1])
    x = field[:, own].clone().requires_grad_()
    halo = halo_exchange(x, part, topo, dim=-1)  # sharded: this rank's halo cells
    ext = torch.cat([x, halo], dim=-1)
    out = (ext[:, torch.from_numpy(part.local_neighbours(r))] * kernel).sum(-1)
    loss = reduce_loss((out**2 * c[own]).sum(), topo)
    loss.backward()
    return _detach({"halo": halo, "out": out, "loss": loss, "grad": x.grad})


def _halo_data(npix: int, channels: int, seed: int) -> tuple[torch.Tensor, ...]:
    return _randn(seed, channels, npix), _randn(seed + 1, 9), _randn(seed + 2, npix)


def _halo_reference(part: CellPartition, channels: int, seed: int) -> dict[str, torch.Tensor]:
    field, kernel, c = _halo_data(part.npix, channels, seed)
    field.requires_grad_()
    out = (field[:, torch.tensor(part.neighbours())] * kernel).sum(-1)
    loss = (out**2 * c).sum()
    loss.backward()
    return _detach({"field": field, "out": out, "loss": loss, "grad": field.grad})


# ---------------------------------------------------------------- rank functions: grad sync


def _model(channels: int, seed: int) -> torch.nn.Module:
    model = torch.nn.Sequential(
        torch.nn.Linear(channels, channels, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(channels, 1, dtype=torch.float64),
    )
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_randn(seed + 10 + i, *p.shape))
    return model


def train_grads(
    mode: str, spatial_size: int | None, n: int, channels: int, seed: int, backwards: int
) -> dict[str, torch.Tensor]:
    """Per-position model on this rank's positions of its data group's sample; grads synced
    by hooks (``sync_gradients``) or explicitly (``reduce_gradients``)."""
    topo = Topology.create(spatial_size)
    model = _model(channels, seed)
    samples = _randn(seed, topo.data_size, n, channels)
    sl = _shard(n, topo)
    if mode == "hooks":
        sync_gradients(model, topo)
    for _ in range(backwards):  # several backward passes accumulate, as with micro-batches
        loss = reduce_loss(model(samples[topo.data_rank, sl]).pow(2).sum(), topo)
        loss.backward()
    if mode == "explicit":
        reduce_gradients(list(model.parameters()), topo)
    return {name: p.grad for name, p in model.named_parameters()}


def _train_reference(
    data_size: int, n: int, channels: int, seed: int, backwards: int
) -> dict[str, torch.Tensor]:
    model = _model(channels, seed)
    samples = _randn(seed, data_size, n, channels)
    for _ in range(backwards):
        model(samples).pow(2).sum(dim=(1, 2)).mean().backward()  # mean over data groups
    return {name: p.grad for name, p in model.named_parameters()}


# ---------------------------------------------------------------- rank functions: all at once


def model_of_everything(
    part: CellPartition, topo: Topology | None, seed: int
) -> dict[str, torch.Tensor]:
    """Every collective in one model over a cell partition; run with ``topo=None`` on the
    ranks, or with ``Topology.single()`` and a one-rank partition as the reference."""
    topo = topo or Topology.create()
    r = topo.spatial_rank
    field, kernel, c = _halo_data(part.npix, 2, seed)
    mix, w = _randn(seed + 3, part.npix, part.npix), _randn(seed + 4, part.npix)
    own = slice(part.bounds[r], part.bounds[r + 1])
    x = field[:, own].clone().requires_grad_()
    gathered = all_gather_uneven(x, topo, dim=-1)  # replicated (C, npix)
    placed = assemble(x, torch.arange(own.start, own.stop), part.npix, topo)  # replicated
    halo = halo_exchange(x, part, topo)  # sharded
    total = spatial_sum((x**2).sum(), topo)  # replicated
    ext = torch.cat([x, halo], dim=-1)
    conv = (ext[:, torch.from_numpy(part.local_neighbours(r))] * kernel).sum(-1)
    part_loss = (
        (conv**2 * c[own]).sum()
        + ((gathered @ mix)[:, own] ** 2).sum()
        + (torch.tanh(placed) @ mix)[:, own].sum()
        + total * w[own].sum()
    )
    loss = reduce_loss(part_loss, topo)
    loss.backward()
    return _detach(
        {
            "gathered": gathered,
            "placed": placed,
            "total": total,
            "loss": loss,
            "grad": x.grad,
            "halo": halo,
        }
    )


def latlon_model(part: LatLonPartition, topo: Topology | None, seed: int) -> dict:
    """assemble + spatial_sum + reduce_loss on a lat/lon block (reference: one-rank part)."""
    topo = topo or Topology.create()
    n = part.nlat * part.nlon
    field, mix, area = _randn(seed, 3, n), _randn(seed + 1, n, n), _randn(seed + 2, n).exp()
    index = torch.from_numpy(part.index(topo.spatial_rank))
    x = field[:, index].clone().requires_grad_()  # (C, local nlat * local nlon), row-major
    full = assemble(x, index, n, topo)
    weight = spatial_sum(area[index].sum(), topo)  # replicated: the global area
    mean = reduce_loss(((full @ mix)[:, index] ** 2 * area[index]).sum(), topo) / weight
    mean.backward()
    return _detach({"full": full, "loss": mean, "grad": x.grad})


def stencil_model(
    part: LatLonPartition, width: int, pole: str, seed: int, reference: bool = False
) -> dict:
    """A (2 width + 1)^2 stencil over the halo-padded block, then an area-weighted loss.

    Returns the padded block, the stencil's output and the gradient of the block: the
    gradient is only right if every halo cell's gradient went back to its owner.
    """
    topo = Topology.single() if reference else Topology.create()
    if reference:
        part = LatLonPartition(part.nlat, part.nlon, rule=part.rule)
    field = _randn(seed, 2, part.nlat, part.nlon)
    kernel = _randn(seed + 1, 3, 2, 2 * width + 1, 2 * width + 1)
    weight = _randn(seed + 2, 3, part.nlat, part.nlon)
    rows, cols = part.slices(topo.spatial_rank)
    x = field[:, rows, cols].clone().requires_grad_()
    padded = grid_halo_exchange(x, part, topo, width=width, pole=pole)
    out = torch.nn.functional.conv2d(padded[None], kernel)[0]  # (3, own rows, own cols)
    loss = reduce_loss((out * weight[:, rows, cols]).sum(), topo)
    loss.backward()
    return _detach({"padded": padded, "out": out, "loss": loss, "grad": x.grad})


def assemble_twice_owned() -> None:
    topo = Topology.create()
    own = torch.tensor([0]) if topo.spatial_rank < 2 else torch.tensor([topo.spatial_rank])
    assemble(torch.ones(2, 1), own, topo.spatial_size, topo)


def halo_with_wrong_length(bad_rank: int) -> None:
    topo = Topology.create()
    part = CellPartition.even(1, topo.spatial_size)
    n = part.sizes[topo.spatial_rank] + (1 if topo.spatial_rank == bad_rank else 0)
    halo_exchange(torch.ones(n), part, topo)


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda r: f"r{r}")
def ranks(request: pytest.FixtureRequest) -> int:
    """Module-scoped so pytest groups the tests by rank count: one warm pool at a time."""
    return request.param


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rank: int) -> None:
    __tracebackhide__ = True
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"rank {rank}: {what}: {m}")


def test_spatial_sum_inside_and_reduce_loss_for_the_loss_match_the_reference(spatial, ranks):
    ref = _loss_chain_reference(10, seed=1)
    results = spatial.run(loss_chain, "right", 10, 1, ranks=ranks)
    for r, got in enumerate(results):
        _close(got["s"], ref["s"], "global sum", r)
        _close(got["loss"], ref["loss"], "loss", r)
        sizes = split_sizes(10, ranks)
        lo = sum(sizes[:r])
        _close(got["grad"], ref["grad"][lo : lo + sizes[r]], "grad", r)


def test_the_two_classic_reduction_mistakes_give_s_times_or_local_only_gradients(spatial, ranks):
    # spatial_sum for the loss counts every rank's part S times; reduce_loss inside the model
    # drops the other ranks' share. With one rank both are invisible: the reason to test on 2+.
    n, seed = 10, 2
    ref = _loss_chain_reference(n, seed)
    sum_loss = spatial.run(loss_chain, "sum-loss", n, seed, ranks=ranks)
    reduce_inside = spatial.run(loss_chain, "reduce-inside", n, seed, ranks=ranks)
    x, w, c = _randn(seed, n), _randn(seed + 1, n), _randn(seed + 2, n)
    sizes = split_sizes(n, ranks)
    for r in range(ranks):
        sl = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
        _close(sum_loss[r]["loss"], ref["loss"], "loss is right either way", r)
        _close(sum_loss[r]["grad"], ranks * ref["grad"][sl], "S-times grad", r)
        local_only = 2 * x[sl] * (w[sl] * c[sl]).sum()
        _close(reduce_inside[r]["grad"], local_only, "grad without the other ranks' share", r)
        if ranks > 1:
            assert not torch.allclose(sum_loss[r]["grad"], ref["grad"][sl])
            assert not torch.allclose(reduce_inside[r]["grad"], ref["grad"][sl])


@pytest.mark.parametrize("how", ["all_gather", "assemble"])
def test_gathered_fields_and_their_gradients_match_the_reference(spatial, ranks, how):
    n, channels, seed = 11, 3, 3
    ref = _gather_reference(n, channels, seed)
    for r, got in enumerate(spatial.run(gather_and_mix, how, n, channels, seed, ranks=ranks)):
        _close(got["full"], ref["full"], "gathered field", r)
        _close(got["loss"], ref["loss"], "loss", r)
        _close(got["grad"], ref["grad"][got["own"]], "grad of own positions", r)


@pytest.mark.parametrize("nside", [1, 2], ids=["nside1", "nside2"])
def test_halo_exchange_brings_each_rank_its_neighbours_and_sends_gradients_back(
    spatial, ranks, nside
):
    part = CellPartition.even(nside, ranks)
    ref = _halo_reference(part, 2, seed=4)
    for r, got in enumerate(spatial.run(halo_conv, part, 2, 4, ranks=ranks)):
        own = slice(part.bounds[r], part.bounds[r + 1])
        _close(got["halo"], ref["field"][:, torch.from_numpy(part.halo(r))], "halo values", r)
        _close(got["out"], ref["out"][:, own], "stencil output", r)
        _close(got["loss"], ref["loss"], "loss", r)
        _close(got["grad"], ref["grad"][:, own], "grad", r)


@pytest.mark.parametrize(
    ("mode", "backwards"),
    [("hooks", 1), ("hooks", 2), ("explicit", 1), ("explicit", 2)],
    ids=["hooks", "hooks_accumulated", "explicit", "explicit_accumulated"],
)
def test_synced_parameter_gradients_match_the_reference(spatial, ranks, mode, backwards):
    ref = _train_reference(1, 9, 3, 5, backwards)
    for r, got in enumerate(spatial.run(train_grads, mode, None, 9, 3, 5, backwards, ranks=ranks)):
        for name, grad in ref.items():
            _close(got[name], grad, f"grad {name!r}", r)


@pytest.mark.parametrize(("ranks_", "spatial_size"), [(2, 1), (4, 2)], ids=["s1d2", "s2d2"])
def test_synced_gradients_average_over_data_groups(spatial, ranks_, spatial_size):
    data_size = ranks_ // spatial_size
    ref = _train_reference(data_size, 9, 3, 6, backwards=1)
    for mode in ("hooks", "explicit"):
        results = spatial.run(train_grads, mode, spatial_size, 9, 3, 6, 1, ranks=ranks_)
        for r, got in enumerate(results):
            for name, grad in ref.items():
                _close(got[name], grad, f"{mode} grad {name!r}", r)


def _check_everything(spatial, part: CellPartition, seed: int, timeout: float | None) -> None:
    __tracebackhide__ = True
    ref = model_of_everything(CellPartition.even(part.nside, 1), Topology.single(), seed)
    results = spatial.run(model_of_everything, part, None, seed, ranks=part.ranks, timeout=timeout)
    for r, got in enumerate(results):
        own = slice(part.bounds[r], part.bounds[r + 1])
        for name in ("gathered", "placed", "total", "loss"):
            _close(got[name], ref[name], name, r)
        _close(got["grad"], ref["grad"][:, own], f"grad (cells {own.start}:{own.stop})", r)
        _close(got["halo"], ref["gathered"][:, torch.from_numpy(part.halo(r))], "halo", r)


@pytest.mark.spatial(ranks=4)
def test_empty_ranks_take_part_in_every_collective_without_hanging(spatial):
    # Ranks 0, 2 and 3 own nothing; a short timeout turns a hang into a quick failure.
    _check_everything(spatial, CellPartition(1, (0, 0, 12, 12, 12)), seed=7, timeout=20)
    _check_everything(spatial, CellPartition(1, (0, 5, 5, 12, 12)), seed=8, timeout=20)


@DISTRIBUTED
@given(part=st.sampled_from([1, 2]).flatmap(lambda n: cell_partitions(nside=n, ranks=4)))
def test_every_collective_matches_the_reference_on_any_cell_partition(spatial, part):
    _check_everything(spatial, part, seed=9, timeout=30)


@DISTRIBUTED
@given(part=cell_partitions(nside=1, ranks=3))
def test_every_collective_matches_the_reference_on_three_ranks(spatial, part):
    _check_everything(spatial, part, seed=10, timeout=30)


@DISTRIBUTED
@given(part=latlon_partitions(ranks=4, max_nlat=9, max_nlon=12))
def test_assembled_lat_lon_fields_match_the_reference_on_any_grid(spatial, part):
    ref = latlon_model(LatLonPartition(part.nlat, part.nlon), Topology.single(), seed=11)
    for r, got in enumerate(spatial.run(latlon_model, part, None, 11, ranks=4, timeout=30)):
        _close(got["full"], ref["full"], "assembled field", r)
        _close(got["loss"], ref["loss"], "area-weighted loss", r)
        _close(got["grad"], ref["grad"][:, torch.from_numpy(part.index(r))], "grad", r)


def test_a_position_owned_twice_fails_on_every_rank_instead_of_hanging(spatial):
    with pytest.raises(RankError) as info:
        spatial.run(assemble_twice_owned, ranks=4, timeout=20)
    assert sorted(info.value.ranks) == [0, 1, 2, 3], "every rank reaches the same verdict"
    assert "1 owned by several (first: 0, by ranks 0, 1)" in str(info.value)
    assert "1 position owned by no rank (first: 1)" in str(info.value)


def test_a_wrong_shard_length_on_one_rank_fails_on_every_rank_naming_it(spatial):
    with pytest.raises(RankError) as info:
        spatial.run(halo_with_wrong_length, 2, ranks=4, timeout=20)
    assert sorted(info.value.ranks) == [0, 1, 2, 3]
    assert "rank 2/4: x's length along dim is not the rank's number of cells" in str(info.value)


@DISTRIBUTED
@given(
    part=st.sampled_from([4, 2]).flatmap(
        lambda r: latlon_partitions(ranks=r, max_nlat=9, max_nlon=12)
    ),
    width=st.sampled_from([1, 2]),
    pole=st.sampled_from(["zeros", "edge"]),
)
def test_a_lat_lon_halo_matches_the_reference_padding_forward_and_backward(
    spatial, part, width, pole
):
    if width > min(*part.lat_sizes, *part.lon_sizes):
        return  # refused for such grids: a test of its own below
    ref = stencil_model(part, width, pole, seed=12, reference=True)
    got = spatial.run(stencil_model, part, width, pole, 12, ranks=part.ranks, timeout=30)
    for r, g in enumerate(got):
        rows, cols = part.slices(r)
        block = (slice(rows.start, rows.stop + 2 * width), slice(cols.start, cols.stop + 2 * width))
        _close(g["padded"], ref["padded"][:, block[0], block[1]], "padded block", r)
        _close(g["out"], ref["out"][:, rows, cols], "stencil output", r)
        _close(g["loss"], ref["loss"], "loss", r)
        _close(g["grad"], ref["grad"][:, rows, cols], "gradient through the halo", r)


def test_the_reference_halo_wraps_longitudes_and_pads_the_poles():
    x = torch.arange(12.0).reshape(3, 4)
    part = LatLonPartition(3, 4)
    zeros = grid_halo_exchange(x, part, Topology.single(), width=1)
    assert zeros.tolist() == [
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [3.0, 0.0, 1.0, 2.0, 3.0, 0.0],
        [7.0, 4.0, 5.0, 6.0, 7.0, 4.0],
        [11.0, 8.0, 9.0, 10.0, 11.0, 8.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    edge = grid_halo_exchange(x, part, Topology.single(), width=1, pole="edge")
    assert edge[0].tolist() == edge[1].tolist() and edge[-1].tolist() == edge[-2].tolist()


def test_a_halo_wider_than_a_block_or_a_wrong_block_is_refused():
    with pytest.raises(ConfigError, match="width 3 is more than the narrowest block"):
        grid_halo_exchange(torch.zeros(2, 4), LatLonPartition(2, 4), Topology.single(), width=3)
    with pytest.raises(ConfigError, match=r"x ends in \(3, 4\) but spatial rank 0's block"):
        grid_halo_exchange(torch.zeros(3, 4), LatLonPartition(2, 4), Topology.single())
    with pytest.raises(ConfigError, match="pole must be one of"):
        grid_halo_exchange(torch.zeros(2, 4), LatLonPartition(2, 4), Topology.single(), pole="wrap")
