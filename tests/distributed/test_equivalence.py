"""check_equivalence on the built-in coupled-MLP case: passes when right, names the bug when not."""

from __future__ import annotations

import os

import pytest
import torch

import harness
from harness import ConfigError, Outputs, Shard, SpatialCase, Tolerance, Topology, check_equivalence
from harness.collectives import reduce_loss, sync_gradients
from harness.steppers.mlp import CoupledMLPCase, position_range


@pytest.mark.parametrize(
    ("ranks", "spatial_size", "npos"),
    [
        (1, None, 5),
        (2, None, 37),
        (3, None, 37),
        (4, None, 37),
        (4, 2, 37),
        (4, 1, 37),
        (4, None, 3),
    ],
    ids=["r1", "r2", "r3_uneven", "r4_uneven", "s2d2", "s1d4", "r4_empty_rank"],
)
def test_the_correct_case_is_equivalent_on_every_layout(spatial, ranks, spatial_size, npos):
    case = CoupledMLPCase(npos=npos, batch_size=4)
    report = check_equivalence(
        case, ranks=ranks, spatial_size=spatial_size, pool=spatial.pool(ranks)
    )
    assert report.ok, report
    # float64 logic check: everything agrees to rounding (see Tolerance.for_dtype)
    assert max(report.worst(q) for q in ("loss", "grad", "field", "param")) < 1e-10


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("no-grad-sync", {"grad", "sync"}),
        ("wrong-shard-index", {"field"}),
        pytest.param(
            "non-differentiable-reduce",
            {"grad"},
            # torch's own warning about this very bug; the check must catch it regardless
            marks=pytest.mark.filterwarnings(
                "ignore:.*an autograd kernel was not registered:UserWarning"
            ),
        ),
    ],
)
def test_each_hand_broken_variant_fails_with_the_quantity_that_shows_it(spatial, fault, expected):
    report = check_equivalence(CoupledMLPCase(faults=(fault,)), ranks=4, pool=spatial.pool(4))
    assert not report.ok
    assert expected <= report.quantities, report
    first = report.mismatches[0]
    assert first.step == 0 and first.quantity in expected
    text = str(report)
    assert "What to do:" in text and first.quantity in text


def test_missing_gradient_sync_is_named_as_such_with_rank_step_and_position(spatial):
    report = check_equivalence(
        CoupledMLPCase(faults=("no-grad-sync",)), ranks=4, pool=spatial.pool(4)
    )
    text = str(report)
    assert "First: rank 0: grad 'encoder.weight' at step 0" in text
    assert "sync" in text and "differs from spatial rank 0" in text
    assert "summed once over the spatial group" in text  # the remedy, in the evidence's words


def test_a_wrong_shard_index_names_the_position_and_its_owner(spatial):
    report = check_equivalence(
        CoupledMLPCase(faults=("wrong-shard-index",), npos=8),
        ranks=4,
        pool=spatial.pool(4),
    )
    (m, *_) = report.mismatches
    assert m.quantity == "field" and m.name == "out"
    assert "position" in m.where and "on rank" in m.where


class UnseededInit(SpatialCase):
    """Initialises from a generator of its own, seeded per rank: the classic bug."""

    dtype = torch.float64

    def build(self, topo: Topology) -> torch.nn.Module:
        g = torch.Generator().manual_seed(100 + topo.rank + topo.world_size)
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.copy_(torch.randn(2, 2, generator=g))
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(4, 2)

    def forward(self, model, batch, topo):
        loss = reduce_loss(model(batch).pow(2).sum() / topo.spatial_size, topo)
        return Outputs(loss)


def test_initial_parameters_that_differ_between_ranks_are_reported_as_such(spatial):
    report = check_equivalence(UnseededInit(), ranks=2, pool=spatial.pool(2))
    init = [m for m in report.mismatches if m.step is None]
    assert {m.rank for m in init} == {0, 1}
    assert init[0].name == "weight" and "seed the initialisation" in init[0].hint


class RaisesOnRank(SpatialCase):
    dtype = torch.float64

    def build(self, topo):
        if topo.spatial_rank == 1:
            raise RuntimeError("shape mismatch in halo buffer")
        return torch.nn.Linear(1, 1)

    def batch(self, topo, step):
        return torch.ones(1, 1)

    def forward(self, model, batch, topo):
        return Outputs(model(batch).sum())


class SkipsCollectiveWhenEmpty(SpatialCase):
    """Rank 3 'has no observations' and skips the loss reduction: the others wait forever."""

    dtype = torch.float64

    def build(self, topo):
        return torch.nn.Linear(1, 1)

    def batch(self, topo, step):
        return torch.ones(1, 1)

    def forward(self, model, batch, topo):
        local = model(batch).sum()
        if topo.spatial_rank == 3:
            return Outputs(local)
        return Outputs(reduce_loss(local, topo))


