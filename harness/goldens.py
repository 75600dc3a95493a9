"""``.pt`` golden files: the reference run's tensors, stored with provenance.

A golden is a dict saved by ``torch.save``::

    {"format": "harness-golden", "version": 2,
     "provenance": {...strings and numbers...},
     "tensors": {"step0/loss": tensor, ...}}

Format 2 adds nothing to the structure; it promises that the provenance holds the versions
the golden was recorded with (``torch``, ``torch_harmonics``) and, for a golden of an
equivalence check, its layout (``ranks``, ``spatial_size``, ``data_size``, ``partition``).
Format 1 goldens (written before) are still read: what they do not record is said as "not
recorded" where it matters, when a check against them fails.

A golden holds any named tensors. The rollout of a check (``check_equivalence(...,
rollout=N)``) adds the reference's per-step fields under ``rollout/step<k>/<field>``, at the
steps ``rollout_golden_steps`` picks and strided to at most ``ROLLOUT_ELEMENTS`` values per
field (``RolloutSamples``); each is judged against today's reference with that step's
rounding spread (``StepBound``), not the fixed tolerance: see docs/goldens.md.

It is loaded with ``torch.load(weights_only=True)``: nothing in a golden is ever executed.
Writes go to a temporary file in the same directory, then ``os.replace``: a golden is either
the old file or the new one, never a truncated one, even if the writer is killed. A writer
killed mid-write leaves its temporary file (``.<name>.<pid>.<random>.tmp``); ``sweep`` removes
those of writers that are gone, and the plugin does so at the start of every session.

A golden vouches only for finite values: a NaN or inf in a golden, or in what is checked
against it, is a difference, and ``--update-goldens`` refuses to write one (unless the
check declares non-finite values expected).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from harness._pids import pid_alive as _pid_alive
from harness._samples import (  # the rollout's samples: their home is beside the rollout record
    ROLLOUT_PREFIX,
    parse_rollout_name,
    rollout_name,
)
from harness.compare import (
    Bound,
    Tolerance,
    compare_tensors,
    nonfinite_counts,
    nonfinite_text,
)
from harness.errors import GoldenError, exception_summary
from harness.report import EquivalenceReport

if TYPE_CHECKING:
    from harness.rollout import RolloutRecord

FORMAT = "harness-golden"
VERSION = 2
#: the format versions this harness reads (1: before versions and layout were recorded)
READABLE = (1, 2)
#: what a golden records of the software it was recorded with, and of the layout
VERSION_KEYS = ("torch", "torch_harmonics")
LAYOUT_KEYS = ("ranks", "spatial_size", "data_size", "partition")
UPDATE_HINT = "run pytest with --update-goldens, review the diff and commit the goldens"


def golden_stem(nodeid: str) -> str:
    """The file stem for a test node id: its path without ``.py``, then the test name.

    >>> golden_stem("tests/distributed/test_sfno.py::test_grid[h2w1-float64]")
    'tests/distributed/test_sfno/test_grid[h2w1-float64]'
    """
    path, _, name = nodeid.partition("::")
    path = path[:-3] if path.endswith(".py") else path
    name = re.sub(r"[^A-Za-z0-9_.\-\[\]]", "_", name.replace("::", "."))
    return f"{path}/{name}" if name else path


class GoldenFile(TypedDict):
    """What a golden file holds (``GoldenStore.load``)."""

    format: str  # FORMAT
    version: int  # VERSION
    provenance: dict[str, Any]  # plain scalars and text: weights_only loading accepts no other
    tensors: dict[str, torch.Tensor]


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
_OK = (GoldenStatus.PASSED, GoldenStatus.WRITTEN, GoldenStatus.UPDATED, GoldenStatus.UNCHANGED)
_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")


@dataclass
class GoldenResult:
    """The outcome of one golden check (``status`` given as text is made a ``GoldenStatus``)."""

    path: Path
    status: GoldenStatus
    lines: list[str] = field(default_factory=list)
    #: what a write changed (``written`` and ``updated`` only): the review summary's material
    change: GoldenChange | None = None

    def __post_init__(self) -> None:
        self.status = GoldenStatus(self.status)

    @property
    def ok(self) -> bool:
        return self.status in _OK

    def __str__(self) -> str:
        return "\n".join([f"golden {self.path}: {self.status}", *self.lines])


class GoldenStore:
    """Golden files under ``root``; ``update=True`` (re)writes instead of failing."""

    def __init__(self, root: str | os.PathLike[str], *, update: bool = False) -> None:
        self.root = Path(root)
        self.update = update

    def path_for(self, nodeid: str, name: str | None = None) -> Path:
        stem = golden_stem(nodeid)
        if name:
            stem += "." + re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
        return self.root / f"{stem}.pt"

    # ------------------------------------------------------------------ io

    def load(self, path: Path) -> GoldenFile:
        """Load and validate a golden; a clear ``GoldenError`` if it is not one of ours."""
        _not_a_directory(path)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise GoldenError(
                f"golden {path} cannot be read ({exception_summary(exc)[:200]}); "
                f"it is corrupt or not a harness golden. Delete it and {UPDATE_HINT}."
            ) from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise GoldenError(
                f"golden {path} is not a harness golden (no format marker '{FORMAT}'); "
                f"delete it and {UPDATE_HINT}."
            )
        version = data.get("version")
        if type(version) is not int or version not in READABLE:
            newer = isinstance(version, int) and version > VERSION
            remedy = (
                "it was written by a newer harness: upgrade this one (pip install -U "
                "pytest-spatial-harness), or"
                if newer
                else "delete it and"
            )
            raise GoldenError(
                f"golden {path} has format version {version!r}, this harness reads versions "
                f"{', '.join(map(str, READABLE))}; {remedy} {UPDATE_HINT}."
            )
        if not isinstance(data.get("provenance", {}), dict):
            raise GoldenError(f"golden {path} has no valid provenance; {UPDATE_HINT}.")
        data.setdefault("provenance", {})
        tensors = data.get("tensors")
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            raise GoldenError(f"golden {path} has no valid tensor map; {UPDATE_HINT}.")
        return cast(GoldenFile, data)

    def write(
        self, path: Path, tensors: Mapping[str, torch.Tensor], provenance: Mapping[str, Any]
    ) -> None:
        """Write atomically: temporary file in the same directory, fsync, rename. A write that
        fails (a full disk, no permission) leaves the old golden as it was and raises one
        ``GoldenError`` naming the path."""
        _not_a_directory(path)
        try:
            self._write(path, tensors, provenance)
        except OSError as exc:
            raise GoldenError(
                f"golden {path} could not be written ({exception_summary(exc)}); the old one, "
                "if any, is unchanged. Free space or fix the permissions of "
                f"{path.parent}, then {UPDATE_HINT}."
            ) from exc
        except RuntimeError as exc:  # torch.save's own writer: "unexpected pos ..." on ENOSPC
            raise GoldenError(
                f"golden {path} could not be written: torch.save failed "
                f"({exception_summary(exc)[:160]}), most likely a full disk; the old one, if "
                f"any, is unchanged. Free space on {path.parent}, then {UPDATE_HINT}."
            ) from exc

    def _write(
        self, path: Path, tensors: Mapping[str, torch.Tensor], provenance: Mapping[str, Any]
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": FORMAT,
            "version": VERSION,
            "provenance": {str(k): _plain(v) for k, v in provenance.items()},
            "tensors": {k: v.detach().to("cpu").clone() for k, v in tensors.items()},
        }
        # The writer's pid in the name: ``sweep`` can tell a dead writer's leftover from a
        # write in progress (another xdist worker's).
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent
        )
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(data, f)
                f.flush()
                os.fsync(f.fileno())
            # mkstemp makes the file private (0600); a golden is a normal project file
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def sweep(self) -> list[Path]:
        """Remove the temporary files of golden writes whose writer is gone (killed mid-write);
        returns what was removed. A write in progress (its writer alive) is left alone."""
        if not self.root.is_dir():
            return []
        removed = []
        for tmp in sorted(self.root.rglob(".*.tmp")):
            m = _TMP.match(tmp.name)
            if m is None or _pid_alive(int(m["pid"])):
                continue
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
        return removed

    # ------------------------------------------------------------------ check

    def check(
        self,
        path: Path,
        tensors: Mapping[str, torch.Tensor],
        *,
        bound: Bound,
        provenance: Mapping[str, Any] | None = None,
        allow_nonfinite: bool = False,
        steps: Mapping[str, StepBound] | None = None,
    ) -> GoldenResult:
        """Compare ``tensors`` with the golden at ``path`` (or write it, when updating).

        A NaN or inf on either side is a difference unless ``allow_nonfinite``; updating
        refuses to write non-finite tensors (status ``refused``). ``steps``: the tensors of a
        rollout, judged by their step's bound instead of ``bound`` (``StepBound``).
        """
        # long: load, refuse, compare, update atomically: each branch one outcome
        provenance = {**default_provenance(), **(provenance or {})}
        exists = path.exists()
        lines: list[str] = []
        golden: GoldenFile | None = None
        if exists:
            try:
                golden = self.load(path)
            except GoldenError:
                if not self.update:
                    raise
            if golden is not None:
                lines = diff_tensors(
                    tensors, golden["tensors"], bound, allow_nonfinite=allow_nonfinite, steps=steps
                )
                if not lines:
                    return GoldenResult(
                        path, GoldenStatus.UNCHANGED if self.update else GoldenStatus.PASSED
                    )
        if not self.update:
            if golden is None:
                return GoldenResult(
                    path,
                    GoldenStatus.MISSING,
                    [f"no golden at {path}: {UPDATE_HINT} (then commit the new file)."],
                )
            return GoldenResult(
                path,
                GoldenStatus.FAILED,
                [
                    *lines,
                    *recorded_elsewhere(golden["provenance"], provenance),
                    f"If the change is intended, {UPDATE_HINT}.",
                ],
            )
        bad = [] if allow_nonfinite else _nonfinite_lines(tensors, "this run produced")
        if bad:
            return GoldenResult(
                path,
                GoldenStatus.REFUSED,
                [
                    f"not writing {path}: a golden vouches only for finite values, and this run "
                    "produced NaN or inf:",
                    *bad,
                    "Make the run finite (or declare non-finite values expected), then update.",
                ],
            )
        self.write(path, tensors, provenance)
        old = None if golden is None else golden["tensors"]
        return GoldenResult(
            path,
            GoldenStatus.UPDATED if exists else GoldenStatus.WRITTEN,
            lines,
            GoldenChange.between(
                tensors, old, bound, unreadable=exists and golden is None, steps=steps
            ),
        )

    def not_updated(self, path: Path, reason: str) -> GoldenResult:
        """The result for a golden left as it was because the check behind it failed."""
        return GoldenResult(
            path,
            GoldenStatus.NOT_UPDATED,
            [
                f"not updated: {reason}; a golden is only written from a passing check. Fix the "
                "check, then run --update-goldens again."
            ],
        )


# ---------------------------------------------------------------------- the policy


def check_report(
    store: GoldenStore,
    path: Path,
    report: EquivalenceReport,
    *,
    provenance: Mapping[str, Any] | None = None,
    allow_nonfinite: bool = False,
) -> GoldenResult:
    """The golden policy for an equivalence check's reference run, one for the plugin's
    ``spatial.check(golden=True)`` and for ``harness-check``:

    - a golden is only written from a check that passed (``not updated`` otherwise, the old
      file kept), and only from finite values (``refused``);
    - the reference is compared with the field tolerance of its dtype
      (``Tolerance.for_dtype(dtype).field``): a golden pins the same run, so what may differ
      is the rounding of a reordered sum, as between reference and ranks;
    - what is written says where it came from: the case, ranks, partition, dtype and steps
      of the report, the versions (``default_provenance``), and ``provenance``'s entries;
    - a check that rolled out (``report.rollout``) adds the reference's rollout, sampled
      (``RolloutSamples``), each step judged by its rounding spread (``rollout_bounds``).
    """
    if store.update and not report.ok:
        return store.not_updated(path, "the equivalence check failed")
    dtype = next(iter(report.reference.values())).dtype
    field_bound = Tolerance.for_dtype(dtype).field
    tensors = dict(report.reference)
    extra: dict[str, Any] = {}
    steps: dict[str, StepBound] = {}
    rollout = getattr(report, "rollout", None)  # a report-like object may have none
    if rollout is not None and rollout.samples is not None:
        tensors.update(rollout.samples.tensors)
        extra = rollout.samples.provenance()
        steps = rollout_bounds(rollout, field_bound)
    return store.check(
        path,
        tensors,
        bound=field_bound,
        provenance={**report_provenance(report), **extra, **(provenance or {})},
        allow_nonfinite=allow_nonfinite,
        steps=steps,
    )


def report_provenance(report: EquivalenceReport) -> dict[str, Any]:
    """What a golden of ``report``'s reference records of the check behind it."""
    return {
        "case": report.case,
        "ranks": report.ranks,
        "spatial_size": report.spatial_size,
        # the data-parallel groups the ranks form (ranks = spatial_size x data_size)
        "data_size": report.ranks // report.spatial_size if report.spatial_size else 1,
        "partition": report.partition,
        "dtype": report.dtype,
        "steps": report.steps,
    }


