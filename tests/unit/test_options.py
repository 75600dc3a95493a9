"""The plugin's durations are parsed by one function, each with its own floor and default."""

from __future__ import annotations

import pytest

from harness.plugin.options import parse_seconds
from harness.pool import DEADLOCK_WINDOW, DEFAULT_TIMEOUT, MIN_TIMEOUT


def test_one_parser_gives_each_duration_its_default_floor_and_off_switch():
    assert parse_seconds(None, "--spatial-timeout") == DEFAULT_TIMEOUT
    assert parse_seconds(None, "--spatial-deadlock-window") == DEADLOCK_WINDOW
    assert parse_seconds("0", "--spatial-deadlock-window") == 0.0  # 0: detection off
    assert parse_seconds("2.5", "--spatial-timeout") == 2.5
    with pytest.raises(pytest.UsageError, match=r"--spatial-timeout must be .* >= "):
        parse_seconds("0", "--spatial-timeout")  # a timeout cannot be off
    with pytest.raises(pytest.UsageError, match=r"or 0 \(off\), got 'nan'"):
        parse_seconds("nan", "--spatial-deadlock-window")
    assert MIN_TIMEOUT > 0


def test_flatten_record_still_works_and_says_it_is_deprecated():
    from harness._records.run import RunRecord
    from harness.equivalence import flatten_record

    record = RunRecord()
    with pytest.deprecated_call(match="RunRecord.flat"):
        assert flatten_record(record) == record.flat()
