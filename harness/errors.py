"""Exceptions raised by the harness.

Every message reads: problem, then evidence, then remedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class HarnessError(Exception):
    """Base class of every error the harness raises on purpose."""


class ConfigError(HarnessError, ValueError):
    """Invalid sizes, partitions or options: the caller asked for something impossible."""


class GoldenError(HarnessError):
    """A golden file that is missing, corrupt, foreign or does not match."""


class PicklingProblem(HarnessError, TypeError):
    """A rank function, its arguments or a rank's result cannot cross a process boundary."""


@dataclass
class RankProblem:
    """What went wrong on one rank of a failed run.

    ``kind`` is ``"error"`` (the rank raised), ``"crash"`` (the process died),
    ``"timeout"`` (still running at the deadline) or ``"stopped"`` (a healthy rank that
    was stopped because another one failed).
    """

    rank: int
    kind: str
    summary: str
    detail: str = ""  # traceback, faulthandler stack or exit description
    output: str = ""  # what the rank printed during the run

    def __str__(self) -> str:
        text = f"rank {self.rank}: {self.kind}: {self.summary}"
        if self.detail:
            text += "\n" + _indent(self.detail.rstrip())
        return text


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

    def __reduce__(self):  # type: ignore[override]
        # Exceptions pickle through ``args``; a dataclass needs its fields instead.
        return (type(self), (self.message, self.world_size, self.problems))

    @property
    def kind(self) -> str:
        """The kind of the first real problem (``error``, ``crash`` or ``timeout``)."""
        for p in self.problems:
            if p.kind != "stopped":
                return p.kind
        return "error"

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self.problems if p.kind != "stopped"]

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


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