# ---------------------------------------------------------------------- rollout goldens


@dataclass(frozen=True)
class StepBound:
    """How far a rollout golden's field at one step may be from today's reference: max abs
    at most ``limit = max(factor x spread, floor)``, the envelope the rollout check itself
    uses (``harness.rollout``). ``spread`` is what rounding alone reached there today (the
    furthest of ``members`` nudged reruns), ``floor`` the golden's fixed field tolerance at
    the field's scale (``atol + rtol x max |reference|``), which holds where rounding moves
    nothing. A golden recorded on another machine or torch build differs from today's
    reference by rounding that the rollout then grows, as a nudged rerun does: a fixed
    tolerance would fail a correct chaotic rollout after a few dozen steps."""

    step: int
    field: str
    steps: int
    spread: float
    factor: float
    members: int
    floor: float

    @property
    def limit(self) -> float:
        return max(self.factor * self.spread, self.floor)

    @property
    def bound(self) -> Bound:
        """As an elementwise bound: every value within ``limit`` (max abs <= limit)."""
        return Bound(0.0, self.limit)

    def where(self) -> str:
        return f"rollout step {self.step} of {self.steps}, field '{self.field}'"

    def text(self) -> str:
        return (
            f"{self.factor:g}x the rounding spread {self.spread:.3g} of {self.members} nudged "
            f"reruns at this step, at least the field tolerance {self.floor:.3g}"
        )


