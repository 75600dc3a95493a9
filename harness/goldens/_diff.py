"""What a golden check finds: every difference between a run's tensors and a golden's
(``diff_tensors``: missing, extra, shape, dtype, values, non-finite values, a rollout's steps
by their own bounds), and the versions and layout a golden was recorded with where they differ
from this run's (``recorded_elsewhere``). The store that reports them is ``harness.goldens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from harness._records.samples import ROLLOUT_PREFIX, in_golden_order, rollout_length
from harness.compare import Bound, compare_tensors, nonfinite_counts, nonfinite_text
from harness.goldens._rollout import StepBound

#: what a golden records of the software it was recorded with, and of the layout
VERSION_KEYS = ("torch", "torch_harmonics")
LAYOUT_KEYS = ("ranks", "spatial_size", "data_size", "partition")
UPDATE_HINT = "run pytest with --update-goldens, review the diff and commit the goldens"


def diff_tensors(
    actual: Mapping[str, torch.Tensor],
    golden: Mapping[str, torch.Tensor],
    bound: Bound,
    *,
    allow_nonfinite: bool = False,
    steps: Mapping[str, StepBound] | None = None,
) -> list[str]:
    """Lines describing every difference between two tensor maps (empty if none).

    Unless ``allow_nonfinite``, a NaN or inf on either side is a difference of its own (a
    golden cannot vouch for it, matching or not). ``steps``: the rollout's tensors, each
    judged by its step's bound (``StepBound``) and named by its step and field. A golden
    without a rollout where this run has one (or the other way round) is one line saying
    so, not a line per tensor.
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
        lines += _nonfinite_lines(actual, "this run produced")
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
