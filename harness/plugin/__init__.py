"""The pytest side of the harness: options, marker, fixtures, header and summary.

This is the only module that knows pytest hooks, and nothing imports it: pytest loads it
through the ``pytest11`` entry point. Each hook is thin and hands off to library objects
(``PoolRegistry``, ``GoldenStore``, ``check_equivalence``) that work without pytest.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.compare import Bound, Tolerance
from harness.equivalence import SpatialCase, check_equivalence
from harness.errors import ConfigError, GoldenError
from harness.goldens import (
    GoldenResult,
    GoldenStore,
    GoldenTally,
    check_report,
    golden_stem,
    unused_goldens,
)
from harness.launcher import LauncherRegistry, LauncherRunner, WorldSizeMismatch, launcher_env
from harness.plugin_mutants import collect_sites
from harness.pool import (
    DEADLOCK_WINDOW,
    DEFAULT_TIMEOUT,
    MIN_TIMEOUT,
    OVERSUBSCRIBE_LIMIT,
    START_METHODS,
    PoolRegistry,
    RankPool,
    check_oversubscription,
    check_seconds,
)
from harness.report import EquivalenceReport, equivalence_table

DEFAULT_RANKS = 4

_registry_key = pytest.StashKey["PoolRegistry | LauncherRegistry"]()
_session_key = pytest.StashKey["HarnessSession"]()
_stdout_key = pytest.StashKey[Any]()
#: set on an item whose call phase was skipped (pytest.skip, xfail): its unused fixture is no news
_skipped_key = pytest.StashKey[bool]()

# Results travel from xdist workers to the controller as user_properties of test reports.
_GOLDEN_PROP = "harness_golden"
_EQUIV_PROP = "harness_equivalence"


def pytest_addoption(parser: pytest.Parser) -> None:
    # Long on purpose: declarations only, one per option, in the order --help shows them.
    group = parser.getgroup("harness", "spatial equivalence (harness)")
    group.addoption(
        "--spatial-ranks",
        dest="spatial_ranks",
        default=None,
        metavar="N",
        help=f"ranks per partitioned run (integer >= 1; default: ini spatial_ranks or "
        f"{DEFAULT_RANKS})",
    )
    group.addoption(
        "--spatial-timeout",
        dest="spatial_timeout",
        default=None,
        metavar="SECONDS",
        help=f"per-run timeout before every rank's stack is dumped (default {DEFAULT_TIMEOUT:g})",
    )
    group.addoption(
        "--update-goldens",
        action="store_true",
        dest="update_goldens",
        help="write golden files (atomically) instead of comparing with them",
    )
    group.addoption(
        "--spatial-plots",
        dest="spatial_plots",
        default=None,
        metavar="DIR",
        help="write a PNG error map of each failing field to DIR (needs matplotlib)",
    )
    group.addoption(
        "--spatial-deadlock-window",
        dest="spatial_deadlock_window",
        default=None,
        metavar="SECONDS",
        help=f"fail a run as a deadlock once every running rank has waited this long inside "
        f"torch.distributed with nothing completing (default {DEADLOCK_WINDOW:g}; 0: off, "
        "wait for the timeout)",
    )
    group.addoption(
        "--spatial-preload",
        dest="spatial_preload",
        default=None,
        metavar="MODULES",
        help="comma-separated modules the rank processes import once, before any test "
        "(your model package and its heavy dependencies)",
    )
    group.addoption(
        "--spatial-oversubscribe",
        action="store_true",
        dest="spatial_oversubscribe",
        help=f"allow more than {OVERSUBSCRIBE_LIMIT} rank processes per CPU core",
    )
    group.addoption(
        "--spatial-mutants",
        action="store_true",
        dest="spatial_mutants",
        help="after the tests pass, rerun them with bugs injected at each torch.distributed "
        "call site they reach in your code; print which tests kill which mutant, and the score",
    )
    group.addoption(
        "--spatial-mutants-min-score",
        dest="spatial_mutants_min_score",
        default=None,
        metavar="PERCENT",
        help="with --spatial-mutants: fail the session when fewer than PERCENT %% of the "
        "mutants are killed",
    )
    group.addoption(
        "--goldens-unused",
        action="store_true",
        dest="goldens_unused",
        help="list golden files that no test of this run used",
    )
    parser.addini(
        "golden_dir", "directory of .pt golden files (default: goldens)", default="goldens"
    )
    parser.addini("spatial_ranks", f"default for --spatial-ranks ({DEFAULT_RANKS})", default=None)
    parser.addini("spatial_timeout", "default for --spatial-timeout", default=None)
    parser.addini("spatial_deadlock_window", "default for --spatial-deadlock-window", default=None)
    parser.addini(
        "spatial_preload",
        "modules the rank processes import once, before any test (one per line or "
        "comma-separated): default for --spatial-preload",
        type="linelist",
        default=[],
    )
    parser.addini(
        "spatial_start_method",
        f"how rank processes start: one of {', '.join(START_METHODS)} (default forkserver: "
        "torch is imported once and each rank forks from it, ~0.1 s instead of ~6 s)",
        default="forkserver",
    )


def _setting(config: pytest.Config, name: str) -> Any:
    value = config.getoption(name)
    if value is None:
        value = config.getini(name) or None
    return value


def _parse_ranks(raw: Any) -> int:
    if raw is None:
        return DEFAULT_RANKS
    text = str(raw).strip()
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise pytest.UsageError(
        f"--spatial-ranks must be an integer >= 1, got {raw!r}; e.g. --spatial-ranks 4"
    )


def _parse_seconds(raw: Any, option: str, default: float, *, allow_zero: bool = False) -> float:
    """``--spatial-timeout`` and ``--spatial-deadlock-window``: finite seconds, one clear
    line otherwise."""
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if allow_zero and value == 0:
        return 0.0
    low = MIN_TIMEOUT if option == "--spatial-timeout" else 0.05
    if math.isfinite(value) and value >= low:
        return value
    zero = " or 0 (off)" if allow_zero else ""
    raise pytest.UsageError(
        f"{option} must be a finite number of seconds >= {low:g}{zero}, got {raw!r}; "
        f"e.g. {option} {default:g}"
    )


def _parse_timeout(raw: Any) -> float:
    return _parse_seconds(raw, "--spatial-timeout", DEFAULT_TIMEOUT)


def _parse_window(raw: Any) -> float:
    return _parse_seconds(raw, "--spatial-deadlock-window", DEADLOCK_WINDOW, allow_zero=True)


def _parse_preload(config: pytest.Config) -> list[str]:
    """The modules to preload, each checked to exist now (the fork server would silently
    skip one it cannot import)."""
    import importlib.util

    raw = config.getoption("spatial_preload")
    names = raw.split(",") if raw is not None else config.getini("spatial_preload")
    modules = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise pytest.UsageError(
                f"--spatial-preload: no module named {name!r} in this environment; install "
                "it, or check the name (a dotted module path, e.g. my_model.networks)"
            )
    return modules


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
    ranks = _parse_ranks(_setting(config, "spatial_ranks"))
    timeout = _parse_timeout(_setting(config, "spatial_timeout"))
    _interrupt_on_sigterm(config)
    try:
        check_oversubscription(
            ranks,
            allow=config.getoption("spatial_oversubscribe"),
            how="pass --spatial-oversubscribe",
        )
    except ConfigError as exc:
        raise pytest.UsageError(f"--spatial-ranks {ranks}: {exc}") from None
    if config.getoption("spatial_plots"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise pytest.UsageError(
                "--spatial-plots needs matplotlib, which is not installed; "
                'pip install "pytest-spatial-harness[plots]" (or matplotlib), or drop '
                "--spatial-plots"
            ) from None
    start_method = config.getini("spatial_start_method") or "forkserver"
    if start_method not in START_METHODS:
        raise pytest.UsageError(
            f"spatial_start_method must be one of {START_METHODS}, got {start_method!r}"
        )
    env = launcher_env()
    if env is not None and not hasattr(config, "workerinput"):
        config.stash[_registry_key] = _launcher_registry(config, env, timeout)
    else:
        config.stash[_registry_key] = PoolRegistry(
            default_ranks=ranks,
            timeout=timeout,
            start_method=start_method,
            deadlock_window=_parse_window(_setting(config, "spatial_deadlock_window")),
            preload=_parse_preload(config),
        )
    _register_mutants(config)
    root = config.inipath.parent if config.inipath else config.rootpath
    session = HarnessSession(
        GoldenStore(root / config.getini("golden_dir"), update=config.getoption("update_goldens")),
        show_unused=config.getoption("goldens_unused"),
    )
    config.stash[_session_key] = session
    config.pluginmanager.register(session, "harness-session")
    if not hasattr(config, "workerinput"):  # once per session: the controller, not each worker
        session.swept = session.goldens.sweep()


def _register_mutants(config: pytest.Config) -> None:
    """``--spatial-mutants``: the mutation run's plugin object, only when asked for."""
    raw = config.getoption("spatial_mutants_min_score")
    if not config.getoption("spatial_mutants"):
        if raw is not None:
            raise pytest.UsageError(
                "--spatial-mutants-min-score needs --spatial-mutants; add it, or drop the score"
            )
        return
    registry = config.stash[_registry_key]
    if isinstance(registry, LauncherRegistry):
        raise pytest.UsageError(
            "--spatial-mutants injects bugs on the harness's own rank pool, which torchrun/srun "
            "mode does not use; run it without the launcher"
        )
    score = None
    if raw is not None:
        try:
            score = float(raw)
        except ValueError:
            score = math.nan
        if not 0 <= score <= 100:
            raise pytest.UsageError(
                f"--spatial-mutants-min-score must be a percentage from 0 to 100, got {raw!r}; "
                "e.g. --spatial-mutants-min-score 90"
            )
    from harness.plugin_mutants import MutantSession

    config.pluginmanager.register(MutantSession(config, registry, score), "harness-mutants")


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


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _launcher_registry(config: pytest.Config, env: dict[str, int], timeout: float) -> Any:
    """torchrun/srun started this pytest on every rank: run in place, report from rank 0."""
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
    if env["rank"] != 0:
        # Only rank 0 reports. The terminal reporter is made after this hook (we run
        # first) from sys.stdout; give it a sink, then put stdout back for the tests.
        sink = open(os.devnull, "w")  # lives as long as the session
        real, sys.stdout = sys.stdout, sink
        config.add_cleanup(sink.close)
        config.stash[_stdout_key] = real
    return LauncherRegistry(LauncherRunner(timeout=timeout))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    runner = _runner(session.config)
    if runner is None:
        return
    ids = [item.nodeid for item in session.items]
    everyone = runner.gather(ids)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            diff = sorted(set(other) ^ set(everyone[0]))[:5] or ["(same tests, other order)"]
            pytest.exit(
                f"rank {rank} collected other tests than rank 0 under the launcher; every "
                f"rank must run the same tests in the same order. First differences: {diff}",
                returncode=pytest.ExitCode.USAGE_ERROR,
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _runner(config) is None:
        return
    skip = pytest.mark.skip(reason="exercises the rank pool; not under torchrun/srun")
    for item in items:
        if item.get_closest_marker("spatial_pool"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome: Any = yield
    rep = outcome.get_result()
    if call.when == "call" and rep.skipped:
        item.stash[_skipped_key] = True
    runner = _runner(item.config)
    if runner is None:
        return
    # Every rank decides the same verdict: a rank that failed fails the test everywhere, so
    # no rank goes on to a collective that the failed rank will never enter.
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


def _runner(config: pytest.Config) -> LauncherRunner | None:
    registry = config.stash.get(_registry_key, None)
    return registry.runner if isinstance(registry, LauncherRegistry) else None


class HarnessSession:
    """What the plugin gathers over a session: golden outcomes and equivalence summaries.

    Under xdist it lives on every process; the controller's copy sees every worker's
    results through the reports' user_properties, so its summary counts them all.
    """

    def __init__(self, goldens: GoldenStore, *, show_unused: bool = False) -> None:
        self.goldens = goldens
        self.show_unused = show_unused
        self.golden_status: dict[str, str] = {}  # golden path -> last status
        self.equivalences: list[dict[str, Any]] = []
        self.nodeids: set[str] = set()
        self.swept: list[Path] = []  # leftovers of interrupted golden writes, removed

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.nodeids.add(report.nodeid)
        if report.when != "call":  # setup and teardown reports repeat the same properties
            return
        value: Any
        for key, value in report.user_properties:
            if key == _GOLDEN_PROP:
                path, status = value
                self.golden_status[path] = status
            elif key == _EQUIV_PROP:
                self.equivalences.append(value)

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        if self.equivalences:
            tr.write_sep("=", "spatial equivalence")
            # in test order, whichever xdist worker ran which test
            rows = sorted(self.equivalences, key=lambda r: (r.get("test", ""), r["case"]))
            # fitted to a terminal (the partition column shortened), never below 100
            # columns; a log (no terminal, no COLUMNS) gets the whole text
            columns = shutil.get_terminal_size((0, 0)).columns
            width = max(100, columns) if columns else None
            for line in equivalence_table(rows, width=width):
                tr.write_line(line)
        tally = GoldenTally.of(self.golden_status.values())
        if tally.counts or self.swept:
            tr.write_sep("=", "goldens")
        for path in self.swept:
            tr.write_line(
                f"removed {path}: the temporary file of a golden write that was "
                "interrupted (its writer was killed); the golden itself is intact."
            )
        for line in tally.lines(self.goldens.root):
            tr.write_line(line)
        if self.show_unused:
            unused = self.unused_goldens()
            tr.write_sep("=", "unused goldens")
            if unused:
                tr.write_line(f"{len(unused)} golden file(s) no test of this run used:")
                for name in unused:
                    tr.write_line(f"  {name}")
                tr.write_line("Delete them if their tests are gone (run the whole suite first).")
            else:
                tr.write_line("every golden file was used by a test of this run.")

    def unused_goldens(self) -> list[str]:
        return unused_goldens(self.goldens.root, self.nodeids)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    real = session.config.stash.get(_stdout_key, None)
    if real is not None:  # the terminal reporter has its sink by now
        sys.stdout = real
    if _runner(session.config) is not None:
        _same_examples_on_every_rank()


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


class SpatialFixture:
    """What a test sees as ``spatial``: the rank count and a way to run on the ranks."""

    def __init__(
        self,
        registry: PoolRegistry | LauncherRegistry,
        node: pytest.Item,
        ranks: int,
        timeout: float,
        golden: GoldenFixture,
        *,
        fresh: bool = False,
    ) -> None:
        self._registry = registry
        self._golden = golden
        self._node = node
        self.ranks = ranks
        self.timeout = timeout
        self.fresh = fresh
        self._used: dict[int, Any] = {}  # world size -> pool, for fresh tests
        self.used = False  # did the test run anything on the ranks?
        self._tmp: pytest.TempPathFactory | None = None

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: int | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run module-level ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        __tracebackhide__ = True
        pool = self._pool(ranks)
        try:
            results: list[Any] = pool.run(fn, *args, timeout=self._timeout(timeout), **kwargs)
            return results
        finally:
            self._attach_output(pool.last_outputs)
            collect_sites(self._node, pool)

    def check(
        self,
        case: SpatialCase,
        *,
        golden: bool | str = False,
        ranks: int | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """``check_equivalence`` on the warm pool; fail with its table if not equivalent.

        With ``golden=True`` (or a name) the reference's loss, gradients, fields and
        parameters are then checked against this test's golden file.
        """
        __tracebackhide__ = True
        ranks = ranks or self.ranks
        pool = self._pool(ranks)
        try:
            report = check_equivalence(
                case, ranks=ranks, pool=pool, timeout=self._timeout(timeout), **kwargs
            )
        finally:
            self._attach_output(pool.last_outputs)
            collect_sites(self._node, pool)
        row = report.summary_row()
        row["test"] = self._node.nodeid
        if golden:
            name = golden if isinstance(golden, str) else None
            result = self._golden.check_report(
                report,
                name=name,
                allow_nonfinite=kwargs.get("allow_nonfinite") or case.expect_nonfinite,
                provenance={"seed": kwargs.get("seed", 0)},
            )
            row["golden"] = str(result.status)  # plain text: rows travel to the controller
        self._node.user_properties.append((_EQUIV_PROP, row))
        if not report.ok:
            text = str(report)
            plots = self._node.config.getoption("spatial_plots")
            if plots and report.field_errors:
                maps = write_error_maps(report, plots, self._node.nodeid)
                text += "\n\nError maps:\n" + "\n".join(f"  {p}" for p in maps)
            pytest.fail(text, pytrace=False)
        if golden and not result.ok:
            pytest.fail(str(result), pytrace=False)
        return report

    def _timeout(self, timeout: float | None) -> float:
        seconds = timeout or self.timeout
        cap = getattr(self._registry, "timeout_cap", None)  # a mutant rerun
        return min(seconds, cap) if cap else seconds

    def pool(self, ranks: int | None = None) -> Any:
        """The warm ``RankPool`` (or, under torchrun/srun, the in-place runner) for ``ranks``.

        Pass it as ``pool=`` to ``check_equivalence`` to get the report without failing.
        """
        return self._pool(ranks)

    @property
    def launcher(self) -> bool:
        """True when pytest runs under torchrun or srun (functions run in place)."""
        return isinstance(self._registry, LauncherRegistry)

    def _pool(self, ranks: int | None) -> Any:
        self.used = True
        size = ranks or self.ranks
        try:
            pool = self._registry.get(size)
        except WorldSizeMismatch as exc:
            pytest.skip(f"{exc} (run it without torchrun/srun, or with that many ranks)")
        if self.fresh and size not in self._used and isinstance(pool, RankPool):
            pool.discard()  # brand-new rank processes: no module globals of earlier tests
            self._used[size] = pool
        return pool

    def discard_used(self) -> None:
        """After a fresh test: its rank processes go with it."""
        for pool in self._used.values():
            pool.discard()
        self._used.clear()

    def _attach_output(self, outputs: list[str]) -> None:
        """What each rank printed, as a report section; long output is cut to its first and
        last lines, and the whole of it saved to a file that the section names."""
        self.used = True
        for rank, text in enumerate(outputs):
            if not text.strip():
                continue
            if len(text) > OUTPUT_LIMIT:
                path = (
                    self._output_dir() / f"{golden_stem(self._node.nodeid).replace('/', '.')}"
                    f".rank{rank}.txt"
                )
                path.write_text(text)
                text = _cut(text, path)
            self._node.add_report_section("call", f"rank {rank} stdout", text)

    def _output_dir(self) -> Path:
        assert self._tmp is not None
        path = self._tmp.getbasetemp() / "spatial-output"
        path.mkdir(parents=True, exist_ok=True)
        return path


#: Rank output longer than this (characters) is cut in the report; the whole is saved.
OUTPUT_LIMIT = 8000


def _cut(text: str, path: Path) -> str:
    """The head and tail of a long output, and where the whole of it is."""
    head, tail = text[: OUTPUT_LIMIT // 4], text[-(OUTPUT_LIMIT * 3 // 4) :]
    left_out = len(text) - len(head) - len(tail)
    return (
        f"{head}\n... {left_out} characters left out; the whole output ({len(text)} "
        f"characters) is in {path} ...\n{tail}"
    )


class SpatialUnusedWarning(pytest.PytestWarning):
    """A test asked for the ``spatial`` fixture but never ran anything on the ranks."""


def _marker_options(
    request: pytest.FixtureRequest, marker: pytest.Mark, ranks: int, timeout: float
) -> tuple[int, float, bool]:
    """``@pytest.mark.spatial(ranks=, timeout=, fresh=)``, each checked as the command
    line's options are (the same oversubscription rule for ranks); one clear line naming
    the marker otherwise."""
    __tracebackhide__ = True
    unknown = set(marker.kwargs) - {"ranks", "timeout", "fresh"}
    if unknown:
        pytest.fail(
            f"@pytest.mark.spatial got unknown option(s) {sorted(unknown)}; it takes ranks=, "
            "timeout= and fresh=",
            pytrace=False,
        )
    raw = marker.kwargs.get("ranks", marker.args[0] if marker.args else None)
    if raw is not None:
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            pytest.fail(
                f"@pytest.mark.spatial(ranks={raw!r}): ranks must be an integer >= 1, e.g. ranks=4",
                pytrace=False,
            )
        try:
            check_oversubscription(
                raw,
                allow=request.config.getoption("spatial_oversubscribe"),
                how="pass --spatial-oversubscribe",
            )
        except ConfigError as exc:
            pytest.fail(f"@pytest.mark.spatial(ranks={raw}): {exc}", pytrace=False)
        ranks = raw
    raw_timeout = marker.kwargs.get("timeout")
    if raw_timeout is not None:
        try:
            timeout = check_seconds(raw_timeout, "timeout", minimum=MIN_TIMEOUT)
        except ConfigError as exc:
            pytest.fail(f"@pytest.mark.spatial(timeout={raw_timeout!r}): {exc}", pytrace=False)
    return ranks, timeout, bool(marker.kwargs.get("fresh", False))


@pytest.fixture
def spatial(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpatialFixture]:
    """Run functions on a warm group of gloo ranks: ``spatial.run(fn, *args)``."""
    registry = request.config.stash[_registry_key]
    marker = request.node.get_closest_marker("spatial")
    ranks = registry.default_ranks
    timeout = registry.timeout
    fresh = False
    if marker is not None:
        ranks, timeout, fresh = _marker_options(request, marker, ranks, timeout)
    if fresh and isinstance(registry, LauncherRegistry):
        pytest.skip(
            "spatial(fresh=True) needs brand-new rank processes; under torchrun/srun "
            "the ranks are the launcher's"
        )
    fixture = SpatialFixture(
        registry, request.node, ranks, timeout, _golden_fixture(request), fresh=fresh
    )
    fixture._tmp = tmp_path_factory
    yield fixture
    fixture.discard_used()  # a fresh test's module globals stay with it
    # a test that skipped itself (pytest.skip before the ranks, an xfail) ran nothing on purpose
    if not fixture.used and not request.node.stash.get(_skipped_key, False):
        request.node.warn(
            SpatialUnusedWarning(
                "this test takes the spatial fixture but never ran anything on the ranks (no "
                "spatial.run, spatial.check or spatial.pool): it checked nothing partitioned. "
                "Call spatial.check(case), or drop the fixture."
            )
        )


class GoldenFixture:
    """What a test sees as ``golden``: ``golden.check(tensors, name=None, tolerance=None)``."""

    def __init__(self, store: GoldenStore, node: pytest.Item) -> None:
        self._store = store
        self._node = node

    def check(
        self,
        tensors: dict[str, Any],
        *,
        name: str | None = None,
        tolerance: Bound | tuple[float, float] | None = None,
        allow_nonfinite: bool = False,
    ) -> GoldenResult:
        """Compare ``tensors`` ({name: tensor}) with this test's golden; fail if they differ.

        ``tolerance`` is a ``Bound`` or ``(rtol, atol)``; the default is the field tolerance
        of the tensors' dtype (``Tolerance.for_dtype``). A NaN or inf on either side fails
        (and is never written) unless ``allow_nonfinite``.
        """
        __tracebackhide__ = True
        if not tensors:
            raise ConfigError("golden.check needs at least one tensor")
        if tolerance is None:
            bound = Tolerance.for_dtype(next(iter(tensors.values())).dtype).field
        else:
            bound = tolerance if isinstance(tolerance, Bound) else Bound(*tolerance)
        result = self.check_tensors(
            tensors, name=name, bound=bound, allow_nonfinite=allow_nonfinite
        )
        if not result.ok:
            pytest.fail(str(result), pytrace=False)
        return result

    def check_tensors(
        self,
        tensors: dict[str, Any],
        *,
        name: str | None,
        bound: Bound,
        provenance: dict[str, Any] | None = None,
        refuse_update: str | None = None,
        allow_nonfinite: bool = False,
    ) -> GoldenResult:
        __tracebackhide__ = True
        path = self._store.path_for(self._node.nodeid, name)
        if refuse_update and self._store.update:
            result = self._store.not_updated(path, refuse_update)
        else:
            try:
                result = self._store.check(
                    path,
                    tensors,
                    bound=bound,
                    provenance=provenance,
                    allow_nonfinite=allow_nonfinite,
                )
            except GoldenError as exc:  # corrupt, foreign, a directory, a full disk
                pytest.fail(str(exc), pytrace=False)
        self._record(path, result)
        return result

    def check_report(
        self,
        report: EquivalenceReport,
        *,
        name: str | None,
        allow_nonfinite: bool,
        provenance: dict[str, Any],
    ) -> GoldenResult:
        """``report``'s reference against this test's golden, by the one golden policy
        (``harness.goldens.check_report``)."""
        __tracebackhide__ = True
        path = self._store.path_for(self._node.nodeid, name)
        try:
            result = check_report(
                self._store, path, report, provenance=provenance, allow_nonfinite=allow_nonfinite
            )
        except GoldenError as exc:  # corrupt, foreign, a directory, a full disk
            pytest.fail(str(exc), pytrace=False)
        self._record(path, result)
        return result

    def _record(self, path: Path, result: GoldenResult) -> None:
        # plain text: user properties travel to xdist's controller
        self._node.user_properties.append((_GOLDEN_PROP, (str(path), str(result.status))))


def write_error_maps(report: Any, directory: str, nodeid: str) -> list[str]:
    """One PNG per failing field of ``report`` under ``directory``; returns the paths."""
    import numpy as np

    from harness import plots

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = golden_stem(nodeid).replace("/", ".")
    paths = []
    for fe in report.field_errors:
        owners = fe.owners.numpy()
        first = int(owners.min()) if owners.size else 0
        title = f"{report.case}: |partitioned - reference| of {fe.name!r}, step {fe.step}"
        path = out / f"{stem}.{fe.name}.step{fe.step}.png"
        err = fe.error.numpy()
        if fe.grid is not None:
            rows, cols = fe.grid
            grid = owners.reshape(rows, cols)
            paths.append(
                str(
                    plots.plot_latlon_error(
                        err.reshape(rows, cols),
                        path,
                        lat_sizes=_run_lengths(grid[:, 0]),
                        lon_sizes=_run_lengths(grid[0, :]),
                        title=title,
                        latitudes=report.latitudes,
                    )
                )
            )
        elif fe.unit == "cell":
            counts = np.bincount(owners - first, minlength=report.spatial_size)
            bounds = [0, *np.cumsum(counts).tolist()]
            paths.append(str(plots.plot_healpix_error(err, path, bounds=bounds, title=title)))
    return paths


def _run_lengths(values: Any) -> list[int]:
    """Lengths of the runs of equal values: ``[0, 0, 1, 1, 1] -> [2, 3]``."""
    lengths: list[int] = []
    for i, v in enumerate(values):
        if i and v == values[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def _golden_fixture(request: pytest.FixtureRequest) -> GoldenFixture:
    return GoldenFixture(request.config.stash[_session_key].goldens, request.node)


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> GoldenFixture:
    """Check tensors against this test's ``.pt`` golden: ``golden.check({"loss": t})``."""
    return _golden_fixture(request)
