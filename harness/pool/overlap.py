"""A pool's run in a thread of the calling process, so that serial work (a rollout's
reference and ensemble, a calibrated check's nudged reruns) runs while the ranks do."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.pool import Runner


def in_other_processes(pool: Runner) -> bool:
    """Whether ``pool`` runs its ranks in other processes (a ``RankPool``), so that its run
    can overlap serial work of this process; a runner that runs the function in this very
    process (torchrun, srun) cannot."""
    from harness.pool import RankPool

    return isinstance(pool, RankPool)


class Background:
    """``pool.run(*call, timeout=timeout, **kwargs)`` in a thread: its results, or what it
    raised, from ``result()``.

    A ``RankPool``'s call is pickled here, in the calling thread, before the thread starts:
    the ranks get the arguments as they are now, whatever the serial work beside them does
    to them next (a reference's ``build`` may patch a module a case refers to), and a call
    that cannot be pickled raises ``PicklingProblem`` here. The thread runs in a copy of the
    caller's context, so the run sees what the caller set in context variables (the
    ``--spatial-mutants`` mode a run carries to its ranks). ``done``: told this
    ``Background`` from its thread as the run ends, however it ends (a sweep waits for
    whichever of its runs ends first: ``harness.layouts``)."""

    def __init__(
        self,
        pool: Runner,
        call: tuple[Any, ...],
        timeout: float | None,
        *,
        done: Callable[[Background], None] | None = None,
        **kwargs: Any,
    ) -> None:
        from harness.pool import RankPool
        from harness.pool._pickling import dump_call

        #: when the run was started (``time.perf_counter``): a check judged later counts
        #: its seconds from here
        self.began = time.perf_counter()
        self._out: list[Any] = []
        self._error: BaseException | None = None
        payload = dump_call(call[0], call[1:], kwargs) if isinstance(pool, RankPool) else None
        claims = pool._claims if isinstance(pool, RankPool) else set()
        claims.add(id(self))  # busy now, not only once the thread takes the pool's lock

        def target() -> None:
            try:
                if isinstance(pool, RankPool) and payload is not None:
                    # pool's own folder: _run_pickled is private to harness/pool/
                    self._out = pool._run_pickled(payload, timeout)
                else:
                    self._out = pool.run(*call, timeout=timeout, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller in result()
                self._error = exc
            finally:
                claims.discard(id(self))
                if done is not None:
                    done(self)

        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(target,), name="harness-ranks", daemon=True
        )
        try:
            self._thread.start()
        except BaseException:
            claims.discard(id(self))
            raise

    def failed(self) -> str:
        """Why serial work beside the run should stop (``""``: it should not): the run has
        ended in an error, so nothing of the serial work will be judged."""
        from harness.errors import RankDeadlock, RankTimeout

        error = self._error
        if self._thread.is_alive() or error is None:
            return ""
        if isinstance(error, RankTimeout) and not isinstance(error, RankDeadlock):
            # the serial work's own clock, as long as the ranks', runs out within moments:
            # it then says itself what it did not finish (the report names both parts)
            return ""
        return "stopped: the ranks' run beside it failed"

    def join(self) -> None:
        self._thread.join()

    def result(self) -> list[Any]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out
