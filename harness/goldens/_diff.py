"""What a golden check finds and what comes of it: every difference between a run's tensors
and a golden's (``diff_tensors``: missing, extra, shape, dtype, values, non-finite values, a
rollout's steps by their own bounds), the versions and layout a golden was recorded with where
they differ from this run's (``recorded_elsewhere``), and the judge (``judge_golden``) that
turns what the store found into one outcome of the table ``OUTCOMES``. Pure: the store that
loads, writes and reports is ``harness.goldens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

import numpy as np
import torch

from harness._records.samples import ROLLOUT_PREFIX, in_golden_order, rollout_length
from harness.compare import Bound, compare_tensors, nonfinite_counts, nonfinite_text
from harness.errors import GoldenError
from harness.goldens._changes import GoldenChange, GoldenStatus
from harness.goldens._rollout import StepBound

#: what a golden records of the software it was recorded with, and of the layout
VERSION_KEYS = ("torch", "torch_harmonics")
LAYOUT_KEYS = ("ranks", "spatial_size", "data_size", "partition")
UPDATE_HINT = "run pytest with --update-goldens, review the diff and commit the goldens"


class GoldenFile(TypedDict):
    """What a golden file holds (``GoldenStore.load``)."""

    format: str  # FORMAT
    version: int  # VERSION
    provenance: dict[str, Any]  # plain scalars and text: weights_only loading accepts no other
    tensors: dict[str, torch.Tensor]


def diff_tensors(
    actual: Mapping[str, torch.Tensor],
    golden: Mapping[str, torch.Tensor],
    bound: Bound,
    *,
    allow_nonfinite: bool = False,
    steps: Mapping[str, StepBound] | None = None,
    run_nonfinite: Sequence[str] | None = None,
) -> list[str]:
    """Lines describing every difference between two tensor maps (empty if none).

    Unless ``allow_nonfinite``, a NaN or inf on either side is a difference of its own (a
    golden cannot vouch for it, matching or not). ``steps``: the rollout's tensors, each
    judged by its step's bound (``StepBound``) and named by its step and field. A golden
    without a rollout where this run has one (or the other way round) is one line saying
    so, not a line per tensor. ``run_nonfinite``: the lines of ``actual``'s NaN and inf when
    the caller has already scanned it (``judge_golden``: one scan serves the diff and the
    refusal to write); ``None`` scans here.
    """
    # long: one pass over the names: missing, extra, shape, dtype, values, a row each
    steps = steps or {}
    lines = []
    missing = in_golden_order(golden.keys() - actual.keys())
    extra = in_golden_order(actual.keys() - golden.keys())
    ran, recorded = rollout_length(actual), rollout_length(golden)
    if ran and not recorded:
        extra = [n for n in extra if not n.startswith(ROLLOUT_PREFIX)]
        lines.append(
            f"  the golden has no rollout part, and this check rolls out {ran} steps (the "
            f"golden was recorded without rollout=, or before rollout goldens): {UPDATE_HINT} "
            "to record the rollout's per-step fields."
        )
    elif recorded and not ran:
        missing = [n for n in missing if not n.startswith(ROLLOUT_PREFIX)]
        lines.append(
            f"  the golden holds a rollout of {recorded} steps, and this check rolled out "
            "none (rollout= dropped, or the rollout did not run)"
        )
    elif ran != recorded:
        lines.append(f"  the golden holds a rollout of {recorded} steps, this check ran {ran}")
    for name in missing:
        lines.append(f"  {name}: in the golden but not produced any more")
    for name in extra:
        lines.append(f"  {name}: produced but not in the golden")
    if not allow_nonfinite:
        lines += _nonfinite_lines(golden, "the golden holds")
        if run_nonfinite is None:
            run_nonfinite = _nonfinite_lines(actual, "this run produced")
        lines += run_nonfinite
    for name in in_golden_order(actual.keys() & golden.keys()):
        step = steps.get(name)
        d = compare_tensors(
            actual[name], golden[name], bound if step is None else step.bound, allow_nonfinite=True
        )
        if d.problem:
            lines.append(f"  {name}: {d.problem} (golden)")
        elif not d.ok and step is not None:
            lines.append(
                f"  {name}: {step.where()}: max abs {d.max_abs:.3g} over the bound "
                f"{step.limit:.3g} ({step.text()}; {d.count}/{d.total} values over)"
            )
        elif not d.ok:
            lines.append(
                f"  {name}: {d.count}/{d.total} over tolerance (rtol {bound.rtol:g}, atol "
                f"{bound.atol:g}); max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}"
            )
    return lines


def _nonfinite_lines(tensors: Mapping[str, torch.Tensor], who: str) -> list[str]:
    lines = []
    for name in sorted(tensors):
        t = tensors[name]
        nan, inf, first = nonfinite_counts(t)
        if first is not None:
            at = str(tuple(int(i) for i in np.unravel_index(first, tuple(t.shape))))  # () if 0-d
            lines.append(
                f"  {name}: {who} {nonfinite_text(nan, inf)} of {t.numel()} (first at {at})"
            )
    return lines


def recorded_elsewhere(recorded: Mapping[str, Any], running: Mapping[str, Any]) -> list[str]:
    """Lines for a failing golden check: the versions (and layout) the golden was recorded
    with, where they differ from this run's. A likely cause of the difference, said as such:
    the tensors' differences stand above it.

    >>> for line in recorded_elsewhere({"torch": "2.12.0"}, {"torch": "2.13.0"}):
    ...     print(line)
    Recorded with torch 2.12.0, this run has torch 2.13.0: a likely cause of the difference ...
    """
    out = []
    changed = [
        f"{_NAMES[k]} {recorded[k]}"
        for k in VERSION_KEYS
        if k in recorded and k in running and str(recorded[k]) != str(running[k])
    ]
    if changed:
        now = ", ".join(
            f"{_NAMES[k]} {running[k]}"
            for k in VERSION_KEYS
            if k in recorded and k in running and str(recorded[k]) != str(running[k])
        )
        out.append(
            f"Recorded with {', '.join(changed)}, this run has {now}: a likely cause of the "
            "difference (kernels round differently across versions); if only rounding "
            "moved, review and update."
        )
    unknown = [_NAMES[k] for k in VERSION_KEYS if k not in recorded and k in running]
    if unknown:
        out.append(
            f"The golden does not record its {' or '.join(unknown)} version (format 1, "
            "written before versions were stored): a version change cannot be ruled out."
        )
    layout = [
        k
        for k in LAYOUT_KEYS
        if k in recorded and k in running and str(recorded[k]) != str(running[k])
    ]
    if layout:
        was = ", ".join(f"{k} {recorded[k]}" for k in layout)
        now = ", ".join(f"{k} {running[k]}" for k in layout)
        out.append(f"Recorded on a different layout ({was}); this run: {now}.")
    return out


_NAMES = {"torch": "torch", "torch_harmonics": "torch-harmonics"}


# ---------------------------------------------------------------------- the judge


class Found(Enum):
    """What the store found at a golden's path."""

    NOTHING = "no file"
    UNREADABLE = "a file that is not a golden this harness reads"
    GOLDEN = "a golden"