@pytest.mark.spatial_pool  # a rank that raises or hangs in place takes pytest with it
def test_an_exception_on_one_rank_becomes_an_error_mismatch_with_its_traceback(spatial):
    report = check_equivalence(RaisesOnRank(), ranks=2, pool=spatial.pool(2))
    assert report.quantities == {"error"}
    m = report.mismatches[0]
    assert m.rank == 1 and "shape mismatch in halo buffer" in m.where
    assert "raise RuntimeError" in m.detail
    assert check_equivalence(CoupledMLPCase(), ranks=2, pool=spatial.pool(2)).ok


@pytest.mark.spatial_pool  # a rank that raises or hangs in place takes pytest with it
def test_a_skipped_collective_becomes_a_deadlock_mismatch_with_the_waiting_stacks(spatial):
    report = check_equivalence(
        SkipsCollectiveWhenEmpty(), ranks=4, timeout=60, pool=spatial.pool(4)
    )
    assert report.quantities == {"deadlock"}  # found by the watch, long before the timeout
    # the summary row travels to xdist's controller, which carries built-in types only
    assert all(type(q) is str for q in report.summary_row()["problems"])
    first = report.mismatches[0]
    assert first.rank == 3 and first.where.startswith("returned after")  # the culprit
    assert "never entered" in first.where
    # the likely cause is the proof's own words about the rank that returned
    assert report.likely == f"rank 3 {first.where}"
    waiting = [m for m in report.mismatches if m.quantity == "deadlock" and m.rank != 3]
    assert {m.rank for m in waiting} == {0, 1, 2}
    assert all("all_reduce" in m.detail for m in waiting)
    # each waiting rank says where it was: the step and phase of the case
    assert all(m.phase == "step 0 forward" and m.step == 0 for m in waiting)
    assert check_equivalence(CoupledMLPCase(), ranks=4, pool=spatial.pool(4)).ok


class Overlapping(CoupledMLPCase):
    """Every rank claims position 0 as well as its own: coverage must catch it."""

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        if topo.spatial_group is None:
            return out
        pos = position_range(self.npos, topo)
        idx = torch.arange(pos.start, pos.stop)
        idx[0] = 0
        return Outputs(out.loss, {"out": Shard(out.fields["out"].values, idx, dim=1)})


def test_positions_owned_twice_or_never_are_a_coverage_mismatch(spatial):
    report = check_equivalence(Overlapping(npos=8), ranks=4, pool=spatial.pool(4))
    cov = [m for m in report.mismatches if m.quantity == "coverage"]
    assert cov and cov[0].where == (
        "3 positions owned by no rank (first: position 2); "
        "1 owned by several (first: position 0, by ranks 0, 1, 2, 3)"
    )


def test_a_float32_case_uses_float32_tolerances(spatial):
    report = check_equivalence(CoupledMLPCase(dtype=torch.float32), ranks=4, pool=spatial.pool(4))
    assert report.ok, report
    assert report.tolerance == Tolerance.for_dtype(torch.float32)


def test_bad_sizes_are_refused_with_the_fix():
    with pytest.raises(harness.ConfigError, match="choose one of"):
        check_equivalence(CoupledMLPCase(), ranks=4, spatial_size=3)
    with pytest.raises(harness.ConfigError, match="subclass SpatialCase"):
        check_equivalence(object(), ranks=2)  # type: ignore[arg-type]


class ShortShard(CoupledMLPCase):
    """Rank 1 claims one position fewer than it returns values for."""

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        if topo.spatial_rank != 1:
            return out
        shard = out.fields["out"]
        return Outputs(out.loss, {"out": Shard(shard.values, shard.index[:-1], dim=1)})


class OutOfRange(CoupledMLPCase):
    """Rank 3 reports a position past the end of the field."""

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        if topo.spatial_rank != 3:
            return out
        shard = out.fields["out"]
        return Outputs(out.loss, {"out": Shard(shard.values, shard.index + 1, dim=1)})


@pytest.mark.parametrize(
    ("case", "quantity", "says"),
    [
        pytest.param(
            ShortShard,
            "error",
            "Shard of field 'out' has 1 positions in its index but 2 values",
            id="shape",
            # rank 1 raises while the others gather: in place that takes pytest with it
            marks=pytest.mark.spatial_pool,
        ),
        pytest.param(OutOfRange, "coverage", "out of range", id="range"),
    ],
)
def test_a_malformed_shard_is_named_with_its_rank(spatial, case, quantity, says):
    report = check_equivalence(case(npos=8), ranks=4, pool=spatial.pool(4))
    bad = [m for m in report.mismatches if m.quantity == quantity and says in m.where]
    assert {m.rank for m in bad} == {1 if case is ShortShard else 3}


