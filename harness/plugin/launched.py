"""torchrun/srun mode: pytest started on every rank by a launcher, tests run in place."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, TextIO

import pytest

if TYPE_CHECKING:
    from pluggy import Result

from harness.errors import ConfigError
from harness.plugin._keys import _registry_key
from harness.plugin.options import _parse_ranks, _setting
from harness.pool.launcher import LauncherRegistry, LauncherRunner


def _runner(config: pytest.Config) -> LauncherRunner | None:
    registry = config.stash.get(_registry_key, None)
    return registry.runner if isinstance(registry, LauncherRegistry) else None


def launcher_registry(
    config: pytest.Config, env: dict[str, int], timeout: float
) -> LauncherRegistry:
    """torchrun/srun started this pytest on every rank: run in place, report from rank 0.
    Registers ``LauncherMode``, the hooks this mode needs, and only in this mode."""
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            "-n (pytest-xdist) cannot be combined with torchrun/srun: each launched rank is "
            "one pytest process already; drop -n"
        )
    explicit = _setting(config, "spatial_ranks")
    if explicit is not None and _parse_ranks(explicit) != env["world_size"]:
        raise pytest.UsageError(
            f"--spatial-ranks {explicit} but the launcher started {env['world_size']} ranks; "
            f"use --spatial-ranks {env['world_size']} or start {explicit} ranks"
        )
    real = None
    if env["rank"] != 0:
        # Only rank 0 reports. The terminal reporter is made after this hook (we run
        # first) from sys.stdout; give it a sink, then put stdout back for the tests.
        sink = open(os.devnull, "w")  # lives as long as the session
        real, sys.stdout = sys.stdout, sink
        config.add_cleanup(sink.close)
    try:
        runner = LauncherRunner(timeout=timeout)
    except ConfigError as exc:  # no group to run in: one line on every task, never a suite each
        raise pytest.UsageError(str(exc)) from None
    config.pluginmanager.register(LauncherMode(runner, real), "harness-launcher")
    return LauncherRegistry(runner)


class LauncherMode:
    """The hooks of torchrun/srun mode: every rank collects the same tests, skips the
    pool's own tests, agrees on each verdict and draws the same Hypothesis examples."""

    def __init__(self, runner: LauncherRunner, real_stdout: TextIO | None) -> None:
        self.runner = runner
        self.real_stdout = real_stdout

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.real_stdout is not None:  # the terminal reporter has its sink by now
            sys.stdout = self.real_stdout
        _same_examples_on_every_rank()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        ids = [item.nodeid for item in session.items]
        everyone = self.runner.gather(ids)
        for rank, other in enumerate(everyone):
            if other != everyone[0]:
                diff = sorted(set(other) ^ set(everyone[0]))[:5] or ["(same tests, other order)"]
                pytest.exit(
                    f"rank {rank} collected other tests than rank 0 under the launcher; every "
                    f"rank must run the same tests in the same order. First differences: {diff}",
                    returncode=pytest.ExitCode.USAGE_ERROR,
                )

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        skip = pytest.mark.skip(reason="exercises the rank pool; not under torchrun/srun")
        for item in items:
            if item.get_closest_marker("spatial_pool"):
                item.add_marker(skip)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Result[pytest.TestReport], None]:
        outcome = yield
        rep = outcome.get_result()
        runner = self.runner
        # Every rank decides the same verdict: a rank that failed fails the test everywhere,
        # so no rank goes on to a collective that the failed rank will never enter.
        mine = (rep.outcome, rep.longreprtext[-4000:] if rep.failed else "")
        verdicts = runner.gather(mine)
        failed = [r for r, v in enumerate(verdicts) if v[0] == "failed"]
        if failed and not rep.failed:
            rep.outcome = "failed"
            rep.longrepr = (
                f"failed on rank {', '.join(map(str, failed))} of {runner.world_size} "
                f"(this is rank {runner.rank}); rank {failed[0]} says:\n{verdicts[failed[0]][1]}"
            )
        elif not failed and len({v[0] for v in verdicts}) > 1:
            rep.outcome = "failed"
            rep.longrepr = f"ranks disagree on the outcome of {call.when}: " + ", ".join(
                f"rank {r} {v[0]}" for r, v in enumerate(verdicts)
            )


def _same_examples_on_every_rank() -> None:
    """Under a launcher every rank runs each Hypothesis test itself: the ranks must draw the
    same examples in the same order, or their collectives do not match. Derandomize (on top
    of whatever --hypothesis-profile loaded) and keep the example database, which each rank
    may replay differently, out of it."""
    from hypothesis import settings

    settings.register_profile(
        "harness-launcher", parent=settings.default, derandomize=True, database=None
    )
    settings.load_profile("harness-launcher")
