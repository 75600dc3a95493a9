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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from harness._base.pids import pid_alive as _pid_alive
from harness.compare import Bound, Tolerance
from harness.errors import GoldenError, exception_summary
from harness.goldens._changes import STATUSES, GoldenChange, GoldenStatus, GoldenTally
from harness.goldens._diff import (
    LAYOUT_KEYS,
    UPDATE_HINT,
    VERSION_KEYS,
    _nonfinite_lines,
    diff_tensors,
    recorded_elsewhere,
)
from harness.goldens._rollout import StepBound, rollout_bounds
from harness.report import EquivalenceReport

__all__ = [
    "FORMAT",
    "LAYOUT_KEYS",
    "READABLE",
    "STATUSES",
    "UPDATE_HINT",
    "VERSION",
    "VERSION_KEYS",
    "GoldenChange",
    "GoldenFile",
    "GoldenResult",
    "GoldenStatus",
    "GoldenStore",
    "GoldenTally",
    "StepBound",
    "check_report",
    "default_provenance",
    "diff_tensors",
    "golden_stem",
    "prune_goldens",
    "recorded_elsewhere",
    "report_provenance",
    "rollout_bounds",
    "shared_golden",
    "unused_goldens",
]

FORMAT = "harness-golden"
VERSION = 2
#: the format versions this harness reads (1: before versions and layout were recorded)
READABLE = (1, 2)


def golden_stem(nodeid: str) -> str:
    """The file stem for a test node id: its path without ``.py``, then the test name.

    >>> golden_stem("tests/distributed/test_sfno.py::test_grid[h2w1-float64]")
    'tests/distributed/test_sfno/test_grid[h2w1-float64]'
    """
    path, _, name = nodeid.partition("::")
    path = path[:-3] if path.endswith(".py") else path
    name = re.sub(r"[^A-Za-z0-9_.\-\[\]]", "_", name.replace("::", "."))
    return f"{path}/{name}" if name else path


def shared_golden(path: str | os.PathLike[str], tests: Iterable[str]) -> str:
    """The error of tests whose ids map to one golden file (``"a b"`` and ``"a_b"``: a
    test id's characters a file name cannot hold become ``_``), and its fix."""
    names = ", ".join(repr(t) for t in sorted(set(tests)))
    return (
        f"golden {path} is the golden of more than one test: {names} (their ids differ only "
        "in characters a golden's file name replaces with '_'), so each checks against, and "
        "--update-goldens writes over, the other's. Rename one id (pytest.param(..., "
        "id=...)) or give each test's golden its own name (spatial.check(case, "
        "golden='name'), golden.check(tensors, name='name')), then run --update-goldens."
    )


class GoldenFile(TypedDict):
    """What a golden file holds (``GoldenStore.load``)."""

    format: str  # FORMAT
    version: int  # VERSION
    provenance: dict[str, Any]  # plain scalars and text: weights_only loading accepts no other
    tensors: dict[str, torch.Tensor]


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
        self._owners: dict[Path, str] = {}  # golden path -> the test that first used it

    def claim(self, path: Path, owner: str) -> None:
        """``path`` is ``owner``'s golden (a test's node id): a ``GoldenError`` naming both
        tests when another test of this process already used it, before either can check
        against, or write, the other's golden."""
        first = self._owners.setdefault(path, owner)
        if first != owner:
            raise GoldenError(shared_golden(path, [first, owner]))

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
    from harness._base.version import __version__

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
