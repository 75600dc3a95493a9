"""The session's summary: golden outcomes and the equivalence table, gathered over every
xdist worker on the controller."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.goldens import (
    GoldenStore,
    GoldenTally,
    unused_goldens,
)
from harness.plugin._keys import _EQUIV_PROP, _GOLDEN_PROP
from harness.report import SummaryRow, equivalence_table


class HarnessSession:
    """What the plugin gathers over a session: golden outcomes and equivalence summaries.

    Under xdist it lives on every process; the controller's copy sees every worker's
    results through the reports' user_properties, so its summary counts them all.
    """

    def __init__(self, goldens: GoldenStore, *, show_unused: bool = False) -> None:
        self.goldens = goldens
        self.show_unused = show_unused
        self.golden_status: dict[str, str] = {}  # golden path -> last status
        self.equivalences: list[SummaryRow] = []
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
            calibrated = [r for r in rows if r.get("calibration")]
            if calibrated:
                tr.write_sep("=", "spatial calibration (--spatial-calibrate)")
            for r in calibrated:
                tr.write_line(f"{r.get('test', '')} ({r['case']}, {r['dtype']}):")
                for line in r["calibration"]:
                    tr.write_line(f"  {line}")
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
