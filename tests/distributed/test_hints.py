"""Hints computed from the evidence: each one, from a case that really has that bug."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import Outputs, Shard, SpatialCase, Topology, check_equivalence, data_share
from harness._judges import BATCH_HINT, SHARD_HINT
from harness.collectives import grid_halo_exchange, reduce_loss, spatial_sum, sync_gradients
from harness.compare import EquivalenceReport
from harness.partition import LatLonPartition
from harness.steppers.mlp import CoupledMLP, CoupledMLPCase
from tests.distributed import band
from tests.distributed.band import FAULTS, HALO_FAULTS, BandCase

NLAT, NLON, H, W = 16, 24, 2, 2


class Stencil(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernel = torch.nn.Parameter(torch.randn(2, 2, 3, 3) / 9)


class StencilCase(SpatialCase):
    """A 3 x 3 stencil on a lat x lon grid; ``no-halo`` pads each block with zeros instead
    of its neighbours' cells (the bug: right inside every block, wrong on its edges)."""

    name, dtype = "stencil", torch.float64

    def __init__(self, fault: str = "") -> None:
        self.fault = fault

    def part(self, topo: Topology) -> LatLonPartition:
        if topo.spatial_group is None:
            return LatLonPartition(NLAT, NLON)
        return LatLonPartition(NLAT, NLON, H, W)

    def build(self, topo: Topology) -> torch.nn.Module:
        model = Stencil()
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        rows, cols = self.part(topo).slices(topo.spatial_rank)
        return torch.randn(2, 2, NLAT, NLON)[:, :, rows, cols]

    def forward(self, model: torch.nn.Module, x: torch.Tensor, topo: Topology) -> Outputs:
        part = self.part(topo)
        if self.fault == "no-halo" and topo.spatial_group is not None:
            padded = F.pad(x, (1, 1, 1, 1))  # the bug: the neighbours' cells never come
        else:
            padded = grid_halo_exchange(x, part, topo, width=1)
        y = F.conv2d(padded, model.kernel)
        loss = reduce_loss((y**2).sum(), topo) / y.new_tensor(2 * 2 * NLAT * NLON)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        rows, cols = part.slices(topo.spatial_rank)
        return Outputs(loss, {"y": Shard.grid(y, rows, cols, NLAT, NLON)})


def test_a_missing_halo_is_named_from_errors_on_the_block_edges(spatial):
    assert check_equivalence(StencilCase(), ranks=4, pool=spatial.pool(4)).ok
    report = check_equivalence(StencilCase("no-halo"), ranks=4, pool=spatial.pool(4))
    field = next(m for m in report.mismatches if m.quantity == "field")
    assert "latitude" not in field.hint and "border another rank" in field.hint
    assert field.hint.startswith("the ") and "a halo exchange is off" in field.hint
    # the loss differs first, but the report's one line points at the halo, not the loss
    assert report.mismatches[0].quantity == "loss"
    assert report.likely == field.hint
    assert f"Likely cause: {field.hint}" in str(report)


class Float32Sum(CoupledMLP):
    """The global mean goes through float32 (a float32 buffer, say) in a float64 model."""

    def forward(self, x: torch.Tensor, npos: int, topo: Topology) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        total = spatial_sum(h.sum(dim=1).float(), topo).to(h.dtype)  # the bug
        return x + self.decoder(h + (total / npos)[:, None, :])


class Float32Case(CoupledMLPCase):
    name = "float32-collective"

    def build(self, topo: Topology) -> torch.nn.Module:
        model = Float32Sum(self.channels, self.hidden, self.faults)
        sync_gradients(model, topo)
        return model


def test_a_float32_step_in_a_float64_run_is_named_from_the_size_of_its_errors(spatial):
    report = check_equivalence(Float32Case(npos=16), ranks=4, pool=spatial.pool(4))
    assert not report.ok
    hinted = [m for m in report.mismatches if "float32 rounding" in m.hint]
    assert hinted and "(float32 rounding is 1e-07) in a float64 run" in hinted[0].hint
    # the evidence: the all_reduce under spatial_sum got a float32 tensor, named at the
    # model's line (not the harness's collectives.py under it)
    line = inspect.getsourcelines(Float32Sum.forward)[1] + 2
    assert f"and an all_reduce at test_hints.py:{line} ran in float32 on rank 0" in hinted[0].hint
    assert "float32 rounding" in report.likely


class BatchFromDataSize(CoupledMLPCase):
    """Sizes its global batch from topo.data_size: the reference (data_size 1) sees less."""

    name = "batch-from-data-size"

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        n = 2 * topo.data_size  # the bug
        x, target = torch.randn(n, self.npos, 3), torch.randn(n, self.npos, 3)
        rows = data_share(n, topo)
        return {"x": x[rows], "target": target[rows]}

    def forward(self, model, batch, topo):  # type: ignore[no-untyped-def]
        out = model(batch["x"], self.npos, topo)
        loss = reduce_loss(((out - batch["target"]) ** 2).sum(), topo) / out.numel()
        return Outputs(loss, {"out": out})


def test_a_global_batch_sized_from_the_data_groups_is_named_as_such(spatial):
    report = check_equivalence(
        BatchFromDataSize(npos=6), ranks=4, spatial_size=1, pool=spatial.pool(4)
    )
    batch = [m for m in report.mismatches if m.quantity == "batch"]
    assert batch and batch[0].where == (
        "the reference saw 2 samples, the 4 data groups 8 together (2, 2, 2, 2)"
    )
    assert batch[0].hint == BATCH_HINT and report.likely == BATCH_HINT


