"""Repository-level test configuration for the harness's own tests.

The plugin itself (harness.plugin) is loaded through its pytest11 entry point. Here: the
Hypothesis profile this repository's tests run under when none is named, so that plain
``pytest -n auto --spatial-ranks 4`` behaves as CI does (``ci``: 25 derandomized
examples). ``--hypothesis-profile thorough`` (or dev) still overrides it.
"""

from hypothesis import settings

from harness.strategies import register_profiles

register_profiles()
settings.load_profile("ci")

pytest_plugins = ["pytester"]  # tests/plugin drive pytest itself


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "assumes_ranks(n): the test's expected values are written for n ranks (its layouts, "
        "rank lists, group sizes); at another --spatial-ranks it skips, saying so",
    )


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("assumes_ranks")
    if marker is None:
        return
    import pytest

    config = item.config
    ranks = int(config.getoption("spatial_ranks") or config.getini("spatial_ranks") or 4)
    if ranks != marker.args[0]:
        pytest.skip(
            f"written for {marker.args[0]} ranks (its expected values and layouts); this run "
            f"has --spatial-ranks {ranks}: run it with --spatial-ranks {marker.args[0]}"
        )