# ---------------------------------------------------------------- non-finite values


class NanLoss(CoupledMLPCase):
    """A model whose loss is NaN everywhere: the reference's and every rank's."""

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        return Outputs(out.loss * float("nan"), out.fields)


class NanOnlyInTheReference(CoupledMLPCase):
    """The single-process path divides by a count that is zero there (a bug of its own)."""

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        if topo.spatial_group is None:
            y = out.fields["out"].clone()
            y[0, 2, 1] = float("inf")
            return Outputs(out.loss, {"out": y})
        return out


@pytest.mark.parametrize(
    ("ranks", "spatial_size"),
    [(1, None), (4, 1), (4, None)],
    ids=["one-rank", "spatial-groups-of-one", "four-ranks"],
)
def test_a_nan_loss_fails_as_nonfinite_on_every_layout(spatial, ranks, spatial_size):
    report = check_equivalence(
        NanLoss(npos=8, batch_size=4),
        ranks=ranks,
        spatial_size=spatial_size,
        pool=spatial.pool(ranks),
    )
    assert not report.ok
    first = report.mismatches[0]
    assert (first.quantity, first.run, first.of, first.step) == (
        "nonfinite",
        "reference",
        "loss",
        0,
    )
    assert {m.rank for m in report.mismatches if m.quantity == "nonfinite" and not m.run} == set(
        range(ranks)
    )
    assert "sync" not in report.quantities  # identical NaNs are in sync


def test_a_nonfinite_reference_field_is_named_as_the_reference(spatial):
    report = check_equivalence(NanOnlyInTheReference(npos=8), ranks=2, pool=spatial.pool(2))
    nonfinite = [m for m in report.mismatches if m.quantity == "nonfinite"]
    assert [(m.run, m.of, m.name, m.where) for m in nonfinite] == [
        ("reference", "field", "out", "(0, 2, 1) (1 inf)")
    ] * 2  # at each step
    assert "field" in report.quantities  # and the ranks' finite value differs from it


class ExpectsNan(NanLoss):
    expect_nonfinite = True


def test_a_case_that_expects_nonfinite_values_passes_when_they_match(spatial):
    assert check_equivalence(ExpectsNan(npos=8), ranks=2, pool=spatial.pool(2)).ok


# ---------------------------------------------------------------- where a failure happened


class CrashInForward(CoupledMLPCase):
    def forward(self, model, batch, topo):
        if topo.spatial_rank == 1:
            os._exit(9)
        return super().forward(model, batch, topo)


class RaiseInBackward(CoupledMLPCase):
    """Rank 0's backward raises at step 1 (the case object is fresh on every run)."""

    def build(self, topo):
        self.calls = 0
        return super().build(topo)

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        if topo.spatial_group is not None and topo.spatial_rank == 0 and self.calls == 1:
            out.loss.register_hook(_raise)
        self.calls += 1
        return out


def _raise(grad):
    raise FloatingPointError("overflow in the decoder's backward")


@pytest.mark.spatial_pool
def test_a_crash_in_forward_names_the_step_and_phase(spatial):
    report = check_equivalence(CrashInForward(npos=8), ranks=2, pool=spatial.pool(2))
    crash = next(m for m in report.mismatches if m.quantity == "crash")
    assert (crash.rank, crash.step, crash.phase) == (1, 0, "step 0 forward")
    assert crash.headline().startswith("rank 1: crash 'coupled-mlp' in step 0 forward")


@pytest.mark.spatial_pool
def test_an_error_in_backward_names_the_step_and_phase(spatial):
    report = check_equivalence(RaiseInBackward(npos=8), ranks=2, pool=spatial.pool(2))
    error = report.mismatches[0]
    assert (error.quantity, error.rank, error.step, error.phase) == (
        "error",
        0,
        1,
        "step 1 backward",
    )
    assert "FloatingPointError: overflow in the decoder's backward" in error.where


# ---------------------------------------------------------------- unusual but valid cases


class NoParameters(SpatialCase):
    """A model without parameters: a partitioned doubling, checked on loss and fields."""

    dtype = torch.float64

    def build(self, topo):
        return torch.nn.Identity()

    def batch(self, topo, step):
        x = torch.randn(2, 6)
        pos = position_range(6, topo)
        return x[:, pos.start : pos.stop]

    def forward(self, model, x, topo):
        y = 2 * model(x)
        loss = reduce_loss((y**2).sum(), topo) / 12
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        pos = position_range(6, topo)
        return Outputs(loss, {"y": Shard(y, torch.arange(pos.start, pos.stop), dim=1)})


def test_a_model_without_parameters_is_checked_on_loss_and_fields(spatial):
    report = check_equivalence(NoParameters(), ranks=4, pool=spatial.pool(4))
    assert report.ok, report
    assert report.worst("field") is not None and report.worst("grad") is None


