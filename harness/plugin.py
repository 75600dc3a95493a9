"""The pytest side of the harness: options, marker, fixtures, header and summary.

This is the only module that knows pytest hooks, and nothing imports it: pytest loads it
through the ``pytest11`` entry point. Each hook is thin and hands off to library objects
(``PoolRegistry``, ``GoldenStore``, ``check_equivalence``) that work without pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.errors import ConfigError
from harness.pool import DEFAULT_TIMEOUT, START_METHODS, PoolRegistry

DEFAULT_RANKS = 4

_registry_key = pytest.StashKey[PoolRegistry]()


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
        help=f"per-run timeout before every rank's stack is dumped (default "
        f"{DEFAULT_TIMEOUT:g})",
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


def pytest_configure(config: pytest.Config) -> None:
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
        self, registry: PoolRegistry, node: pytest.Item, ranks: int, timeout: float
    ) -> None:
        self._registry = registry
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
            raise ConfigError(f"@pytest.mark.spatial(ranks=...) must be an integer >= 1, got {ranks!r}")
    yield SpatialFixture(registry, request.node, ranks, timeout)

