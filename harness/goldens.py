"""``.pt`` golden files: the reference run's tensors, stored with provenance.

A golden is a dict saved by ``torch.save``::

    {"format": "harness-golden", "version": 1,
     "provenance": {...strings and numbers...},
     "tensors": {"step0/loss": tensor, ...}}

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
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from harness._pids import pid_alive as _pid_alive
from harness.compare import (
    Bound,
    Tolerance,
    compare_tensors,
    nonfinite_counts,
    nonfinite_text,
)
from harness.errors import GoldenError, exception_summary
from harness.report import EquivalenceReport

FORMAT = "harness-golden"
VERSION = 1
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
        if data.get("version") != VERSION:
            raise GoldenError(
                f"golden {path} has format version {data.get('version')!r}, this harness "
                f"reads version {VERSION}; {UPDATE_HINT}."
            )
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
    ) -> GoldenResult:
        """Compare ``tensors`` with the golden at ``path`` (or write it, when updating).

        A NaN or inf on either side is a difference unless ``allow_nonfinite``; updating
        refuses to write non-finite tensors (status ``refused``).
        """
        provenance = {**default_provenance(), **(provenance or {})}
        exists = path.exists()
        lines: list[str] = []
        if exists:
            try:
                golden = self.load(path)["tensors"]
            except GoldenError:
                if not self.update:
                    raise
                golden = None
            if golden is not None:
                lines = diff_tensors(tensors, golden, bound, allow_nonfinite=allow_nonfinite)
                if not lines:
                    return GoldenResult(
                        path, GoldenStatus.UNCHANGED if self.update else GoldenStatus.PASSED
                    )
        if not self.update:
            if not exists:
                return GoldenResult(
                    path,
                    GoldenStatus.MISSING,
                    [f"no golden at {path}: {UPDATE_HINT} (then commit the new file)."],
                )
            return GoldenResult(
                path, GoldenStatus.FAILED, [*lines, f"If the change is intended, {UPDATE_HINT}."]
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
        return GoldenResult(path, GoldenStatus.UPDATED if exists else GoldenStatus.WRITTEN, lines)

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
      of the report, the versions (``default_provenance``), and ``provenance``'s entries.
    """
    if store.update and not report.ok:
        return store.not_updated(path, "the equivalence check failed")
    dtype = next(iter(report.reference.values())).dtype
    return store.check(
        path,
        report.reference,
        bound=Tolerance.for_dtype(dtype).field,
        provenance={**report_provenance(report), **(provenance or {})},
        allow_nonfinite=allow_nonfinite,
    )


def report_provenance(report: EquivalenceReport) -> dict[str, Any]:
    """What a golden of ``report``'s reference records of the check behind it."""
    return {
        "case": report.case,
        "ranks": report.ranks,
        "spatial_size": report.spatial_size,
        "partition": report.partition,
        "dtype": report.dtype,
        "steps": report.steps,
    }


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


def unused_goldens(root: Path, nodeids: Iterable[str]) -> list[str]:
    """The golden files under ``root`` that none of the tests ``nodeids`` names (with or
    without a ``name=``); the main job's, under ``main/``, are left out."""
    if not root.is_dir():
        return []
    used = {golden_stem(n) for n in nodeids}
    unused = []
    for path in sorted(root.rglob("*.pt")):
        stem = path.relative_to(root).as_posix()[:-3]
        if stem.startswith("main/"):
            continue  # the main job's (harness-check), not a test's
        base = stem.split("].", 1)[0] + "]" if "]." in stem else stem.rsplit(".", 1)[0]
        if (
            stem not in used
            and base not in used
            and not any(stem.startswith(u + ".") for u in used)
        ):
            unused.append(str(path))
    return unused


def diff_tensors(
    actual: Mapping[str, torch.Tensor],
    golden: Mapping[str, torch.Tensor],
    bound: Bound,
    *,
    allow_nonfinite: bool = False,
) -> list[str]:
    """Lines describing every difference between two tensor maps (empty if none).

    Unless ``allow_nonfinite``, a NaN or inf on either side is a difference of its own (a
    golden cannot vouch for it, matching or not).
    """
    lines = []
    for name in sorted(golden.keys() - actual.keys()):
        lines.append(f"  {name}: in the golden but not produced any more")
    for name in sorted(actual.keys() - golden.keys()):
        lines.append(f"  {name}: produced but not in the golden")
    if not allow_nonfinite:
        lines += _nonfinite_lines(golden, "the golden holds")
        lines += _nonfinite_lines(actual, "this run produced")
    for name in sorted(actual.keys() & golden.keys()):
        d = compare_tensors(actual[name], golden[name], bound, allow_nonfinite=True)
        if d.problem:
            lines.append(f"  {name}: {d.problem} (golden)")
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
    from harness._version import __version__

    return {
        "harness": __version__,
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _plain(value: Any) -> Any:
    """Provenance holds only what ``weights_only`` loading accepts: plain scalars and str."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)  # e.g. torch.__version__ is a str subclass that weights_only refuses
