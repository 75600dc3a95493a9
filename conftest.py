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
