"""A test's hold on the warm pools: which runner runs a world size, with what time limit,
and whether the test ran anything on the ranks at all."""

from __future__ import annotations

import pytest

from harness._mutation.mode import current as mutant_mode
from harness.pool import PoolRegistry, RankPool
from harness.pool.launcher import LauncherRegistry, LauncherRunner, WorldSizeMismatch


class PoolLease:
    """The pools one test runs on: the registry's warm ones, or brand-new ones for a
    ``fresh`` test (discarded again when it ends); ``ranks`` and ``timeout`` its defaults."""

    def __init__(
        self,
        registry: PoolRegistry | LauncherRegistry,
        ranks: int,
        timeout: float,
        *,
        fresh: bool = False,
    ) -> None:
        self.registry = registry
        self.ranks = ranks
        self.timeout = timeout
        self.fresh = fresh
        self.used = False  # did the test run anything on the ranks?
        self._fresh: dict[int, RankPool] = {}  # world size -> pool, for fresh tests

    @property
    def launcher(self) -> bool:
        """True when pytest runs under torchrun or srun (functions run in place)."""
        return isinstance(self.registry, LauncherRegistry)

    def pool(self, ranks: int | None = None) -> RankPool | LauncherRunner:
        """The runner of ``ranks`` (default: the test's); a skip naming why where the
        launcher started another number of ranks."""
        self.used = True
        size = ranks or self.ranks
        try:
            pool = self.registry.get(size)
        except WorldSizeMismatch as exc:
            pytest.skip(f"{exc} (run it without torchrun/srun, or with that many ranks)")
        if self.fresh and size not in self._fresh and isinstance(pool, RankPool):
            pool.discard()  # brand-new rank processes: no module globals of earlier tests
            self._fresh[size] = pool
        return pool

    def seconds(self, timeout: float | None) -> float:
        """A run's time limit: ``timeout``, else the test's; a mutant's rerun caps it."""
        seconds = timeout or self.timeout
        cap = mutant_mode().timeout  # a mutant's rerun: a shorter limit
        return min(seconds, cap) if cap else seconds

    def discard_fresh(self) -> None:
        """After a fresh test: its rank processes go with it."""
        for pool in self._fresh.values():
            pool.discard()
        self._fresh.clear()