class Outcome(Enum):
    """Which of a golden check's outcomes ``OUTCOMES`` gives: the status of its result (the
    text of a ``GoldenStatus``), and whether the store writes the golden first (``writes``).
    ``UNREADABLE`` has no result: the store raises the load's ``GoldenError`` instead."""

    PASSED = "passed"
    FAILED = "failed"
    MISSING = "missing"
    UNCHANGED = "unchanged"
    REFUSED = "refused"
    WRITTEN = "written"
    UPDATED = "updated"
    UNREADABLE = "unreadable"

    @property
    def writes(self) -> bool:
        return self in (Outcome.WRITTEN, Outcome.UPDATED)

    @property
    def status(self) -> GoldenStatus:
        return GoldenStatus(self.value)  # a ValueError for UNREADABLE, which has none


class Facts(NamedTuple):
    """What the judge knows of one golden check before it decides."""

    updating: bool  # --update-goldens
    found: Found
    differs: bool  # the golden found differs from this run (False where none was found)
    nonfinite: bool  # this run produced NaN or inf, and the check does not declare them


class Row(NamedTuple):
    """One row of ``OUTCOMES``: the facts it asks for (``None``: either) and its outcome."""

    updating: bool | None
    found: Found | None
    differs: bool | None
    nonfinite: bool | None
    outcome: Outcome

    def holds(self, facts: Facts) -> bool:
        return all(want is None or want == fact for want, fact in zip(self[:4], facts))