def rollout_bounds(record: RolloutRecord, field_bound: Bound) -> dict[str, StepBound]:
    """The bound of each stored tensor of ``record``'s rollout golden, from today's rollout:
    its step's measured spread (``record.curve``). A stored step and field the rollout did
    not judge (its spread unknown: a nudged rerun went non-finite) has no entry and is
    held to ``field_bound`` elementwise, as the training golden is."""
    out = {}
    for p in record.curve:
        name = rollout_name(p.step, p.name)
        if record.samples is not None and name in record.samples.tensors:
            out[name] = StepBound(
                p.step,
                p.name,
                record.steps,
                p.spread,
                record.factor,
                record.members,
                field_bound.atol + field_bound.rtol * p.scale,
            )
    return out


def _rollout_length(names: Iterable[str]) -> int:
    """The rollout steps a set of golden names holds (its last stored step is the last)."""
    steps = [s for s, _ in filter(None, map(parse_rollout_name, names))]
    return max(steps) + 1 if steps else 0


def _in_order(names: Iterable[str]) -> list[str]:
    """Names sorted, a rollout's by step (``step2`` before ``step16``), after the rest."""

    def key(name: str) -> tuple[int, int, str]:
        parsed = parse_rollout_name(name)
        return (0, 0, name) if parsed is None else (1, parsed[0], parsed[1])

    return sorted(names, key=key)


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
            return cls(added=tuple(_in_order(new)), unreadable=unreadable)
        steps = steps or {}
        changed, kinds, unchanged = [], [], 0
        largest: tuple[str, float, float] | None = None
        for name in _in_order(new.keys() & old.keys()):
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
            added=tuple(_in_order(new.keys() - old.keys())),
            removed=tuple(_in_order(old.keys() - new.keys())),
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