class Float32Step(NoParameters):
    """A float64 case whose partitioned run rounds its output through float32 once."""

    def forward(self, model, x, topo):
        if topo.spatial_group is not None:
            x = x.float().double() + 0.0
        return super().forward(model, x, topo)


def test_a_case_can_declare_its_own_tolerance(spatial):
    pool = spatial.pool(4)
    assert check_equivalence(Float32Step(), ranks=4, pool=pool).quantities == {"field", "loss"}
    loose = Float32Step()
    # float32 rounding: relative errors up to 2**-24 ~ 6e-8; 1e-6 leaves a margin of ~17
    loose.tolerance = Tolerance.uniform(rtol=1e-6, atol=0.0)
    assert check_equivalence(loose, ranks=4, pool=pool).ok
    # a tolerance passed to check_equivalence still wins over the case's
    strict = check_equivalence(
        loose, ranks=4, pool=pool, tolerance=Tolerance.for_dtype(torch.float64)
    )
    assert not strict.ok


SCRIPT = """
import torch
from harness import RankPool, check_equivalence
from harness.steppers.mlp import CoupledMLPCase


class ScriptCase(CoupledMLPCase):  # lives in __main__: the ranks must load this file
    name = "script-case"


if __name__ == "__main__":
    with RankPool(2, start_method="forkserver", timeout=60) as pool:
        report = check_equivalence(ScriptCase(npos=6), ranks=2, pool=pool)
    print("OK" if report.ok else report)
"""


@pytest.mark.spatial_pool
def test_a_case_defined_in_a_scripts_main_module_runs_on_the_ranks(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "check_my_model.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.stdout.strip() == "OK", proc.stdout + proc.stderr


# ---------------------------------------------------------------- checks that prove nothing


class EveryRankTheWholeGlobe(CoupledMLPCase):
    """Each rank computes the whole globe alone and returns whole tensors: 'equivalent',
    but nothing was partitioned or communicated (ACE's parallel test once did this)."""

    def batch(self, topo, step):  # type: ignore[no-untyped-def]
        return super().batch(Topology.single(), step)

    def forward(self, model, batch, topo):  # type: ignore[no-untyped-def]
        return super().forward(model, batch, Topology.single())

    def build(self, topo):  # type: ignore[no-untyped-def]
        return super().build(Topology.single())


class WholeShards(EveryRankTheWholeGlobe):
    """Every rank returns a Shard that covers every position."""

    def forward(self, model, batch, topo):  # type: ignore[no-untyped-def]
        out = super().forward(model, batch, topo)
        if topo.spatial_group is None:
            return out
        y = out.fields["out"]
        return Outputs(out.loss, {"out": Shard(y, torch.arange(y.shape[1]), dim=1)})


class ReplicatedOnPurpose(EveryRankTheWholeGlobe):
    vacuous_ok = "a test of the replicated fallback path: every rank runs the whole model"


def test_a_check_that_partitions_and_communicates_nothing_fails_as_vacuous(spatial):
    report = check_equivalence(EveryRankTheWholeGlobe(), ranks=4, pool=spatial.pool(4))
    assert report.quantities == {"vacuous"}
    (m,) = report.mismatches
    assert m.where == (
        "no rank issued any torch.distributed operation and every field is a whole tensor (no "
        "Shard): each rank computed the whole problem alone"
    )
    assert "vacuous" in str(report) and 'vacuous_ok = "reason"' in str(report)


def test_shards_that_each_cover_the_whole_domain_are_vacuous(spatial):
    report = check_equivalence(WholeShards(), ranks=4, pool=spatial.pool(4))
    assert "vacuous" in report.quantities
    (m,) = [m for m in report.mismatches if m.quantity == "vacuous"]
    assert m.where == "every rank's Shard of 'out' covers the whole domain: the ranks split nothing"


def test_a_case_that_says_why_it_is_replicated_is_not_vacuous(spatial):
    assert check_equivalence(ReplicatedOnPurpose(), ranks=4, pool=spatial.pool(4)).ok


def test_a_vacuous_opt_out_without_a_reason_is_refused():
    class NoReason(EveryRankTheWholeGlobe):
        vacuous_ok = True  # type: ignore[assignment]

    with pytest.raises(ConfigError, match=r"vacuous_ok = True: give the reason as a sentence"):
        check_equivalence(NoReason(), ranks=2)


def test_one_spatial_rank_per_group_is_data_parallel_not_vacuous(spatial):
    # spatial groups of one: nothing to partition spatially; the data groups are the point
    case = CoupledMLPCase(batch_size=4)
    report = check_equivalence(case, ranks=4, spatial_size=1, pool=spatial.pool(4))
    assert report.ok, report
