"""Repository-level test configuration: Hypothesis profiles for the harness's own tests.

The plugin itself (harness.plugin) is loaded through its pytest11 entry point, so this file
only holds what is specific to running this repository's tests.
"""

pytest_plugins = ["pytester"]  # tests/plugin drive pytest itself
