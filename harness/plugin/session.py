"""The session's summary: golden outcomes and the equivalence table, gathered over every
xdist worker on the controller; and the unused goldens, listed (and pruned, when asked)
only after a run in which every test ran and passed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast

import pytest

from harness.goldens import (
    GoldenChange,
    GoldenStatus,
    GoldenStore,
    GoldenTally,
    prune_goldens,
    shared_golden,
    unused_goldens,
)
from harness.plugin._keys import _EQUIV_PROP, _GOLDEN_PROP, GoldenRecord, _settings_key
from harness.report import SummaryRow, equivalence_table


class HarnessSession:
    """What the plugin gathers over a session: golden outcomes and equivalence summaries.

    Under xdist it lives on every process; the controller's copy sees every worker's
    results through the reports' user_properties, so its summary counts them all.
    """

    def __init__(
        self, goldens: GoldenStore, *, show_unused: bool = False, prune: bool = False
    ) -> None:
        self.goldens = goldens
        self.show_unused = show_unused
        self.prune = prune
        self.golden_status: dict[str, str] = {}  # golden path -> last status
        self.golden_change: dict[str, GoldenChange] = {}  # golden path -> what a write changed
        self.golden_tests: dict[str, set[str]] = {}  # golden path -> the tests that used it
        self.equivalences: list[SummaryRow] = []
        self.nodeids: set[str] = set()
        self.swept: list[Path] = []  # leftovers of interrupted golden writes, removed
        # what the unused-golden rule needs to know the run was whole
        self.collected: set[str] = set()
        self.deselected = 0
        self.failed: set[str] = set()

    @pytest.hookimpl
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected.update(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        # under xdist the controller collects nothing: each worker says what it collected
        self.collected.update(ids)

    @pytest.hookimpl
    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid or "<collection>")

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.nodeids.add(report.nodeid)
        if report.failed and not hasattr(report, "wasxfail"):
            self.failed.add(report.nodeid)
        if report.when != "call":  # setup and teardown reports repeat the same properties
            return
        for key, value in report.user_properties:  # plain data from the test (or a worker)
            if key == _GOLDEN_PROP:
                path, status, change = cast(GoldenRecord, value)
                self.golden_status[path] = status
                self.golden_tests.setdefault(path, set()).add(report.nodeid)
                if change is not None:
                    self.golden_change[path] = GoldenChange.from_plain(change)
            elif key == _EQUIV_PROP:
                self.equivalences.append(cast(SummaryRow, value))

    @pytest.hookimpl
    def pytest_terminal_summary(
        self, terminalreporter: pytest.TerminalReporter, exitstatus: int
    ) -> None:
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
        # what each write changed, for the reviewer; unchanged goldens are only counted
        for golden in sorted(self.golden_change):
            status = self.golden_status.get(golden)
            if status in (GoldenStatus.WRITTEN, GoldenStatus.UPDATED):
                for line in self.golden_change[golden].lines(golden, status):
                    tr.write_line(line)
        for line in tally.lines(self.goldens.root):
            tr.write_line(line)
        for shared, tests in self.shared_goldens().items():
            tr.write_line(f"ERROR {shared_golden(shared, tests)}", red=True)
        self._unused_summary(tr, tr.config, exitstatus)

    def shared_goldens(self) -> dict[str, set[str]]:
        """Goldens that tests of different ids used (under xdist, on different workers: a
        worker fails the second test that uses one, but sees only its own tests)."""
        return {p: tests for p, tests in sorted(self.golden_tests.items()) if len(tests) > 1}

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # a golden two tests share fails the session, though each test passed on its worker
        if self.shared_goldens() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _unused_summary(
        self, tr: pytest.TerminalReporter, config: pytest.Config, exitstatus: int
    ) -> None:
        """Unused goldens: listed after a whole, passing run (and removed with
        ``--goldens-prune``); after any other run, one line saying why not, if they were
        asked for."""
        settings = config.stash.get(_settings_key, None)
        prune = self.prune or bool(settings and settings.goldens_prune)
        asked = self.show_unused or prune
        why = self.not_whole(config, exitstatus)
        if why:
            if asked:
                tr.write_sep("=", "unused goldens")
                what = "nothing pruned" if prune else "not listed"
                tr.write_line(
                    f"unused goldens {what}: {why}; they are only listed after a run in "
                    "which every test ran and passed."
                )
            return
        unused = self.unused_goldens(config)
        if not unused and not asked:
            return
        tr.write_sep("=", "unused goldens")
        if not unused:
            tr.write_line("every golden file was used by a test of this run.")
            return
        n = len(unused)
        files = f"{n} golden file{'s' if n != 1 else ''}"
        if not prune:
            tr.write_line(f"{files} no test of this run used:")
            for name in unused:
                tr.write_line(f"  {name}")
            tr.write_line(
                "Delete them with --goldens-prune if their tests are gone (or restore the tests)."
            )
            return
        tr.write_line(f"{files} no test of this run used, removed (--goldens-prune):")
        for line in prune_goldens(unused, self.goldens.root):
            tr.write_line(line)
        tr.write_line(f"Commit the removal under {self.goldens.root}.")

    def not_whole(self, config: pytest.Config, exitstatus: int) -> str:
        """Why this run cannot tell which goldens are unused ("" when it can): it did not
        pass, or some test it could have run did not run."""
        if hasattr(config, "workerinput"):
            return "an xdist worker sees only its share of the tests"
        opt = config.option
        for flag, value in (
            ("-k", getattr(opt, "keyword", "")),
            ("-m", getattr(opt, "markexpr", "")),
        ):
            if value:
                return f"the run was partial ({flag} {value!r})"
        for flag, dest in (
            ("--deselect", "deselect"),
            ("--ignore-glob", "ignore_glob"),
            ("--last-failed", "lf"),
            ("--stepwise", "stepwise"),
        ):
            if getattr(opt, dest, None):
                return f"the run was partial ({flag})"
        if self.deselected:
            return f"the run was partial ({self.deselected} tests deselected)"
        ids = [a for a in config.args if "::" in a]
        if ids:
            return (
                f"the run was partial (node ids given: {ids[0]}{', ...' if len(ids) > 1 else ''})"
            )
        if self._scopes(config) is None:
            return "a path it was given lies outside the rootdir"
        if exitstatus != pytest.ExitCode.OK or self.failed:
            failed = len(self.failed)
            if failed:
                return f"the run failed ({failed} test{'s' if failed != 1 else ''} failed)"
            return f"the run did not pass (exit status {int(exitstatus)})"
        missing = self.collected - self.nodeids
        if missing:
            return (
                f"the run stopped early ({len(missing)} of {len(self.collected)} collected "
                "tests did not run: -x, --maxfail or a lost worker)"
            )
        return ""

    def _scopes(self, config: pytest.Config, option: str = "") -> list[str] | None:
        """The paths the run was given (or those of ``option``, e.g. ``--ignore``), relative
        to the rootdir (nodeids are): only the goldens of tests below the paths given, and
        not below the ignored ones, can be judged. ``None``: a path given lies outside the
        rootdir (an ignored one there is no matter: no golden of the run's is there)."""
        base = Path(config.invocation_params.dir)
        root = Path(config.rootpath).resolve()
        scopes = []
        args = (getattr(config.option, option, None) or []) if option else config.args
        for arg in args:
            path = (base / str(arg).split("::", 1)[0]).resolve()
            if path != root and root not in path.parents:
                if option:
                    continue
                return None
            scopes.append(path.relative_to(root).as_posix())
        return scopes

    def unused_goldens(self, config: pytest.Config | None = None) -> list[str]:
        if config is None:
            return unused_goldens(self.goldens.root, self.nodeids)
        ignored = self._scopes(config, "ignore") or []  # never None: see _scopes
        return unused_goldens(self.goldens.root, self.nodeids, self._scopes(config), ignored)


#: the session's ``HarnessSession``, set at configure; beside its type rather than in
#: ``_keys``, which this module imports: so neither imports the other back
_session_key = pytest.StashKey[HarnessSession]()