def unused_goldens(
    root: Path,
    nodeids: Iterable[str],
    under: Iterable[str] | None = None,
    ignored: Iterable[str] = (),
) -> list[str]:
    """The golden files under ``root`` that none of the tests ``nodeids`` names (with or
    without a ``name=``); the main job's, under ``main/``, are left out. ``under``: only the
    goldens of tests below these paths (relative to the rootdir, e.g. ``tests/plugin`` or
    ``tests/test_a.py``; ``""`` is everything), the paths a run was given; ``ignored``: not
    those below these (``--ignore``d paths: their tests were not collected)."""
    if not root.is_dir():
        return []
    used = {golden_stem(n) for n in nodeids}
    scopes = None if under is None else [_scope(u) for u in under]
    skipped = [_scope(i) for i in ignored]
    unused = []
    for path in sorted(root.rglob("*.pt")):
        stem = path.relative_to(root).as_posix()[:-3]
        if stem.startswith("main/"):
            continue  # the main job's (harness-check), not a test's
        if scopes is not None and not any(_below(stem, sc) for sc in scopes):
            continue  # a test this run was not given: nothing is known of it
        if any(_below(stem, sc) for sc in skipped):
            continue  # an --ignore'd test: nor of this one
        base = stem.split("].", 1)[0] + "]" if "]." in stem else stem.rsplit(".", 1)[0]
        if (
            stem not in used
            and base not in used
            and not any(stem.startswith(u + ".") for u in used)
        ):
            unused.append(str(path))
    return unused


