"""The first divergence of hand-written models: each bug located to the module it lives in.

A lat x lon model written the way a user would (the guide's stencil with a halo, a global
mean fed back into every point, gradient hooks, noise), one bug at a time; the harness must
name the module that holds the bug, forward or backward, with no annotation beyond the
case's ``partition``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import (
    LatLonPartition,
    Outputs,
    Positions,
    Shard,
    SpatialCase,
    Topology,
    check_equivalence,
)
from harness.collectives import grid_halo_exchange, reduce_loss, spatial_sum, sync_gradients

RANKS = 4
NLAT, NLON, CH, BATCH = 8, 16, 2, 2


class Halo(torch.nn.Module):
    """The block plus one cell of each neighbour (``bug="wrong-neighbour"``: the northern
    halo row filled from the southern neighbour's; ``bug="stale"``: the halo of the previous
    call, around this call's block)."""

    def __init__(self, part: LatLonPartition, topo: Topology, bug: str | None) -> None:
        super().__init__()
        self.part, self.topo, self.bug = part, topo, bug
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = grid_halo_exchange(x, self.part, self.topo)
        if self.topo.spatial_group is None:
            return padded
        if self.bug == "wrong-neighbour":
            padded = torch.cat([padded[..., -1:, :], padded[..., 1:, :]], dim=-2)
        if self.bug == "stale":
            fresh, old = padded, self.last
            self.last = padded.detach()
            if old is not None:
                padded = old.clone()
                padded[..., 1:-1, 1:-1] = fresh[..., 1:-1, 1:-1]
        return padded


class GlobalMean(torch.nn.Module):
    """The global mean of each channel fed back to every point, with a learned gain
    (``bug="identity-backward"``: reduced with reduce_loss, whose backward is the identity)."""

    def __init__(self, topo: Topology, bug: str | None) -> None:
        super().__init__()
        self.topo, self.bug = topo, bug
        self.gain = torch.nn.Parameter(torch.full((CH,), -0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = reduce_loss if self.bug == "identity-backward" else spatial_sum
        mean = reduce(x.sum(dim=(-2, -1)), self.topo) / (NLAT * NLON)
        return x + self.gain[:, None, None] * mean[..., None, None]


class Noise(torch.nn.Module):
    """Noise drawn for the whole globe and sliced (``bug="rank-shaped"``: drawn at the
    rank's own shape, as a dropout mask often is)."""

    def __init__(self, rows: slice, cols: slice, bug: str | None) -> None:
        super().__init__()
        self.rows, self.cols, self.bug = rows, cols, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(7)
        if self.bug == "rank-shaped":
            noise = torch.randn(x.shape, generator=g, dtype=x.dtype)
        else:
            full = torch.randn((*x.shape[:-2], NLAT, NLON), generator=g, dtype=x.dtype)
            noise = full[..., self.rows, self.cols]
        return x + 0.1 * noise


class Block(torch.nn.Module):
    def __init__(self, topo: Topology, bug: str | None) -> None:
        super().__init__()
        self.mix = torch.nn.Conv2d(CH, CH, kernel_size=1)
        self.mixer = GlobalMean(topo, bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(torch.tanh(self.mix(x)))


class Emulator(torch.nn.Module):
    def __init__(self, part: LatLonPartition, topo: Topology, bugs: dict[str, str]) -> None:
        super().__init__()
        rows, cols = part.slices(topo.spatial_rank)
        self.noise = Noise(rows, cols, bugs.get("noise"))
        self.halo = Halo(part, topo, bugs.get("halo"))
        self.conv = torch.nn.Conv2d(CH, CH, kernel_size=3)  # no padding: the halo
        self.blocks = torch.nn.ModuleList(
            Block(topo, bugs.get("mixer") if i == 1 else None) for i in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.conv(self.halo(self.noise(x))))
        for block in self.blocks:
            y = block(y)
        return y


class EmulatorCase(SpatialCase):
    name, dtype = "emulator", torch.float64

    def __init__(self, **bugs: str) -> None:
        self.bugs = bugs

    def partition(self, topo: Topology) -> LatLonPartition:
        if topo.spatial_group is None:
            return LatLonPartition(NLAT, NLON)
        return LatLonPartition(NLAT, NLON, 2, 2)

    def build(self, topo: Topology) -> torch.nn.Module:
        model = Emulator(self.partition(topo), topo, self.bugs)
        if self.bugs.get("sync") == "part":  # the bug: hooks on the convolutions only
            sync_gradients(torch.nn.ModuleList([model.conv, *(b.mix for b in model.blocks)]), topo)
        else:
            sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        x, target = torch.randn(BATCH, CH, NLAT, NLON), torch.randn(BATCH, CH, NLAT, NLON)
        rows, cols = self.partition(topo).slices(topo.spatial_rank)
        return {"x": x[..., rows, cols], "target": target[..., rows, cols]}

    def forward(self, model: torch.nn.Module, batch: dict, topo: Topology) -> Outputs:
        y = model(batch["x"])
        loss = reduce_loss(((y - batch["target"]) ** 2).sum(), topo) / (BATCH * CH * NLAT * NLON)
        rows, cols = self.partition(topo).slices(topo.spatial_rank)
        if self.bugs.get("shard") == "elsewhere" and topo.spatial_rank == 1:
            rows, cols = self.partition(topo).slices(2)  # the bug: labelled as rank 2's block
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        return Outputs(loss, {"y": Shard.grid(y, rows, cols, NLAT, NLON)})


BUGS = {
    "halo": ({"halo": "wrong-neighbour"}, "forward of 'halo' (Halo)", "output"),
    "global-mean": (
        {"mixer": "identity-backward"},
        "backward of 'blocks.1.mixer' (GlobalMean)",
        "grad_input",
    ),
    "noise": ({"noise": "rank-shaped"}, "forward of 'noise' (Noise)", "output"),
    "hooks": ({"sync": "part"}, None, "grad 'blocks.2.mixer.gain'"),
    "stale-halo": ({"halo": "stale"}, "forward of 'halo' (Halo)", "output"),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_of_a_hand_written_model_is_located_in_its_module(spatial, bug):
    bugs, located, quantity = BUGS[bug]
    report = check_equivalence(EmulatorCase(**bugs), ranks=RANKS, pool=spatial.pool(RANKS))
    assert not report.ok
    found = report.first_divergence
    assert found is not None, report
    if located is None:  # a parameter's gradient: the backward of the module that owns it
        assert (found.direction, found.module) == ("backward", "blocks.2.mixer"), found.line()
    else:
        assert found.located == located, found.line()
    assert found.quantity == quantity, found.line()
    assert found.multiple > 1e6 and found.dtype == "float64"
    assert found.step == (1 if bug == "stale-halo" else 0)  # a stale halo is right at first
    line = next(x for x in str(report).splitlines() if x.startswith("First divergence:"))
    assert line == found.line() and repr(found.module) in line


def test_a_halo_bug_is_located_as_a_block_with_its_halo_and_the_line_says_where(spatial):
    report = check_equivalence(
        EmulatorCase(halo="wrong-neighbour"), ranks=RANKS, pool=spatial.pool(RANKS)
    )
    found = report.first_divergence
    assert found is not None
    assert "inputs match (max rel 0e+00)" in found.line()
    assert "lat" in found.where and "lon" in found.where  # placed in the padded reference
    assert report.location is not None and not report.location.not_compared


def test_the_correct_model_passes_with_nothing_departing_when_asked_to_locate(spatial):
    report = check_equivalence(EmulatorCase(), ranks=RANKS, pool=spatial.pool(RANKS), locate=True)
    assert report.ok, report
    assert report.first_divergence is None
    assert report.location is not None and report.location.compared > 50
    assert report.location.worst_multiple < 100  # ~10x below where a departure starts


def test_a_block_reported_at_another_ranks_position_is_named_with_where_it_belongs(spatial):
    # rank 1 holds lat 0:4, lon 8:16 and labels it rank 2's lat 4:8, lon 0:8: every module
    # matches, and its values are the reference's exactly, at the block it holds
    report = check_equivalence(
        EmulatorCase(shard="elsewhere"), ranks=RANKS, pool=spatial.pool(RANKS)
    )
    assert not report.ok
    found = report.first_divergence
    assert found is not None, report
    assert (found.located, found.cause, found.rank) == ("field 'y'", "misplaced", 1)
    assert _first_line(report).startswith(
        "First divergence: field 'y', step 0: rank 1's values are the reference's at "
        "(lat 0:4, lon 8:16), not at (lat 4:8, lon 0:8) where it puts them; at (lat 4:8, "
        "lon 0:8): max rel"
    ), _first_line(report)
    assert "  field 'y': rank 1 holds the reference's values of (lat 0:4, lon 8:16)" in str(report)


def test_locate_false_leaves_a_failing_check_unlocated(spatial):
    report = check_equivalence(
        EmulatorCase(halo="wrong-neighbour"), ranks=RANKS, pool=spatial.pool(RANKS), locate=False
    )
    assert not report.ok and report.first_divergence is None and report.location is None
    assert "First divergence" not in str(report)


# ---------------------------------------------------------------- blame only what shows

NPOS, C = 16, 3


class PointLinear(torch.nn.Module):
    """The same linear map at every position of a line: (batch, positions, channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(C, C) / C**0.5)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class Pick(torch.nn.Module):
    """Picks positions by index: the ranks pass their own local indices (0, 1, ...), the
    reference the global ones, so the index tensors differ by design and are not compared."""

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x[:, index]


class GlobalMix(torch.nn.Module):
    """Adds the global mean over the positions (``bug="identity-backward"``: summed with
    reduce_loss, whose backward is the identity)."""

    def __init__(self, topo: Topology, bug: str | None) -> None:
        super().__init__()
        self.topo, self.bug = topo, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = reduce_loss if self.bug == "identity-backward" else spatial_sum
        return x + (reduce(x.sum(dim=1), self.topo) / NPOS)[:, None, :]


class PointModel(torch.nn.Module):
    """A gain owned by the model itself, used first; a pointwise projection (called as a
    module, or with ``functional`` its parameters passed to F.linear on the ranks, as
    DTensor's local_map does); a global mean."""

    def __init__(self, topo: Topology, bugs: dict[str, str]) -> None:
        super().__init__()
        self.topo, self.functional = topo, bugs.get("call") == "functional"
        self.gain = torch.nn.Parameter(torch.full((C,), 1.5))
        self.pick = Pick()
        self.project = PointLinear()
        self.mix = GlobalMix(topo, bugs.get("mix"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pick(x * self.gain, torch.arange(x.shape[1]))
        if self.functional and self.topo.spatial_group is not None:
            h = F.linear(x, self.project.weight, self.project.bias)
        else:
            h = self.project(x)
        return self.mix(torch.tanh(h))


def _sum_hook(topo: Topology, mean: bool) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=topo.spatial_group)
        return grad / topo.spatial_size if mean else grad  # the bug: averaged

    return hook


class PointCase(SpatialCase):
    name, dtype = "points", torch.float64

    def __init__(self, **bugs: str) -> None:
        self.bugs = bugs

    def positions(self, topo: Topology) -> range:
        n = NPOS // topo.spatial_size
        return range(topo.spatial_rank * n, (topo.spatial_rank + 1) * n)

    def partition(self, topo: Topology) -> Positions:
        return Positions(NPOS, self.positions(topo))

    def build(self, topo: Topology) -> torch.nn.Module:
        model = PointModel(topo, self.bugs)
        if topo.spatial_group is not None:
            for p in model.parameters():
                p.register_hook(_sum_hook(topo, self.bugs.get("sync") == "mean"))
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = torch.randn(2, NPOS, C), torch.randn(2, NPOS, C)
        mine = slice(self.positions(topo).start, self.positions(topo).stop)
        return x[:, mine], target[:, mine]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        x, target = batch
        y = model(x)
        local = ((y - target) ** 2).sum()
        loss = local if self.bugs.get("loss") == "unreduced" else reduce_loss(local, topo)
        loss = loss / (2 * NPOS * C)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        index = torch.tensor(list(self.positions(topo)))
        return Outputs(loss, {"y": Shard(y, index, dim=1)})


def _first_line(report: Any) -> str:
    return next(x for x in str(report).splitlines() if x.startswith("First divergence:"))


def test_a_point_model_without_a_bug_has_nothing_departing_its_local_indices_not_compared(
    spatial,
):
    report = check_equivalence(PointCase(), ranks=RANKS, pool=spatial.pool(RANKS), locate=True)
    assert report.ok, report
    assert report.location is not None and report.location.compared > 10
    assert report.first_divergence is None, report.first_divergence.line()  # pick's indices


def test_gradients_averaged_by_a_hook_are_blamed_on_the_synchronisation_as_the_hint_says(spatial):
    report = check_equivalence(PointCase(sync="mean"), ranks=RANKS, pool=spatial.pool(RANKS))
    found = report.first_divergence
    assert found is not None, report
    assert (found.cause, found.located) == (
        "synchronisation",
        "gradient synchronisation of 'project.weight'",
    )
    assert _first_line(report).startswith(
        "First divergence: gradient synchronisation of 'project.weight' (backward, owner "
        "'project' (PointLinear)), step 0: the gradient of 'project.weight' departs after its "
        "synchronisation: the ranks' gradients before it add up to the reference's"
    )
    assert report.likely == "exactly 1/4 of the reference: averaged where it should sum"
    text = str(report)
    assert "  gradient synchronisation of 'project.weight': the ranks' gradients of" in text


def test_a_backward_bug_below_a_parameter_of_the_model_itself_is_located_in_its_module(spatial):
    # the gain is the model's own and used first: its gradient is complete only at the end
    # of the backward, so it is judged there, after the module whose backward is wrong
    report = check_equivalence(
        PointCase(mix="identity-backward"), ranks=RANKS, pool=spatial.pool(RANKS)
    )
    found = report.first_divergence
    assert found is not None, report
    assert (found.located, found.quantity) == ("backward of 'mix' (GlobalMix)", "grad_input")
    assert "  backward of 'mix' (GlobalMix): the gradient it received matches" in str(report)


def test_a_module_the_ranks_never_call_is_skipped_and_the_loss_bug_located(spatial):
    report = check_equivalence(
        PointCase(call="functional", loss="unreduced"), ranks=RANKS, pool=spatial.pool(RANKS)
    )
    found = report.first_divergence
    assert found is not None, report
    assert found.located == "forward of the loss", found.line()
    assert report.location is not None and report.location.not_run == ["'project' (PointLinear)"]
    text = str(report)
    assert "inf x" not in text and "not run on this rank" not in text
    assert "Not compared (called in the reference, on no rank" in text


def test_a_parameter_of_the_model_itself_is_judged_where_its_gradient_is_complete():
    # the gain is used in the model's first line: its gradient is accumulated after every
    # module's backward, not at the start of the backward where the model's own hooks fire
    from harness.equivalence._locating import _traced

    trace = _traced(PointCase(), Topology.single(), 0, 0.1, 0, False, True)
    order = [(e.kind, e.module, e.slot) for e in trace.events]
    gain = order.index(("param_grad", "", "gain"))
    assert gain > order.index(("grad_input", "pick", "0.0"))  # pick consumes x * gain
    assert gain > order.index(("param_grad", "project", "project.weight"))


class Double(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class DTensorModel(torch.nn.Module):
    """On the ranks the middle of the model runs on DTensors sharded along the positions
    (``bug``: the ranks' path scales by 3, the reference's by 2)."""

    def __init__(self, topo: Topology, bug: bool) -> None:
        super().__init__()
        self.topo = topo
        self.project = PointLinear()
        self.twice = Double(3.0 if bug and topo.spatial_group is not None else 2.0)
        self.mesh: Any = None
        if topo.spatial_group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh = DeviceMesh.from_group(topo.spatial_group, "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        if self.mesh is None:
            return self.twice(h)
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Shard as Sharded

        h = DTensor.from_local(h, self.mesh, [Sharded(1)], run_check=False)
        return self.twice(h).to_local()


class DTensorCase(PointCase):
    name = "dtensor"

    def build(self, topo: Topology) -> torch.nn.Module:
        model = DTensorModel(topo, bool(self.bugs.get("dtensor")))
        if topo.spatial_group is not None:
            for p in model.parameters():
                p.register_hook(_sum_hook(topo, False))
        return model


def test_a_bug_on_dtensor_values_is_located_from_their_local_shards_as_placed(spatial):
    assert check_equivalence(DTensorCase(), ranks=RANKS, pool=spatial.pool(RANKS), locate=True)
    report = check_equivalence(DTensorCase(dtensor="x3"), ranks=RANKS, pool=spatial.pool(RANKS))
    assert not report.ok
    found = report.first_divergence
    assert found is not None, report
    assert (found.located, found.quantity) == ("forward of 'twice' (Double)", "output")
    assert found.where.startswith(f"[0, position {4 * found.rank}") and found.max_rel > 0.1
    assert report.location is not None and not report.location.unreadable


class _OneRankPool:
    """Stands in for a pool: its one rank's trace is the reference's own."""

    world_size = 1

    def run(self, fn: Any, case: Any, *args: Any, timeout: Any = None) -> list[Any]:
        from harness.equivalence._locating import _traced

        return [_traced(case, Topology.single(), 0, 0.1, 0, False, True)]


def test_a_judgement_that_raises_is_a_not_located_line_never_an_exception(monkeypatch):
    import harness.equivalence._locating

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("aten.sub.Tensor got mixed torch.Tensor and DTensor")

    monkeypatch.setattr(harness.equivalence._locating, "first_divergence", broken)
    found = harness.equivalence._locating.locate(
        PointCase(), _OneRankPool(), spatial_size=1, step=0, lr=0.1, seed=0
    )  # type: ignore[arg-type]
    assert found.first is None
    assert found.lines() == [
        "First divergence: not located: judging the hooked rerun raised RuntimeError: "
        "aten.sub.Tensor got mixed torch.Tensor and DTensor"
    ]
