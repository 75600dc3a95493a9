"""The pytest side of the harness: options, marker, fixtures, header and summary.

This is the only module that knows pytest hooks, and nothing imports it: pytest loads it
through the ``pytest11`` entry point. Each hook is thin and hands off to library objects
(``PoolRegistry``, ``GoldenStore``, ``check_equivalence``) that work without pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.compare import Bound, Tolerance, equivalence_table
from harness.equivalence import SpatialCase, check_equivalence
from harness.errors import ConfigError
from harness.goldens import GoldenResult, GoldenStore, golden_stem
from harness.pool import DEFAULT_TIMEOUT, START_METHODS, PoolRegistry

DEFAULT_RANKS = 4

_registry_key = pytest.StashKey[PoolRegistry]()
_session_key = pytest.StashKey["HarnessSession"]()

# Results travel from xdist workers to the controller as user_properties of test reports.
_GOLDEN_PROP = "harness_golden"
_EQUIV_PROP = "harness_equivalence"


def pytest_addoption(parser: pytest.Parser) -> None:
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


def _parse_timeout(raw: Any) -> float:
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if timeout > 0:
        return timeout
    raise pytest.UsageError(
        f"--spatial-timeout must be a positive number of seconds, got {raw!r}; "
        "e.g. --spatial-timeout 120"
    )


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' plugin loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    from harness.strategies import register_profiles

    register_profiles()
    config.addinivalue_line(
        "markers",
        "spatial(ranks=None, timeout=None): run this test's spatial jobs on `ranks` rank "
        "processes (default --spatial-ranks) with a per-run `timeout` in seconds.",
    )
    ranks = _parse_ranks(_setting(config, "spatial_ranks"))
    timeout = _parse_timeout(_setting(config, "spatial_timeout"))
    start_method = config.getini("spatial_start_method") or "forkserver"
    if start_method not in START_METHODS:
        raise pytest.UsageError(
            f"spatial_start_method must be one of {START_METHODS}, got {start_method!r}"
        )
    config.stash[_registry_key] = PoolRegistry(
        default_ranks=ranks, timeout=timeout, start_method=start_method
    )
    root = config.inipath.parent if config.inipath else config.rootpath
    session = HarnessSession(
        GoldenStore(root / config.getini("golden_dir"), update=config.getoption("update_goldens")),
        show_unused=config.getoption("goldens_unused"),
    )
    config.stash[_session_key] = session
    config.pluginmanager.register(session, "harness-session")


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

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.nodeids.add(report.nodeid)
        if report.when != "call":  # setup and teardown reports repeat the same properties
            return
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
            for line in equivalence_table(self.equivalences):
                tr.write_line(line)
        counts: dict[str, int] = {}
        for status in self.golden_status.values():
            counts[status] = counts.get(status, 0) + 1
        if counts:
            order = ["written", "updated", "unchanged", "passed", "failed", "missing"]
            text = ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))
            tr.write_sep("=", "goldens")
            n = sum(counts.values())
            tr.write_line(f"{n} golden{'s' if n != 1 else ''}: {text}.")
            if counts.get("written") or counts.get("updated"):
                tr.write_line(f"Review and commit the changes under {self.goldens.root}.")
            elif counts.get("missing") or counts.get("failed"):
                tr.write_line("Run with --update-goldens if the change is intended.")
        if self.show_unused:
            unused = self.unused_goldens()
            tr.write_sep("=", "unused goldens")
            if unused:
                tr.write_line(f"{len(unused)} golden file(s) no test of this run used:")
                for path in unused:
                    tr.write_line(f"  {path}")
                tr.write_line("Delete them if their tests are gone (run the whole suite first).")
            else:
                tr.write_line("every golden file was used by a test of this run.")

    def unused_goldens(self) -> list[str]:
        root = self.goldens.root
        if not root.is_dir():
            return []
        used = {golden_stem(n) for n in self.nodeids}
        unused = []
        for path in sorted(root.rglob("*.pt")):
            stem = path.relative_to(root).as_posix()[:-3]
            base = stem.split("].", 1)[0] + "]" if "]." in stem else stem.rsplit(".", 1)[0]
            if (
                stem not in used
                and base not in used
                and not any(stem.startswith(u + ".") for u in used)
            ):
                unused.append(str(path))
        return unused


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    registry = config.stash.get(_registry_key, None)
    if registry is not None:
        registry.close()  # no rank process outlives the session, pass, fail or Ctrl-C


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    registry = config.stash[_registry_key]
    return (
        f"harness: spatial ranks {registry.default_ranks}, backend gloo, "
        f"start method {registry.start_method}, timeout {registry.timeout:g}s, "
        f"torch {torch.__version__}"
    )


class SpatialFixture:
    """What a test sees as ``spatial``: the rank count and a way to run on the ranks."""

    def __init__(
        self,
        registry: PoolRegistry,
        node: pytest.Item,
        ranks: int,
        timeout: float,
        golden: GoldenFixture,
    ) -> None:
        self._registry = registry
        self._golden = golden
        self._node = node
        self.ranks = ranks
        self.timeout = timeout

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
        pool = self._registry.get(ranks or self.ranks)
        try:
            return pool.run(fn, *args, timeout=timeout or self.timeout, **kwargs)
        finally:
            self._attach_output(pool.last_outputs)

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
        pool = self._registry.get(ranks)
        try:
            report = check_equivalence(
                case, ranks=ranks, pool=pool, timeout=timeout or self.timeout, **kwargs
            )
        finally:
            self._attach_output(pool.last_outputs)
        row = report.summary_row()
        row["test"] = self._node.nodeid
        if golden:
            name = golden if isinstance(golden, str) else None
            dtype = next(iter(report.reference.values())).dtype
            result = self._golden.check_tensors(
                report.reference,
                name=name,
                bound=Tolerance.for_dtype(dtype).field,
                provenance={
                    "case": report.case,
                    "ranks": report.ranks,
                    "spatial_size": report.spatial_size,
                    "partition": report.partition,
                    "dtype": report.dtype,
                    "steps": report.steps,
                    "seed": kwargs.get("seed", 0),
                },
            )
            row["golden"] = result.status
        self._node.user_properties.append((_EQUIV_PROP, row))
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        if golden and not result.ok:
            pytest.fail(str(result), pytrace=False)
        return report

    def _attach_output(self, outputs: list[str]) -> None:
        for rank, text in enumerate(outputs):
            if text.strip():
                self._node.add_report_section("call", f"rank {rank} stdout", text)


@pytest.fixture
def spatial(request: pytest.FixtureRequest) -> Iterator[SpatialFixture]:
    """Run functions on a warm group of gloo ranks: ``spatial.run(fn, *args)``."""
    registry = request.config.stash[_registry_key]
    marker = request.node.get_closest_marker("spatial")
    ranks = registry.default_ranks
    timeout = registry.timeout
    if marker is not None:
        ranks = marker.kwargs.get("ranks") or (marker.args[0] if marker.args else ranks)
        timeout = marker.kwargs.get("timeout") or timeout
        if not isinstance(ranks, int) or ranks < 1:
            raise ConfigError(
                f"@pytest.mark.spatial(ranks=...) must be an integer >= 1, got {ranks!r}"
            )
    yield SpatialFixture(registry, request.node, ranks, timeout, _golden_fixture(request))


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
    ) -> GoldenResult:
        """Compare ``tensors`` ({name: tensor}) with this test's golden; fail if they differ.

        ``tolerance`` is a ``Bound`` or ``(rtol, atol)``; the default is the field tolerance
        of the tensors' dtype (``Tolerance.for_dtype``).
        """
        __tracebackhide__ = True
        if not tensors:
            raise ConfigError("golden.check needs at least one tensor")
        if tolerance is None:
            bound = Tolerance.for_dtype(next(iter(tensors.values())).dtype).field
        else:
            bound = tolerance if isinstance(tolerance, Bound) else Bound(*tolerance)
        result = self.check_tensors(tensors, name=name, bound=bound)
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
    ) -> GoldenResult:
        path = self._store.path_for(self._node.nodeid, name)
        result = self._store.check(path, tensors, bound=bound, provenance=provenance)
        self._node.user_properties.append((_GOLDEN_PROP, (str(path), result.status)))
        return result


def _golden_fixture(request: pytest.FixtureRequest) -> GoldenFixture:
    return GoldenFixture(request.config.stash[_session_key].goldens, request.node)


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> GoldenFixture:
    """Check tensors against this test's ``.pt`` golden: ``golden.check({"loss": t})``."""
    return _golden_fixture(request)