def _below(stem: str, scope: str) -> bool:
    return not scope or stem == scope or stem.startswith(scope + "/")


def _scope(path: str) -> str:
    path = path.strip("/").removesuffix(".py")
    return "" if path in ("", ".") else path


def prune_goldens(paths: Iterable[str | os.PathLike[str]], root: Path) -> list[str]:
    """Remove each unused golden (one ``unlink`` each: a file is there or gone, never half);
    then the directories under ``root`` it leaves empty. Returns one line per file: what was
    removed, or why it could not be (the rest are still removed)."""
    lines = []
    for raw in paths:
        path = Path(raw)
        try:
            path.unlink()
        except FileNotFoundError:
            lines.append(f"  {path}: already gone")
            continue
        except OSError as exc:
            lines.append(f"  {path}: not removed ({exception_summary(exc)})")
            continue
        lines.append(f"  removed {path}")
        parent = path.parent
        while parent != root and root in parent.parents:
            try:
                parent.rmdir()  # only if empty
            except OSError:
                break
            parent = parent.parent
    return lines


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
    missing = _in_order(golden.keys() - actual.keys())
    extra = _in_order(actual.keys() - golden.keys())
    ran, recorded = _rollout_length(actual), _rollout_length(golden)
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
    for name in _in_order(actual.keys() & golden.keys()):
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
            at = str(tuple(int(i) for i in _unravel(first, t.shape)))  # () when 0-d
            lines.append(
                f"  {name}: {who} {nonfinite_text(nan, inf)} of {t.numel()} (first at {at})"
            )
    return lines


def _unravel(flat: int, shape: torch.Size) -> list[int]:
    out = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        out.append(i)
    return out[::-1]


def _not_a_directory(path: Path) -> None:
    if path.is_dir():
        raise GoldenError(
            f"golden {path} is a directory, where this test's golden file belongs; remove or "
            "rename the directory (or give the golden another name), then "
            f"{UPDATE_HINT}."
        )


def default_provenance() -> dict[str, Any]:
    """What every golden records of where it was made: the harness, torch and torch-harmonics
    versions, and when (UTC)."""
    from harness._version import __version__

    return {
        "harness": __version__,
        "torch": torch.__version__,
        "torch_harmonics": _torch_harmonics_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@functools.lru_cache(maxsize=1)
def _torch_harmonics_version() -> str:
    """Its installed version, read from the package metadata (no import of the package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-harmonics")
    except PackageNotFoundError:
        return "not installed"


def _plain(value: Any) -> Any:
    """Provenance holds only what ``weights_only`` loading accepts: plain scalars and str."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)  # e.g. torch.__version__ is a str subclass that weights_only refuses
