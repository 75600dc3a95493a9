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


class Raising:
    def run(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        raise RuntimeError("rank 1 raised")


def test_done_hears_of_the_run_as_it_ends_however_it_ends():
    heard: list[Background] = []
    ok = Background(ModeReader(), (print,), None, done=heard.append)
    failed = Background(Raising(), (print,), None, done=heard.append)
    ok.join()
    failed.join()
    assert sorted(map(id, heard)) == sorted([id(ok), id(failed)])
    assert ok.began <= failed.began


def test_main_is_swapped_out_by_one_thread_at_a_time():
    """A sweep starts the pools of its world sizes in the threads that run them
    (``harness.layouts._lanes``): interleaved swaps of ``__main__`` left one thread's stand-in
    in place for good, and let the other spawn ranks that re-ran the parent's script."""
    import sys
    import threading

    from harness.pool._processes import no_main_module

    real = sys.modules["__main__"]
    inside = threading.Event()
    release = threading.Event()
    seen: list[object] = []

    def first() -> None:
        with no_main_module():
            inside.set()
            release.wait(5)

    def second() -> None:
        inside.wait(5)
        with no_main_module():
            seen.append(sys.modules["__main__"])

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside.wait(5)
    threading.Event().wait(0.05)  # the second thread has reached its swap by now
    assert not seen, "a second swap began while the first was in place"
    release.set()
    for t in threads:
        t.join(5)
    assert len(seen) == 1 and seen[0] is not real
    assert sys.modules["__main__"] is real
