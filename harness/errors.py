"""Exceptions raised by the harness, and how a failed distributed run is summarised.

Every message reads: problem, then evidence, then remedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from harness.compare import Quantity


class HarnessError(Exception):
    """Base class of every error the harness raises on purpose."""


class ConfigError(HarnessError, ValueError):
    """Invalid sizes, partitions or options: the caller asked for something impossible."""


class GoldenError(HarnessError):
    """A golden file that is missing, corrupt, foreign or does not match."""


class PicklingProblem(HarnessError, TypeError):
    """A rank function, its arguments or a rank's result cannot cross a process boundary."""


class EquivalenceFailure(HarnessError, AssertionError):
    """A check found mismatches (``EquivalenceReport.raise_if_failed``): the message is the
    whole report, and ``report`` the report itself. An ``AssertionError``, so test runners
    count it as a failure, not an error."""

    def __init__(self, text: str, report: Any = None) -> None:
        # loosely typed: an EquivalenceReport, whose module imports this one (a type-only import
        # would make a circle); users read its fields, so object would not do
        super().__init__(text)
        self.report = report


class HarnessWarning(UserWarning):
    """Base class of the warnings the harness gives: findings that do not fail a run."""


class UnwaitedWork(HarnessWarning):
    """An operation issued with ``async_op=True`` (or an ``isend``/``irecv``) completed, but
    nothing waited on its work: harmless only where the backend finished it before its
    tensor was used (gloo usually does; NCCL does not). Turn it into a failure with
    ``-W error::harness.UnwaitedWork``."""


class ProblemKind(str, Enum):
    """What a ``RankProblem`` is. ``returned`` and ``stopped`` are context, not causes:
    ``returned`` is a rank that finished without doing a part others wait for (the culprit
    of a proven deadlock); ``stopped`` a healthy rank stopped because another failed."""

    CRASH = "crash"
    RETURNED = "returned"
    TIMEOUT = "timeout"
    DEADLOCK = "deadlock"
    PENDING = "pending"
    ERROR = "error"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def quantity(self) -> Quantity | None:
        """The report's ``Quantity`` for a rank with this problem, of the same name; ``None``
        for context (``returned`` takes its run's hang, ``stopped`` is left out)."""
        if self in (ProblemKind.RETURNED, ProblemKind.STOPPED):
            return None
        return Quantity(self.value)


PROBLEM_KINDS = tuple(k.value for k in ProblemKind)


@dataclass
class RankProblem:
    """What went wrong on one rank of a failed run.

    ``kind`` is one of ``PROBLEM_KINDS``: ``error`` (the rank raised), ``crash`` (the
    process died), ``timeout`` (still running at the deadline), ``deadlock`` (waiting in a
    collective that can no longer complete), ``pending`` (it returned but left a collective
    or a send pending), ``returned`` (it finished while others still waited) or ``stopped``.
    ``phase`` is what the rank was doing (``"step 0 forward"``), when it said so.
    """

    rank: int
    kind: ProblemKind | str  # a ProblemKind once made (a plain string names one too)
    summary: str
    detail: str = ""  # traceback, faulthandler stack or exit description
    output: str = ""  # what the rank printed during the run
    phase: str = ""  # e.g. "build", "step 1 backward" (from the rank's progress reports)
    step: int | None = None  # the step of ``phase``, if any
    seconds: float | None = None  # when the rank answered, seconds into the run

    def __post_init__(self) -> None:
        self.kind = ProblemKind(self.kind)

    def __str__(self) -> str:
        text = f"rank {self.rank}: {self.kind}: {self.summary}"
        if self.phase and self.kind != "returned":
            text += f" (in {self.phase})"
        if self.detail:
            text += "\n" + _indent(self.detail.rstrip())
        return text

    @property
    def cause(self) -> bool:
        """True for a problem that is a cause, not context (``returned``, ``stopped``)."""
        return self.kind not in ("returned", "stopped")


