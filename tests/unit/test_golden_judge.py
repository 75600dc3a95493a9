"""The golden judge: each row of its outcome table, from what the store found to the verdict.

``judge_golden`` is pure, so every outcome is reached here without a file: a golden is the
dict ``GoldenStore.load`` returns, an unreadable file the ``GoldenError`` its load raised.
Values are float64 and the bound exact: the judge's logic, not rounding, is under test.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import harness.goldens._diff as golden_diff
from harness import GoldenError, GoldenStore
from harness.compare import Bound
from harness.goldens._diff import (
    OUTCOMES,
    Facts,
    Found,
    GoldenFile,
    GoldenVerdict,
    Outcome,
    judge_golden,
)

EXACT = Bound(0.0, 0.0)  # float64 values copied or changed by a whole 1.0: no rounding to allow
PATH = Path("goldens/t/test_a.pt")
UNREADABLE = GoldenError("golden goldens/t/test_a.pt cannot be read (not a zip file)")


def run(*, nan: bool = False, moved: bool = False) -> dict[str, torch.Tensor]:
    w = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    if moved:
        w[1, 2] += 1.0
    if nan:
        w[0, 1] = float("nan")
    return {"loss": torch.tensor(0.5, dtype=torch.float64), "grad/w": w}


def golden() -> GoldenFile:
    provenance = {"torch": "0.0"}  # said against this run's torch 1.0 where a check fails
    return {"format": "harness-golden", "version": 2, "provenance": provenance, "tensors": run()}


@dataclass(frozen=True)
class Case:
    """One row of ``OUTCOMES`` reached from real inputs, and what its verdict must say."""

    updating: bool
    found: GoldenFile | GoldenError | None
    tensors: dict[str, torch.Tensor]
    outcome: Outcome
    says: tuple[str, ...] = ()  # text the verdict's lines hold


# One case per row of OUTCOMES, in its order (the outcomes written out: the table's spec).
CASES = {
    "checking, an unreadable file: its load error, to be raised": Case(
        False, UNREADABLE, run(), Outcome.UNREADABLE
    ),
    "checking, no file: missing, and how to record one": Case(
        False,
        None,
        run(),
        Outcome.MISSING,
        ("no golden at goldens/t/test_a.pt", "--update-goldens"),
    ),
    "checking, a golden as this run has it: passed": Case(False, golden(), run(), Outcome.PASSED),
    "checking, a golden that differs: failed, with the difference and the versions": Case(
        False,
        golden(),
        run(moved=True),
        Outcome.FAILED,
        ("grad/w: 1/6 over tolerance", "Recorded with torch 0.0, this run has torch 1.0"),
    ),
    "updating, a golden as this run has it: unchanged, nothing written": Case(
        True, golden(), run(), Outcome.UNCHANGED
    ),
    "updating, a run with NaN: refused, naming where": Case(
        True,
        golden(),
        run(nan=True),
        Outcome.REFUSED,
        (
            "not writing goldens/t/test_a.pt",
            "grad/w: this run produced 1 NaN of 6 (first at (0, 1))",
        ),
    ),
    "updating, no file: written": Case(True, None, run(), Outcome.WRITTEN),
    "updating, an unreadable file: rewritten, not raised": Case(
        True, UNREADABLE, run(), Outcome.UPDATED
    ),
    "updating, a golden that differs: updated, with the difference": Case(
        True, golden(), run(moved=True), Outcome.UPDATED, ("grad/w: 1/6 over tolerance",)
    ),
}


def judge(case: Case) -> GoldenVerdict:
    return judge_golden(
        PATH,
        case.tensors,
        case.found,
        updating=case.updating,
        bound=EXACT,
        running={"torch": "1.0"},
    )


def test_there_is_one_case_per_row_of_the_table():
    assert len(CASES) == len(OUTCOMES)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_row_of_the_table_gives_its_outcome(case):
    verdict = judge(case)
    assert verdict.outcome is case.outcome
    text = "\n".join(verdict.lines)
    assert all(s in text for s in case.says), text
    # the load's error travels only where it is to be raised
    assert verdict.error is (UNREADABLE if case.outcome is Outcome.UNREADABLE else None)
    # what a write changes, exactly where the store writes
    assert (verdict.change is not None) is case.outcome.writes


def test_a_write_says_what_it_changed():
    written = judge(CASES["updating, no file: written"]).change
    assert written is not None and written.added == ("grad/w", "loss")
    unreadable = judge(CASES["updating, an unreadable file: rewritten, not raised"]).change
    assert unreadable is not None and unreadable.unreadable
    updated = judge(CASES["updating, a golden that differs: updated, with the difference"]).change
    assert updated is not None and updated.changed == ("grad/w",) and not updated.unreadable


def test_exactly_one_row_holds_for_any_facts():
    """The table is complete (no facts without an outcome) and needs no order to read (no
    facts two rows claim), and every row is reached by some facts."""
    every = [
        Facts(*f) for f in itertools.product((False, True), Found, (False, True), (False, True))
    ]
    for facts in every:
        holding = [row for row in OUTCOMES if row.holds(facts)]
        assert len(holding) == 1, (facts, holding)
    assert all(any(row.holds(f) for f in every) for row in OUTCOMES)


def test_a_check_scans_the_run_for_nan_once(tmp_path, monkeypatch):
    """Updating over a differing golden with a NaN: the diff and the refusal share one scan
    (each of the run's tensors is counted once, wherever the scan is called from)."""
    counts = golden_diff.nonfinite_counts
    scanned: list[torch.Tensor] = []

    def counting(t: torch.Tensor) -> tuple[int, int, int | None]:
        scanned.append(t)
        return counts(t)

    path = tmp_path / "a.pt"
    store = GoldenStore(tmp_path, update=True)
    store.check(path, run(), bound=EXACT)
    monkeypatch.setattr(golden_diff, "nonfinite_counts", counting)
    tensors = run(nan=True, moved=True)
    result = store.check(path, tensors, bound=EXACT)
    assert result.status == "refused"
    assert [sum(s is t for s in scanned) for t in tensors.values()] == [1, 1]
    assert len(scanned) == 2 * len(tensors)  # and the golden's, once each
