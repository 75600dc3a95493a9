"""Where a failing check's evidence points in the user's own code: a file and a line.

A CI annotation (``harness.plugin.github``) belongs on the line a reader must change, not on
the test that called the check. The evidence names it in three ways:

- a located first divergence names a module: its class's ``forward`` as the ranks ran it
  (``Location.sources``); a module whose class is not the user's (``torch.nn.Linear``) is
  named by the nearest enclosing module that is, else by the case's ``forward``, which calls
  the model. A gradient synchronisation points at the case's ``build`` (where the model's
  gradients are hooked); the loss and a field at the case's ``forward``, the batch at its
  ``batch``, predict's code at its ``predict``;
- a run that hung, raised or died names each rank's stack: the innermost frame of the
  user's code there (a deadlock's waiting rank: the line that issued the collective, not
  the harness's or torch's function it went through). A rank that returned without its part
  has no stack: its line is the waiting ranks', and its evidence is said in their message;
- anything else (a coverage gap, a vacuous check) names no line: only the test's.

"The user's code" is what ``harness._base.frames`` calls model code: outside torch, the standard
library and the harness (its built-in steppers and contributed adapters count as models).
Pure and plain: sites are dicts of built-in types, so they travel from an xdist worker.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, TypedDict

from harness._base.frames import harness_library, plumbing, standard_library
from harness.compare import Mismatch, Quantity

if TYPE_CHECKING:
    from harness.divergence import Divergence
    from harness.report import EquivalenceReport


class Site(TypedDict):
    """One annotation: ``file`` (absolute), ``line`` (1-based), a short ``title`` and the
    ``message`` (several lines)."""

    file: str
    line: int
    title: str
    message: str


#: quantities of a run that did not finish cleanly: their evidence is a stack
RUN_FAILURES = frozenset(
    {Quantity.DEADLOCK, Quantity.TIMEOUT, Quantity.ERROR, Quantity.CRASH, Quantity.PENDING}
)
#: at most this many annotations per check (GitHub shows ten errors per step)
MAX_SITES = 3
#: at most this many lines of evidence per annotation
MAX_LINES = 12

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<name>\S+)')


def stack_frames(text: str) -> list[tuple[str, int, str]]:
    """The frames of the tracebacks and faulthandler stacks in ``text``, innermost first:
    (file, line, function). A traceback lists the innermost call last, faulthandler first.

    >>> traceback = ["Traceback (most recent call last):",
    ...              '  File "a.py", line 3, in f', '  File "b.py", line 9, in g']
    >>> stack_frames("\\n".join(traceback))
    [('b.py', 9, 'g'), ('a.py', 3, 'f')]
    >>> dump = ["Current thread 0x1 (most recent call first):",
    ...         '  File "b.py", line 9 in g', '  File "a.py", line 3 in f']
    >>> stack_frames("\\n".join(dump))
    [('b.py', 9, 'g'), ('a.py', 3, 'f')]
    """
    frames = [(m["file"], int(m["line"]), m["name"]) for m in _FRAME.finditer(text)]
    return frames if "most recent call first" in text else frames[::-1]


def user_code(path: str) -> bool:
    """Is ``path`` the user's code: not torch, the standard library or the harness's own
    (its models, the steppers and contributed adapters, count as the user's)?"""
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return not (
        path.startswith(torch_dir)
        or standard_library(path)
        or plumbing(path)
        or harness_library(path)
        or path.startswith("<")
    )


def failure_sites(report: EquivalenceReport, case: object) -> list[Site]:
    """Where ``report``'s failure points in the user's code (``[]``: passed, or nowhere)."""
    if report.ok:
        return []
    run = [m for m in report.mismatches if m.quantity in RUN_FAILURES]
    if run:
        return _run_sites(report, run)
    found = report.first_divergence
    if found is None:
        return []
    sources = report.location.sources if report.location is not None else {}
    where = _divergence_source(found, sources, case)
    if where is None:
        return []
    from harness.report import located_remedy

    message = f"{found.line()}\nWhat to do: {located_remedy(found)}"
    title = f"{report.case}: first divergence, {found.located}"
    return [Site(file=where[0], line=where[1], title=title, message=message)]


def _run_sites(report: EquivalenceReport, run: list[Mismatch]) -> list[Site]:
    """One site per user line the stuck (raising, dead) ranks were at, their evidence and
    that of the ranks with no stack (a rank that returned without its part) in each."""
    at: dict[tuple[str, int], list[Mismatch]] = {}
    unplaced: list[Mismatch] = []
    for m in run:
        frame = next((f for f in stack_frames(m.detail) if user_code(f[0])), None)
        if frame is None:
            unplaced.append(m)
        else:
            at.setdefault((frame[0], frame[1]), []).append(m)
    sites = []
    for (path, line), here in list(at.items())[:MAX_SITES]:
        ranks = ", ".join(str(m.rank) for m in here)
        kinds = "/".join(dict.fromkeys(str(m.quantity) for m in here))
        evidence = [f"rank {m.rank}: {m.quantity}: {m.where}" for m in [*here, *unplaced]]
        sites.append(
            Site(
                file=path,
                line=line,
                title=f"{report.case}: {kinds} on rank{'s' if len(here) > 1 else ''} {ranks}",
                message="\n".join(evidence[:MAX_LINES]),
            )
        )
    return sites


def _divergence_source(
    found: Divergence, sources: dict[str, tuple[str, int]], case: object
) -> tuple[str, int] | None:
    """The user's line for a located first divergence (the module docstring's rule)."""
    if found.cause == "synchronisation":
        return case_source(case, "build")
    if found.module is None:
        if found.name.startswith("predict's code"):
            return case_source(case, "predict") or case_source(case, "forward")
        if "batch" in found.name:
            return case_source(case, "batch")
        return case_source(case, "forward")
    name: str | None = found.module
    while name is not None:  # the module, then each enclosing one: "a.b" -> "a" -> ""
        where = sources.get(name)
        if where is not None and user_code(where[0]):
            return where
        name = None if not name else name.rpartition(".")[0]
    return case_source(case, "forward")


def case_source(case: object, method: str) -> tuple[str, int] | None:
    """Where the case's class defines ``method`` (file, first line), if in the user's code
    (``SpatialCase``'s own defaults are not)."""
    import inspect

    fn = getattr(type(case), method, None)
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    if code is None or not user_code(code.co_filename):
        return None
    return code.co_filename, code.co_firstlineno
