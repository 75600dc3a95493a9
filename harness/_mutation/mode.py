"""What a run does about mutants: nothing, record the call sites it reaches, or inject one.

One frozen ``MutantMode`` per run, set by the campaign (``harness._mutation.campaign``) around
what it runs, read by the pool when it sends a run (``RunCall.mutation``) and by the checks
that decide whether to diagnose a failure. Carried in a context variable, not on the pools:
every pool of the process runs in the mode its caller is in.

Pure data: no torch, no pytest.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from harness._mutation.catalogue import Mutant


@dataclass(frozen=True)
class MutantMode:
    """One run's part in a mutation campaign."""

    record: bool = False  # record every call site reached (the campaign's first run)
    mutant: Mutant | None = None  # inject this mutant at its call site
    #: a mutant's rerun: the most seconds a check may take (a mutant that hangs where nothing
    #: can prove it is ended sooner than by the whole timeout); ``None``: the usual timeout
    timeout: float | None = None

    @property
    def verdict_only(self) -> bool:
        """A mutant's rerun only asks whether a check fails: no locating, no layout sweep,
        nothing that diagnoses a failure it caused on purpose."""
        return self.mutant is not None


#: the mode of every run outside a campaign
OFF = MutantMode()
#: the mode of the campaign's first run
RECORD = MutantMode(record=True)

_MODE: ContextVar[MutantMode] = ContextVar("harness_mutant_mode", default=OFF)


def current() -> MutantMode:
    """The mode the runs started now are in."""
    return _MODE.get()


@contextmanager
def running(mode: MutantMode) -> Iterator[MutantMode]:
    """Run what the block starts in ``mode`` (the mode before is back after it)."""
    token = _MODE.set(mode)
    try:
        yield mode
    finally:
        _MODE.reset(token)
