"""The evidence hints stand on, rule by rule: each is given on its evidence and not without.

The distributed side (a team's band model with each bug) is in
``tests/distributed/test_hints.py``.
"""

from __future__ import annotations

import pytest
import torch

from harness import Outputs, SpatialCase, Topology
from harness.compare import FAILURES, Quantity
from harness.equivalence import _culprit, failure_mismatches, run_case
from harness.errors import ProblemKind, RankFailure, RankProblem
from harness.report.hints import (
    boundary_hint,
    by_chance,
    precision_hint,
    scale_hint,
    shard_shape_hint,
)

F64 = torch.float64


class Cast(torch.nn.Module):
    """A module that hands its input on in float32 (a team's ``.float()`` for an op)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


class WithCast(SpatialCase):
    dtype = F64

    def __init__(self, cast: bool) -> None:
        self.cast = cast

    def build(self, topo: Topology) -> torch.nn.Module:
        layers = [torch.nn.Linear(3, 3)] + ([Cast()] if self.cast else [])
        return torch.nn.Sequential(*layers)

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(4, 3)

    def forward(self, model: torch.nn.Module, x: torch.Tensor, topo: Topology) -> Outputs:
        return Outputs(model(x).double().pow(2).mean())


def test_a_module_s_float32_output_in_a_float64_run_is_recorded_with_its_name_and_count():
    record = run_case(WithCast(cast=True), Topology.single(), steps=2, lr=0.1, seed=0)
    # the first module out in float32 is named; the count is every module call with a
    # float32 output (Cast and the Sequential around it, two steps)
    assert record.dtypes == {"float32": "the output of '1' (Cast) was float32 (4 module calls)"}


def test_a_float64_run_with_only_float64_values_records_no_other_dtype_and_leaves_no_hook():
    record = run_case(WithCast(cast=False), Topology.single(), steps=1, lr=0.1, seed=0)
    assert record.dtypes == {}
    assert not torch.nn.modules.module._global_forward_hooks  # the watch is gone


def test_float32_seen_with_errors_larger_than_float32_rounding_is_no_precision_hint():
    e = torch.linspace(1, 2, 50, dtype=F64)
    seen = "an all_reduce at m.py:4 ran in float32"
    assert precision_hint(e * (1 + 1e-7), e, 1e-12, seen).startswith("relative errors of 1e-07")
    assert precision_hint(e * (1 + 1e-3), e, 1e-12, seen) == ""  # a logic bug's size
    assert precision_hint(e * (1 + 1e-7), e, 1e-12) == ""  # no float32 seen


@pytest.mark.parametrize(
    ("relative", "hint"),
    [
        (1e-10, False),  # under 1e-3 float32 epsilons (1.2e-10): float64's own reordering
        (1.5e-10, True),
        (1e-5, True),
        (1.5e-5, False),  # over 100 float32 epsilons (1.2e-5): more than rounding does
        (1e-4, False),  # a small logic bug (a parameter after one small step)
    ],
)
def test_only_errors_within_float32_roundings_window_are_called_float32_rounding(relative, hint):
    # the window is the rule: each side has a case just inside and just outside it
    e = torch.linspace(1, 2, 50, dtype=F64)
    seen = "an all_reduce at m.py:4 ran in float32"
    assert bool(precision_hint(e * (1 + relative), e, 1e-12, seen)) is hint


def test_entries_under_the_absolute_tolerance_do_not_count_against_the_precision_hint():
    # a value near zero has no meaningful relative error: only entries over atol are judged
    e = torch.linspace(1, 2, 50, dtype=F64)
    e[0] = 1e-14
    a = e * (1 + 1e-7)
    a[0] = 3e-14  # 200 % off, but 2e-14 below atol
    seen = "an all_reduce at m.py:4 ran in float32"
    assert precision_hint(a, e, 1e-12, seen).startswith("relative errors of 1e-07")


def test_boundary_errors_are_a_halo_only_beyond_chance():
    owners = torch.arange(4).repeat_interleave(16)  # 4 blocks of 16 on a line: 6 of 64 border
    error = torch.zeros(64, dtype=F64)
    error[16] = 1.0  # one position that borders: 6 in 64 do, so chance puts it there often
    assert boundary_hint(error, owners, 1e-6, None, "position") == ""
    error[[15, 31, 32]] = 1.0  # four of the six: 1e-4 by chance
    assert boundary_hint(error, owners, 1e-6, None, "position").startswith(
        "the 4 positions that differ all border another rank (6 of 64 positions do)"
    )
    assert by_chance(4, 4, 6 / 64) < 1e-3 < by_chance(2, 2, 6 / 64)


def _problem(rank: int, kind: str, summary: str) -> RankProblem:
    return RankProblem(rank, kind, summary)


SKIPPED = (
    "returned after 0.50s having issued 2 collectives on group 0, while rank(s) 0, 1, 2 wait "
    "for its part in an operation it never entered: the culprit (did it skip a collective, a "
    "send or a receive the others issued?)"
)
MISMATCHED = (
    "returned after 0.50s; rank(s) 0 wait in a collective it entered as a different operation "
    "or size: one side called the wrong one"
)


def test_a_proven_deadlock_names_the_returned_rank_in_the_words_of_the_proof():
    stuck = [_problem(r, "deadlock", "waits in all_reduce #3 on group 0") for r in range(3)]
    failure = RankFailure("deadlocked", 4, [_problem(3, "returned", SKIPPED), *stuck])
    assert _culprit(failure) == f"rank 3 {SKIPPED}"
    # a rank that entered the collective as another one skipped nothing: the proof says so
    failure = RankFailure("deadlocked", 2, [_problem(1, "returned", MISMATCHED), stuck[0]])
    assert _culprit(failure) == f"rank 1 {MISMATCHED}"
    assert "skip" not in _culprit(failure)


def test_a_failed_runs_rows_take_each_causes_quantity_and_the_hangs_for_a_returned_rank():
    stuck = [_problem(r, "deadlock", "waits in all_reduce #3 on group 0") for r in range(2)]
    stopped = _problem(3, "stopped", "stopped: rank 2 failed")
    failure = RankFailure("deadlocked", 4, [*stuck, _problem(2, "returned", SKIPPED), stopped])
    rows = failure_mismatches(failure, "case")
    assert [(m.quantity, m.rank) for m in rows] == [
        ("deadlock", 0),
        ("deadlock", 1),
        ("deadlock", 2),
    ]
    timed_out = [_problem(0, "timeout", "still running"), _problem(1, "returned", SKIPPED)]
    assert [m.quantity for m in failure_mismatches(RankFailure("t", 2, timed_out), "c")] == [
        "timeout",
        "timeout",
    ]
    # every cause is a report quantity of its own name; context has none
    causes = {k: k.quantity for k in ProblemKind if k.quantity is not None}
    assert set(causes.values()) == set(FAILURES) - {Quantity.VACUOUS}
    assert all(str(k) == str(q) for k, q in causes.items())
    assert {k for k in ProblemKind if k.quantity is None} == {
        ProblemKind.RETURNED,
        ProblemKind.STOPPED,
    }


def test_a_hang_without_a_proof_or_without_a_returned_rank_names_no_culprit():
    waiting = _problem(0, "timeout", "still running after 60.0s (timeout 60s)")
    # a rank that only finished first while another computes past the timeout: no culprit
    timed_out = RankFailure("timed out", 2, [waiting, _problem(1, "returned", SKIPPED)])
    assert _culprit(timed_out) == ""
    # ranks that wait for each other in a cycle: every one is stuck, none returned
    cycle = [_problem(r, "deadlock", "waits in recv from the other") for r in range(2)]
    assert _culprit(RankFailure("deadlocked", 2, cycle)) == ""


def test_a_shard_whose_shape_only_multiplies_out_is_not_called_an_unflattened_block():
    # four samples of a 1 x 3 block: a block (the hint); eight samples: a wrong batch, and
    # a block wider than the field's grid: no block of it
    block = "the values are the rank's (1, 3) block, not flattened"
    assert shard_shape_hint((4, 1, 3), 3, 2, expected=(4, 3), grid=(2, 3)).startswith(block)
    assert shard_shape_hint((8, 1, 3), 3, 2, expected=(4, 3), grid=(2, 3)) == ""
    assert shard_shape_hint((4, 1, 3), 3, 2, expected=(4, 3), grid=(2, 2)) == ""


def test_errors_of_which_only_some_border_another_rank_are_no_halo_even_when_unlikely():
    owners = torch.arange(4).repeat_interleave(16)  # 6 of 64 positions border another rank
    error = torch.zeros(64, dtype=F64)
    error[[15, 16, 31, 32, 47, 48]] = 1.0  # every border position...
    error[[3, 8, 23, 40]] = 1.0  # ...and 4 inside blocks: 6 of 10 border, 60%
    # chance alone would not put 6 of 10 on 6 in 64 (4e-4): only the 90% rule says no
    assert by_chance(6, 10, 6 / 64) < 1e-3
    assert boundary_hint(error, owners, 1e-6, None, "position") == ""
    error[[3, 8, 23, 40]] = 0.0
    assert boundary_hint(error, owners, 1e-6, None, "position") != ""


def test_a_factor_near_the_group_size_beyond_the_tolerance_is_no_exact_factor():
    e = torch.linspace(1, 2, 50, dtype=F64)
    rtol = 1e-10
    assert scale_hint(4 * e, e, 4, rtol) == (
        "exactly 4x the reference: a reduction counted 4 times"
    )
    # 4 (1 + 3 rtol): three times the tolerance off the factor, in an exact multiple of e
    assert scale_hint(4 * (1 + 3 * rtol) * e, e, 4, rtol) == ""
    assert scale_hint(e / 4 * (1 + 3 * rtol), e, 4, rtol) == ""
    assert scale_hint(e / 4, e, 4, rtol).startswith("exactly 1/4 of the reference")
