"""The pytest side of the harness: options, marker, fixtures, header and summary.

The only package that knows pytest hooks, and nothing of the harness imports it: pytest
loads it through the ``pytest11`` entry point ``harness.plugin``. Each hook is thin and
hands off to library objects (``PoolRegistry``, ``GoldenStore``, ``check_equivalence``)
that work without pytest. One job per module:

- ``options``: the options' declarations, and ``Settings``, parsed and checked once;
- ``fixtures``: ``spatial`` and ``golden``, and what a test sees of them, a thin face over
  one module per job: ``marker`` (the marker's options), ``lease`` (which pool runs, within
  what time), ``rank_output`` (what the ranks printed), ``check`` (``spatial.check``),
  ``sweep`` (``spatial.check_layouts``), ``golden_fixture`` (``golden``, and a check's
  golden), ``pictures`` (a failure's maps and curves);
- ``session``: the session's summary (goldens, the equivalence table), on the controller;
- ``html_report``: ``--spatial-report``'s page, drawn where tests run, written on the controller;
- ``launched``: torchrun/srun mode, a plugin object registered only under a launcher;
- ``github``: GitHub Actions annotations and job summary, JUnit properties;
- this module: configure, the header, closing the pools.
"""

from __future__ import annotations

import signal
from collections.abc import Generator
from types import FrameType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pluggy import Result

from harness.goldens import GoldenStore
from harness.plugin import github
from harness.plugin._keys import _registry_key, _settings_key, _skipped_key
from harness.plugin.fixtures import SpatialFixture, SpatialUnusedWarning, golden, spatial
from harness.plugin.golden_fixture import GoldenFixture
from harness.plugin.launched import LauncherMode, launcher_registry
from harness.plugin.options import (
    DEFAULT_RANKS,
    Settings,
    parse_seconds,
    pytest_addoption,
    pytest_load_initial_conftests,
)
from harness.plugin.pictures import write_error_maps
from harness.plugin.rank_output import OUTPUT_LIMIT
from harness.plugin.session import HarnessSession, _session_key
from harness.plugin.summary import SummaryRows
from harness.pool import PoolRegistry, keep_limits
from harness.pool.launcher import LauncherRegistry, launcher_env

__all__ = [
    "DEFAULT_RANKS",
    "OUTPUT_LIMIT",
    "GoldenFixture",
    "HarnessSession",
    "LauncherMode",
    "Settings",
    "SpatialFixture",
    "SpatialUnusedWarning",
    "golden",
    "parse_seconds",
    "pytest_addoption",
    "pytest_load_initial_conftests",
    "spatial",
    "write_error_maps",
]


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' plugin loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    from harness.strategies import register_profiles

    register_profiles()
    config.addinivalue_line(
        "markers",
        "spatial(ranks=None, timeout=None, fresh=False): run this test's spatial jobs on "
        "`ranks` rank processes (default --spatial-ranks) with a per-run `timeout` in "
        "seconds; fresh=True: on brand-new rank processes (no module state of other tests).",
    )
    config.addinivalue_line(
        "markers",
        "spatial_pool: the test exercises the rank pool itself (crashes, timeouts, spawning); "
        "skipped when pytest runs under torchrun or srun.",
    )
    settings = Settings.parse(config)
    config.stash[_settings_key] = settings
    _interrupt_on_sigterm(config)
    env = launcher_env()
    if env is not None and not hasattr(config, "workerinput"):
        config.stash[_registry_key] = launcher_registry(config, env, settings.timeout)
    else:
        config.stash[_registry_key] = PoolRegistry(
            default_ranks=settings.ranks,
            timeout=settings.timeout,
            start_method=settings.start_method,
            deadlock_window=settings.deadlock_window,
            preload=list(settings.preload),
            pin_ranks=settings.pin_ranks,
            **keep_limits(),  # a layout sweep's pools of every size stay warm
        )
    _register_mutants(config, settings)
    github.register(config)  # JUnit properties; GitHub Actions annotations and summary
    if settings.report is not None:
        from harness.plugin.html_report import HtmlReport

        config.pluginmanager.register(HtmlReport(config, settings.report), "harness-report")
    session = HarnessSession(
        GoldenStore(settings.golden_dir, update=settings.update_goldens),
        show_unused=settings.goldens_unused,
    )
    config.stash[_session_key] = session
    config.pluginmanager.register(session, "harness-session")
    config.pluginmanager.register(SummaryRows(), "harness-summary-rows")
    if not hasattr(config, "workerinput"):  # once per session: the controller, not each worker
        session.swept = session.goldens.sweep()


def _register_mutants(config: pytest.Config, settings: Settings) -> None:
    """``--spatial-mutants``: the mutation run's plugin object, only when asked for."""
    if not settings.mutants:
        return
    registry = config.stash[_registry_key]
    if isinstance(registry, LauncherRegistry):
        raise pytest.UsageError(
            "--spatial-mutants injects bugs on the harness's own rank pool, which torchrun/srun "
            "mode does not use; run it without the launcher"
        )
    from harness.plugin.mutants import MutantSession

    config.pluginmanager.register(
        MutantSession(config, settings.mutants_min_score), "harness-mutants"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Result[pytest.TestReport], None]:
    outcome = yield
    if call.when == "call" and outcome.get_result().skipped:
        item.stash[_skipped_key] = True


def _interrupt_on_sigterm(config: pytest.Config) -> None:
    """SIGTERM (a cancelled CI job) ends the session as Ctrl-C does: tests stop, the pools
    close and every temporary directory goes. Only where nobody else handles SIGTERM."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    try:
        signal.signal(signal.SIGTERM, _sigterm)
    except ValueError:  # not the main thread
        return
    config.add_cleanup(_default_sigterm)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt("SIGTERM")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    registry = config.stash.get(_registry_key, None)
    if registry is not None:
        registry.close()  # no rank process outlives the session, pass, fail or Ctrl-C


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    registry = config.stash[_registry_key]
    if isinstance(registry, LauncherRegistry):
        how = (
            f"launched ranks {registry.default_ranks} (torchrun/srun, in place), "
            f"backend {registry.runner.backend}"
        )
        if registry.runner.rendezvous is not None:
            how += f", rendezvous {registry.runner.rendezvous}"
    else:
        how = (
            f"spatial ranks {registry.default_ranks}, backend gloo, "
            f"start method {registry.start_method}"
        )
        window = registry.deadlock_window
        how += f", deadlock detection {f'after {window:g}s' if window else 'off'}"
        if registry.preload:
            how += f", preload {','.join(registry.preload)}"
    return f"harness: {how}, timeout {registry.timeout:g}s, torch {torch.__version__}"
