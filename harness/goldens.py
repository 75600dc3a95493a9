"""``.pt`` golden files: the reference run's tensors, stored with provenance.

A golden is a dict saved by ``torch.save``::

    {"format": "harness-golden", "version": 1,
     "provenance": {...strings and numbers...},
     "tensors": {"step0/loss": tensor, ...}}

It is loaded with ``torch.load(weights_only=True)``: nothing in a golden is ever executed.
Writes go to a temporary file in the same directory, then ``os.replace``: a golden is either
the old file or the new one, never a truncated one, even if the writer is killed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.compare import Bound, compare_tensors
from harness.errors import GoldenError

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


@dataclass
class GoldenResult:
    """The outcome of one golden check: ``status`` in passed, failed, missing, written,
    updated, unchanged."""

    path: Path
    status: str
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "written", "updated", "unchanged")

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

    def load(self, path: Path) -> dict[str, Any]:
        """Load and validate a golden; a clear ``GoldenError`` if it is not one of ours."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise GoldenError(
                f"golden {path} cannot be read ({type(exc).__name__}: {_first_line(exc)}); "
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
        return data

    def write(
        self, path: Path, tensors: Mapping[str, torch.Tensor], provenance: Mapping[str, Any]
    ) -> None:
        """Write atomically: temporary file in the same directory, fsync, rename."""
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": FORMAT,
            "version": VERSION,
            "provenance": {str(k): _plain(v) for k, v in provenance.items()},
            "tensors": {k: v.detach().to("cpu").clone() for k, v in tensors.items()},
        }
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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

    # ------------------------------------------------------------------ check

    def check(
        self,
        path: Path,
        tensors: Mapping[str, torch.Tensor],
        *,
        bound: Bound,
        provenance: Mapping[str, Any] | None = None,
    ) -> GoldenResult:
        """Compare ``tensors`` with the golden at ``path`` (or write it, when updating)."""
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
                lines = diff_tensors(tensors, golden, bound)
                if not lines:
                    return GoldenResult(path, "unchanged" if self.update else "passed")
        if not self.update:
            if not exists:
                return GoldenResult(
                    path,
                    "missing",
                    [f"no golden at {path}: {UPDATE_HINT} (then commit the new file)."],
                )
            return GoldenResult(
                path, "failed", [*lines, f"If the change is intended, {UPDATE_HINT}."]
            )
        self.write(path, tensors, provenance)
        return GoldenResult(path, "updated" if exists else "written", lines)


def diff_tensors(
    actual: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor], bound: Bound
) -> list[str]:
    """Lines describing every difference between two tensor maps (empty if none)."""
    lines = []
    for name in sorted(golden.keys() - actual.keys()):
        lines.append(f"  {name}: in the golden but not produced any more")
    for name in sorted(actual.keys() - golden.keys()):
        lines.append(f"  {name}: produced but not in the golden")
    for name in sorted(actual.keys() & golden.keys()):
        d = compare_tensors(actual[name], golden[name], bound)
        if d.problem:
            lines.append(f"  {name}: {d.problem} (golden)")
        elif not d.ok:
            lines.append(
                f"  {name}: {d.count}/{d.total} over tolerance (rtol {bound.rtol:g}, atol "
                f"{bound.atol:g}); max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}"
            )
    return lines


def default_provenance() -> dict[str, Any]:
    from harness import __version__

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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:160] if lines else ""