class Unflattened(StencilCase):
    """Returns each block as it is, (..., rows, cols), with Shard.grid's flat index."""

    def forward(self, model, x, topo):  # type: ignore[no-untyped-def]
        out = super().forward(model, x, topo)
        shard = out.fields["y"]
        if not isinstance(shard, Shard):
            return out
        rows, _ = self.part(topo).slices(topo.spatial_rank)
        block = shard.values.reshape(*shard.values.shape[:-1], rows.stop - rows.start, -1)
        return Outputs(out.loss, {"y": Shard(block, shard.index, -1, shard.grid_shape)})


class PlainBlock(StencilCase):
    """Returns each rank's block as a plain tensor, as if it were the whole field."""

    def forward(self, model, x, topo):  # type: ignore[no-untyped-def]
        out = super().forward(model, x, topo)
        rows, _ = self.part(topo).slices(topo.spatial_rank)
        if topo.spatial_group is None:
            return out
        values = out.fields["y"].values  # type: ignore[union-attr]
        return Outputs(
            out.loss, {"y": values.reshape(*values.shape[:-1], rows.stop - rows.start, -1)}
        )


def test_a_plain_tensor_for_a_block_suggests_shard_grid(spatial):
    report = check_equivalence(PlainBlock(), ranks=4, pool=spatial.pool(4))
    assert any(SHARD_HINT in m.hint for m in report.mismatches), report
    assert "Shard.grid" in report.likely


def test_an_unflattened_block_is_refused_on_its_rank_with_shard_grid_as_the_fix(spatial):
    report = check_equivalence(Unflattened(), ranks=4, pool=spatial.pool(4))
    errors = [m for m in report.mismatches if m.quantity == "error"]
    assert errors  # every rank returns its block this way: whichever raised first is named
    assert errors[0].where.startswith("ConfigError: stencil.forward: Shard of field 'y' has ")
    assert (
        "its last two dims are a (rows, cols) block, not flattened: use "
        "Shard.grid(values, rows, cols, nlat, nlon)"
    ) in errors[0].where.splitlines()[0]


# ---------------------------------------------------------------- no hint without evidence

LOGIC_BUGS = [f for f in FAULTS if f not in ("hooks-twice", "float32-mean")]
#: a team's learning rate: after one step the parameters of a buggy run are only ~1e-6
#: (relative) off the reference's, and the next step's values too, which is float32's size
#: (before the float32 hint needed a float32 value seen, every logic bug below got it)
LR = 1e-4


def _hints(report: EquivalenceReport) -> list[str]:
    return [m.hint for m in report.mismatches if m.hint] + (
        [report.likely] if report.likely else []
    )


def test_the_band_model_without_a_bug_is_equivalent(spatial):
    spatial.check(BandCase(), ranks=4, lr=LR)


@pytest.mark.parametrize("fault", LOGIC_BUGS)
def test_a_logic_bug_of_a_team_s_band_model_fails_without_a_hint_its_evidence_does_not_earn(
    spatial, fault
):
    report = check_equivalence(BandCase(fault), ranks=4, lr=LR, pool=spatial.pool(4))
    assert not report.ok
    hints = _hints(report)
    # parameters move only a little after one SGD step: float32-sized errors, no float32
    assert not any("float32" in h for h in hints), report
    assert not any("exactly" in h or "all zeros" in h for h in hints), report  # no factor
    if fault not in HALO_FAULTS:  # the boundary hint only for a halo bug, if at all
        assert not any("border another rank" in h for h in hints), report


def test_a_float32_all_reduce_in_the_band_model_is_named_with_its_line(spatial):
    report = check_equivalence(BandCase("float32-mean"), ranks=4, lr=LR, pool=spatial.pool(4))
    # the line of the team's all_reduce (SumOverRanks.forward), which got the float32 tensor
    line = next(
        n
        for n, text in enumerate(inspect.getsource(band).splitlines(), 1)
        if "dist.all_reduce(x, group=group)" in text
    )
    assert "float32 rounding" in report.likely, report
    assert f"in a float64 run, and an all_reduce at band.py:{line} ran in float32 on rank 0" in (
        report.likely
    )


def test_gradient_hooks_registered_twice_are_named_as_an_exact_factor(spatial):
    report = check_equivalence(BandCase("hooks-twice"), ranks=4, lr=LR, pool=spatial.pool(4))
    assert report.likely == "exactly 4x the reference: a reduction counted 4 times", report


class ReceivesFirst(SpatialCase):
    """Each of two ranks receives the other's value before sending its own: they wait for
    each other, and no rank returned, so no rank is the culprit."""

    name, dtype = "receives-first", torch.float64

    def build(self, topo: Topology) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.ones(1, 1)

    def forward(self, model: torch.nn.Module, batch: torch.Tensor, topo: Topology) -> Outputs:
        if topo.spatial_group is not None:
            other = topo.spatial_ranks[1 - topo.spatial_rank]
            value = torch.zeros(1)
            dist.recv(value, other, group=topo.spatial_group)  # the bug: both receive first
            dist.send(value, other, group=topo.spatial_group)
        return Outputs(model(batch).sum())


@pytest.mark.spatial_pool  # a hang stops the ranks, which the pool then replaces
def test_ranks_waiting_for_each_other_get_no_returned_rank_culprit(spatial):
    report = check_equivalence(ReceivesFirst(), ranks=2, timeout=60, pool=spatial.pool(2))
    assert report.quantities == {"deadlock"}, report
    assert report.likely == "" and "Likely cause" not in str(report)