# The golden check's outcome table (judge_golden's docstring says it in words). Exactly one
# row holds for any facts, so no order is to be read. Updating, a golden that does not differ
# and a run with NaN cannot meet (the diff lists the NaN): REFUSED's row takes it all the same.
# fmt: off
OUTCOMES: tuple[Row, ...] = (
    #   updating  found             differs  nonfinite  outcome
    Row(False,    Found.UNREADABLE, None,    None,      Outcome.UNREADABLE),
    Row(False,    Found.NOTHING,    None,    None,      Outcome.MISSING),
    Row(False,    Found.GOLDEN,     False,   None,      Outcome.PASSED),
    Row(False,    Found.GOLDEN,     True,    None,      Outcome.FAILED),
    Row(True,     Found.GOLDEN,     False,   False,     Outcome.UNCHANGED),
    Row(True,     None,             None,    True,      Outcome.REFUSED),
    Row(True,     Found.NOTHING,    None,    False,     Outcome.WRITTEN),
    Row(True,     Found.UNREADABLE, None,    False,     Outcome.UPDATED),
    Row(True,     Found.GOLDEN,     True,    False,     Outcome.UPDATED),
)
# fmt: on


def decide(facts: Facts) -> Outcome:
    """The outcome of the one row of ``OUTCOMES`` that holds for ``facts``."""
    [outcome] = [row.outcome for row in OUTCOMES if row.holds(facts)]
    return outcome


@dataclass(frozen=True)
class GoldenVerdict:
    """What ``judge_golden`` decided: the outcome and its result's lines; for ``WRITTEN`` and
    ``UPDATED`` what the write changes, for ``UNREADABLE`` the load's error to raise."""

    outcome: Outcome
    lines: tuple[str, ...] = ()
    change: GoldenChange | None = None
    error: GoldenError | None = None


def judge_golden(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    golden: GoldenFile | GoldenError | None,
    *,
    updating: bool,
    bound: Bound,
    running: Mapping[str, object],
    allow_nonfinite: bool = False,
    steps: Mapping[str, StepBound] | None = None,
) -> GoldenVerdict:
    """Judge this run's ``tensors`` against what the store found at ``path``: ``None`` (no
    file), the golden it loaded, or the ``GoldenError`` of a file it could not read. Pure: no
    file is read or written here; the store acts on the verdict. The outcome is the one row of
    ``OUTCOMES`` that holds:

    - checking: an unreadable file is ``UNREADABLE`` (its error to raise), no file
      ``MISSING``, a golden ``PASSED`` or, where it differs, ``FAILED`` (the differences,
      then the versions and layout it was recorded with where they differ from ``running``,
      this run's provenance);
    - updating: a run with NaN or inf is ``REFUSED`` whatever was found; else no file is
      ``WRITTEN``, a golden that does not differ ``UNCHANGED``, and an unreadable file or a
      differing golden ``UPDATED``.

    A NaN or inf on either side is a difference unless ``allow_nonfinite``; this run's are
    scanned once, for the diff and for the refusal to write. ``steps``: the tensors of a
    rollout, judged by their step's bound instead of ``bound`` (``StepBound``).
    """
    bad = [] if allow_nonfinite else _nonfinite_lines(tensors, "this run produced")
    if isinstance(golden, GoldenError):
        found, error, loaded = Found.UNREADABLE, golden, None
    else:
        found = Found.NOTHING if golden is None else Found.GOLDEN
        error, loaded = None, golden
    old = None if loaded is None else loaded["tensors"]
    diff = []
    if old is not None:
        diff = diff_tensors(
            tensors, old, bound, allow_nonfinite=allow_nonfinite, steps=steps, run_nonfinite=bad
        )
    outcome = decide(Facts(updating, found, bool(diff), bool(bad)))
    change = None
    if outcome.writes:
        change = GoldenChange.between(
            tensors, old, bound, unreadable=found is Found.UNREADABLE, steps=steps
        )
    recorded = {} if loaded is None else loaded["provenance"]
    return GoldenVerdict(
        outcome,
        _said(outcome, path, diff, bad, recorded, running),
        change,
        error if outcome is Outcome.UNREADABLE else None,
    )


def _said(
    outcome: Outcome,
    path: Path,
    diff: list[str],
    bad: list[str],
    recorded: Mapping[str, object],
    running: Mapping[str, object],
) -> tuple[str, ...]:
    """The lines of an outcome's result, below its ``golden <path>: <status>`` headline."""
    if outcome is Outcome.MISSING:
        return (f"no golden at {path}: {UPDATE_HINT} (then commit the new file).",)
    if outcome is Outcome.FAILED:
        return (
            *diff,
            *recorded_elsewhere(recorded, running),
            f"If the change is intended, {UPDATE_HINT}.",
        )
    if outcome is Outcome.REFUSED:
        return (
            f"not writing {path}: a golden vouches only for finite values, and this run "
            "produced NaN or inf:",
            *bad,
            "Make the run finite (or declare non-finite values expected), then update.",
        )
    if outcome is Outcome.UPDATED:
        return tuple(diff)  # what the update changed (nothing said of an unreadable file)
    return ()  # passed, unchanged, written, unreadable (raised): nothing to add
