"""What came of golden checks: each one's status (``GoldenStatus``), what rewriting a golden
changed (``GoldenChange``, the review summary of ``--update-goldens``) and how a run's goldens
came out (``GoldenTally``). Plain data that travels to xdist's controller in reports; the
store and the policy that make them are ``harness.goldens``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from harness._records.samples import in_golden_order
from harness.compare import Bound, compare_tensors
from harness.goldens._rollout import StepBound


class GoldenStatus(str, Enum):
    """The outcome of one golden check. A ``str`` enum (``GoldenStatus.PASSED ==
    "passed"``); reports carry its plain text, which travels to xdist's controller.

    ``refused``: non-finite values, not written; ``not updated``: the equivalence check
    behind it failed, so the old golden was kept.
    """

    PASSED = "passed"
    FAILED = "failed"
    MISSING = "missing"
    WRITTEN = "written"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    REFUSED = "refused"
    NOT_UPDATED = "not updated"

    def __str__(self) -> str:
        return self.value


#: Every status's text (the older name of ``GoldenStatus``'s values).
STATUSES = tuple(s.value for s in GoldenStatus)


#: names listed per kind in a change summary before "and N more"
_SHOWN = 8


@dataclass(frozen=True)
class GoldenChange:
    """What rewriting a golden changed, for the reviewer of ``--update-goldens``: the tensors
    changed (over the check's tolerance, or a new dtype or shape), added (produced, not in the
    old golden), removed (in the old golden, not produced), how many stayed within tolerance,
    and the largest change: ``(name, max abs, max rel)`` of the changed tensor with the
    largest relative change (scale-free, so a loss and a gradient compare; then max abs).

    Plain data (``plain``/``from_plain``): it travels to xdist's controller in a report.
    """

    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    unchanged: int = 0
    largest: tuple[str, float, float] | None = None
    #: the old file could not be read (corrupt, foreign): everything is "added"
    unreadable: bool = False
    #: a changed tensor whose dtype or shape changed: name -> what changed
    kinds: tuple[tuple[str, str], ...] = ()

    @classmethod
    def between(
        cls,
        new: Mapping[str, torch.Tensor],
        old: Mapping[str, torch.Tensor] | None,
        bound: Bound,
        *,
        unreadable: bool = False,
        steps: Mapping[str, StepBound] | None = None,
    ) -> GoldenChange:
        """``steps``: the rollout's tensors, changed when over their step's bound (said in
        brackets: how many times the bound)."""
        if old is None:  # a new golden, or one that could not be read
            return cls(added=tuple(in_golden_order(new)), unreadable=unreadable)
        steps = steps or {}
        changed, kinds, unchanged = [], [], 0
        largest: tuple[str, float, float] | None = None
        for name in in_golden_order(new.keys() & old.keys()):
            step = steps.get(name)
            d = compare_tensors(
                new[name], old[name], bound if step is None else step.bound, allow_nonfinite=True
            )
            if d.problem:
                changed.append(name)
                kinds.append((name, d.problem.replace("the reference", "the golden")))
            elif not d.ok:
                changed.append(name)
                if step is not None:
                    kinds.append((name, f"{d.max_abs / step.limit:.3g}x its step's bound"))
                if largest is None or (d.max_rel, d.max_abs) > (largest[2], largest[1]):
                    largest = (name, d.max_abs, d.max_rel)
            else:
                unchanged += 1
        return cls(
            changed=tuple(changed),
            added=tuple(in_golden_order(new.keys() - old.keys())),
            removed=tuple(in_golden_order(old.keys() - new.keys())),
            unchanged=unchanged,
            largest=largest,
            kinds=tuple(kinds),
        )

    def lines(self, path: str, status: GoldenStatus | str) -> list[str]:
        """The review summary of one rewritten golden: a headline, then one line per kind.

        >>> change = GoldenChange(("loss",), ("w",), (), 1, ("loss", 0.5, 0.25))
        >>> for line in change.lines("g.pt", "updated"):
        ...     print(line)
        updated g.pt: 1 changed, 1 added, 0 removed, 1 unchanged; largest change loss: max ...
          changed: loss
          added: w
        """
        if GoldenStatus(status) is GoldenStatus.WRITTEN:
            head = f"written {path}: new golden, {_count(self.added, 'tensor')}"
        elif self.unreadable:
            head = (
                f"updated {path}: the old golden could not be read; rewritten with "
                f"{_count(self.added, 'tensor')}"
            )
        else:
            head = (
                f"updated {path}: {len(self.changed)} changed, {len(self.added)} added, "
                f"{len(self.removed)} removed, {self.unchanged} unchanged"
            )
            if self.largest is not None:
                name, abs_, rel = self.largest
                head += f"; largest change {name}: max abs {abs_:.3g}, max rel {rel:.3g}"
        out = [head]
        kinds = dict(self.kinds)
        changed = [f"{n} ({kinds[n]})" if n in kinds else n for n in self.changed]
        for label, names in (
            ("changed", changed),
            ("added", self.added),
            ("removed", self.removed),
        ):
            if names and not (label == "added" and GoldenStatus(status) is GoldenStatus.WRITTEN):
                out.append(f"  {label}: {_names(names)}")
        return out

    def plain(self) -> dict[str, Any]:
        return {
            "changed": list(self.changed),
            "added": list(self.added),
            "removed": list(self.removed),
            "unchanged": self.unchanged,
            "largest": None if self.largest is None else list(self.largest),
            "unreadable": self.unreadable,
            "kinds": [list(k) for k in self.kinds],
        }

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> GoldenChange:
        largest = data.get("largest")
        return cls(
            changed=tuple(data.get("changed", ())),
            added=tuple(data.get("added", ())),
            removed=tuple(data.get("removed", ())),
            unchanged=int(data.get("unchanged", 0)),
            largest=None
            if largest is None
            else (str(largest[0]), float(largest[1]), float(largest[2])),
            unreadable=bool(data.get("unreadable", False)),
            kinds=tuple((str(a), str(b)) for a, b in data.get("kinds", ())),
        )


def _count(items: tuple[str, ...], noun: str) -> str:
    return f"{len(items)} {noun}{'s' if len(items) != 1 else ''}"


def _names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


#: The tally's words for a status, where the bare status would not say enough.
_LABELS = {
    GoldenStatus.NOT_UPDATED: "not updated (check failed)",
    GoldenStatus.REFUSED: "refused (not finite)",
}
_ORDER = (
    GoldenStatus.WRITTEN,
    GoldenStatus.UPDATED,
    GoldenStatus.UNCHANGED,
    GoldenStatus.PASSED,
    GoldenStatus.FAILED,
    GoldenStatus.MISSING,
    GoldenStatus.NOT_UPDATED,
    GoldenStatus.REFUSED,
)


@dataclass
class GoldenTally:
    """How a run's goldens came out, counted per status, and the files no check used (as
    syrupy counts snapshots created, updated and unused)."""

    counts: Counter[GoldenStatus] = field(default_factory=Counter)
    unused: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, statuses: Iterable[GoldenStatus | str]) -> GoldenTally:
        return cls(Counter(GoldenStatus(s) for s in statuses))

    @property
    def written(self) -> int:
        return self.counts[GoldenStatus.WRITTEN]

    @property
    def updated(self) -> int:
        return self.counts[GoldenStatus.UPDATED]

    @property
    def unchanged(self) -> int:
        return self.counts[GoldenStatus.UNCHANGED]

    def lines(self, root: Path) -> list[str]:
        """The summary: one line of counts, then what to do about them.

        >>> GoldenTally.of(["written", "passed", "written"]).lines(Path("g"))
        ['3 goldens: 2 written, 1 passed.', 'Review and commit the changes under g.']
        """
        if not self.counts:
            return []
        text = ", ".join(
            f"{self.counts[k]} {_LABELS.get(k, k.value)}" for k in _ORDER if self.counts[k]
        )
        n = sum(self.counts.values())
        out = [f"{n} golden{'s' if n != 1 else ''}: {text}."]
        if self.counts[GoldenStatus.NOT_UPDATED] or self.counts[GoldenStatus.REFUSED]:
            out.append(
                "Goldens are only written from passing, finite checks: fix "
                "the failing tests, then run --update-goldens again."
            )
        if self.written or self.updated:
            out.append(f"Review and commit the changes under {root}.")
        elif self.counts[GoldenStatus.MISSING] or self.counts[GoldenStatus.FAILED]:
            out.append("Run with --update-goldens if the change is intended.")
        return out
