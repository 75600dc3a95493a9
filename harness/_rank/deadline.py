"""A check's clock for the serial runs of the calling process: the reference, its nudged
reruns and the serial rollouts stop at the check's timeout, as the ranks' run does, and stop
at once when the ranks' run beside them has failed (nothing would be judged).

Checked between the phases of a training step (``run_case``'s ``progress``), between the
steps of a rollout and at every call of the model or of a child of it in a serial rollout
(``run_prediction``): a single torch operation that runs past the deadline is not
interrupted, the next call or step is. No thread, no signal: the run stops itself, in the
calling process's own thread.

Rank-side code (the serial runs are run_case's and run_prediction's): imports no pytest,
nothing of the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Deadline", "RanOut"]


class RanOut(Exception):
    """A serial run stopped by its check's ``Deadline``: past the timeout (``abandoned``
    empty) or because the ranks' run beside it failed (``abandoned`` says so)."""

    def __init__(self, seconds: float | None, abandoned: str = "") -> None:
        self.seconds, self.abandoned = seconds, abandoned
        why = abandoned or f"ran past the check's timeout of {seconds:g} s"
        super().__init__(why)


@dataclass
class Deadline:
    """Stop a serial run at ``at`` (``time.monotonic()``; ``None``: never by the clock) or
    once ``stop()`` says why it should (``""``: go on)."""

    at: float | None
    seconds: float | None = None
    stop: Callable[[], str] | None = None

    @classmethod
    def after(cls, seconds: float | None, stop: Callable[[], str] | None = None) -> Deadline:
        """A deadline ``seconds`` from now (``None``: none, but ``stop`` still asked)."""
        at = None if seconds is None else time.monotonic() + seconds
        return cls(at, seconds, stop)

    def check(self) -> None:
        """Raise ``RanOut`` where the run must stop."""
        if self.stop is not None:
            why = self.stop()
            if why:
                raise RanOut(self.seconds, why)
        if self.at is not None and time.monotonic() > self.at:
            raise RanOut(self.seconds)

    def progress(self, phase: str, step: int | None = None) -> None:
        """``run_case``'s and ``run_prediction``'s ``progress``: checked at every phase but
        teardown (what undoes build's patches runs whatever the clock says)."""
        if phase != "teardown":
            self.check()

    def watch_modules(self, model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """A forward pre-hook on ``model`` and each of its children that checks the
        deadline: a rollout computed inside one ``predict`` call (a list returned at the
        end) stops at its next call of the model or of a part of it (a step calls one of
        them; the modules inside a child are left unhooked, a hook costs a Python call)."""
        out = []
        for module in [model, *model.children()]:
            try:
                out.append(module.register_forward_pre_hook(self._hook))
            except RuntimeError:  # a module that takes no hooks (scripted): unwatched
                continue
        return out

    def _hook(self, *_: object) -> None:
        self.check()
