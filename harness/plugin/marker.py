"""``@pytest.mark.spatial(ranks=, timeout=, fresh=)`` as the ``spatial`` fixture reads it."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from harness.errors import ConfigError
from harness.pool import MIN_TIMEOUT, check_oversubscription, check_seconds


class MarkerOptions(NamedTuple):
    """A test's rank count, its runs' time limit, and whether its ranks are brand-new."""

    ranks: int
    timeout: float
    fresh: bool


def read_marker(request: pytest.FixtureRequest, ranks: int, timeout: float) -> MarkerOptions:
    """The test's ``@pytest.mark.spatial(ranks=, timeout=, fresh=)``, each checked as the
    command line's options are (the same oversubscription rule for ranks), one clear line
    naming the marker otherwise; ``ranks`` and ``timeout`` (the command line's) where the
    test has no marker or the marker does not say."""
    __tracebackhide__ = True
    marker = request.node.get_closest_marker("spatial")
    if marker is None:
        return MarkerOptions(ranks, timeout, fresh=False)
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
    return MarkerOptions(ranks, timeout, fresh=bool(marker.kwargs.get("fresh", False)))