@dataclass
class RankFailure(HarnessError):
    """A distributed run failed on one or more ranks.

    ``problems`` lists every rank that did not finish cleanly, failing ranks first.
    """

    message: str
    world_size: int
    problems: list[RankProblem] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __reduce__(self) -> tuple[object, ...]:
        # Exceptions pickle through ``args``; a dataclass needs its fields instead.
        return (type(self), (self.message, self.world_size, self.problems))

    @property
    def ranks(self) -> list[int]:
        """The ranks whose problem is a cause (not ``returned`` or ``stopped``)."""
        return [p.rank for p in self.problems if p.cause]

    @property
    def returned(self) -> list[int]:
        """Ranks that had returned while others still waited (hangs only)."""
        return [p.rank for p in self.problems if p.kind == "returned"]

    def __str__(self) -> str:
        parts = [self.message]
        parts += [str(p) for p in self.problems]
        return "\n".join(parts)


class RankError(RankFailure):
    """One or more ranks raised an exception."""


class RankCrash(RankFailure):
    """A rank process died (signal or exit) during a run."""


class RankTimeout(RankFailure):
    """A run exceeded its timeout; every rank's stack is attached."""


class RankDeadlock(RankTimeout):
    """A run that can no longer finish, found before its timeout; every rank's stack is
    attached (a ``RankTimeout``, so code that handles hangs handles this too)."""


class RankPending(RankFailure):
    """Every rank returned, but some left a collective or a send pending: the process group
    is not clean, and the next run would inherit it."""


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the harness's plumbing frames (the rank's main loop, the
    run of a case, the watchers of torch.distributed; ``harness._base.frames`` says which): what
    the user's code did, with the library it called (collectives, steppers, adapters)."""
    import traceback

    from harness._base.frames import plumbing

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not plumbing(f.filename)]
    lines = ["Traceback (most recent call last):\n"] if frames else []
    lines += traceback.format_list(frames)
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def exception_summary(exc: BaseException) -> str:
    """``"ValueError: first line of the message"``."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


#: Messages of errors that a rank gets because a peer left a collective (it raised or
#: died): consequences, not causes, so they are listed after the rank that failed first.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "Connection refused",
)

# Which problem is most likely the cause: lower first. A rank that returned while others
# hang, a crash, then a hang, then errors, then errors that only say a peer went away.
_ORDER = {
    "crash": 0,
    "returned": 1,
    "deadlock": 2,
    "timeout": 2,
    "pending": 3,
    "error": 4,
    "stopped": 6,
}


def _rank_order(p: RankProblem) -> int:
    if p.kind == "error" and any(m in p.summary for m in PEER_LOST):
        return 5
    return _ORDER[p.kind]


def failure_from(
    problems: Sequence[RankProblem], world: int, timeout: float, *, headline: str | None = None
) -> RankFailure:
    """The exception for a failed run: its class and headline follow the likeliest cause
    (``headline``, where the caller has a better one from its evidence).

    Within a kind, arrival order is kept: the rank that failed first is the likely cause.
    """
    problems = sorted(problems, key=_rank_order)  # stable: arrival order within a kind
    causes = [p for p in problems if p.cause] or list(problems)
    first = min(causes, key=_rank_order)
    failing = [p.rank for p in causes if _rank_order(p) == _rank_order(first)]
    where = ", ".join(f"{r}/{world}" for r in sorted(failing))
    returned = [p for p in problems if p.kind == "returned"]
    cls: type[RankFailure]
    if first.kind == "crash":
        cls, msg = RankCrash, f"rank {where} died during the run: {first.summary}"
    elif first.kind in ("timeout", "deadlock"):
        cls = RankDeadlock if first.kind == "deadlock" else RankTimeout
        what = (
            f"run deadlocked on rank {where} (found before the {timeout:g}s timeout)"
            if first.kind == "deadlock"
            else f"run timed out after {timeout:g}s on rank {where}"
        )
        if returned:
            gone = ", ".join(f"{p.rank}/{world}" for p in returned)
            when = max(p.seconds or 0.0 for p in returned)
            what += (
                f" while rank {gone} had returned (after {when:.2f}s): the likely culprit, "
                "e.g. it skipped a collective that the others entered"
            )
        msg = (
            f"{what}; every rank's state follows. A rank that skips a collective the "
            "others enter hangs like this; raise the timeout (--spatial-timeout) only if "
            "the work is really that slow."
        )
    elif first.kind == "pending":
        cls = RankPending
        msg = (
            f"rank {where} returned with communication still pending: {first.summary}. "
            "Wait on every async_op work and match every isend with a recv before "
            "returning; the next run would otherwise inherit it."
        )
    else:
        cls, msg = RankError, f"rank {where} raised {first.summary}"
    return cls(headline or msg, world, list(problems))


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
