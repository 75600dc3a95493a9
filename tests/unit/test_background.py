"""A pool's run in a thread (``harness.pool.overlap.Background``) sees the caller's context."""

from __future__ import annotations

from typing import Any

from harness._mutation.mode import MutantMode, current, running
from harness.pool.overlap import Background


class ModeReader:
    """A runner that answers, from inside its run, which mutant mode it sees."""

    def run(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        return [current()]


def test_a_run_in_the_background_sees_the_mutant_mode_its_caller_set():
    """The ``--spatial-mutants`` mode is a context variable: a thread of its own would see
    the default (no recording), and every check that runs its ranks beside the reference
    would record no mutation sites."""
    mode = MutantMode(record=True)
    with running(mode):
        (seen,) = Background(ModeReader(), (print,), None).result()
    assert seen == mode
