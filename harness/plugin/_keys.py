"""What the plugin's parts share through pytest's stash and test reports (the session's
own key, ``_session_key``, lives beside ``HarnessSession`` in ``session``, which reads the keys
here: so neither imports the other back)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the stash keys' types, named in strings
    from harness.plugin.options import Settings  # noqa: F401
    from harness.pool import PoolRegistry  # noqa: F401
    from harness.pool.launcher import LauncherRegistry  # noqa: F401

_registry_key = pytest.StashKey["PoolRegistry | LauncherRegistry"]()
_settings_key = pytest.StashKey["Settings"]()
#: set on an item whose call phase was skipped (pytest.skip, xfail): its unused fixture is no news
_skipped_key = pytest.StashKey[bool]()

# Results travel from xdist workers to the controller as user_properties of test reports.
_GOLDEN_PROP = "harness_golden"
#: a golden check as it travels under ``_GOLDEN_PROP``: (path, status, what a write changed
#: as ``GoldenChange.plain()``, or None)
GoldenRecord = tuple[str, str, dict[str, object] | None]
_EQUIV_PROP = "harness_equivalence"
# --spatial-report's pictures and sweep rows: taken off the reports on the controller
_REPORT_PROP = "harness_report"
