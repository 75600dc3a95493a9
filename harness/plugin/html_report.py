"""``--spatial-report PATH``: the session's report as one self-contained HTML page.

Two halves, one plugin object (registered only with the option):

- where a test runs (an xdist worker, or pytest itself): a failing check leaves a way to draw
  its pictures (``defer_figures``); once the test has failed, they are drawn once (the last
  failing check's: a Hypothesis test's shrunk example, not each try on the way) into a
  temporary directory and go to the test report's ``user_properties`` as base64 text, plain
  data that xdist carries; so does each layout sweep's row (``record_sweep``);
- where the session is summed up (xdist's controller, or pytest itself): those are taken
  back off the reports (so JUnit XML does not carry megabytes of pictures), the page is
  rendered by ``harness.report.html`` at session end and written atomically.

A picture that cannot be drawn is a ``Not plotted:`` line on the page, never a failure.
"""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

import pytest

from harness._mutation.mode import current as mutant_mode
from harness.errors import exception_summary
from harness.goldens import GoldenStatus, GoldenTally
from harness.plugin._keys import _REPORT_PROP, _settings_key
from harness.plugin.session import HarnessSession, _session_key
from harness.report.html import FailedTest, Figure, Page, SweepRow, render_page

if TYPE_CHECKING:
    from pluggy import Result

    from harness.layouts import LayoutsReport

#: a failing check's pictures, drawn into the directory given: paths or ``Not plotted:`` lines
Draw = Callable[[str], list[str]]
_pending_key = pytest.StashKey[Draw]()


class PageRecord(TypedDict, total=False):
    """What a test sends the page under ``_REPORT_PROP``, plain (it travels from an xdist
    worker): a failing check's pictures (``draw_plain``), or a sweep's row."""

    figures: list[dict[str, str]]
    sweep: SweepRow


def _wanted(node: pytest.Item) -> bool:
    settings = node.config.stash.get(_settings_key, None)
    # a mutant's rerun says only killed or not: no pictures for it
    return bool(settings and settings.report) and not mutant_mode().verdict_only


def defer_figures(node: pytest.Item, draw: Draw) -> None:
    """A failing check's pictures, drawn only if the test fails (the last one kept)."""
    if _wanted(node):
        node.stash[_pending_key] = draw


def record_sweep(node: pytest.Item, report: LayoutsReport) -> None:
    """A layout sweep's row for the page's summary."""
    if not _wanted(node):
        return
    smallest = report.smallest_failing
    row: SweepRow = {
        "test": node.nodeid,
        "case": report.case,
        "max_ranks": report.max_ranks,
        "passed": len(report.passed),
        "failing": len(report.failing),
        "refused": len(report.refused),
        "smallest": "" if smallest is None else str(smallest),
        "ok": report.ok,
    }
    record: PageRecord = {"sweep": row}
    node.user_properties.append((_REPORT_PROP, record))


def draw_plain(draw: Draw) -> list[dict[str, str]]:
    """``draw``'s pictures as plain data ({caption, png (base64)} or {not_plotted}); the
    temporary directory they were drawn in is gone after."""
    with tempfile.TemporaryDirectory(prefix="spatial-report-") as out:
        try:
            entries = draw(out)
        except Exception as exc:  # noqa: BLE001 - a picture never takes the verdict down
            entries = [f"Not plotted: the check's pictures ({exception_summary(exc)})"]
        figures = []
        for entry in entries:
            if entry.startswith("Not plotted"):
                figures.append({"caption": "", "not_plotted": entry})
                continue
            try:
                png = base64.b64encode(Path(entry).read_bytes()).decode("ascii")
            except OSError as exc:
                figures.append({"caption": "", "not_plotted": f"Not plotted: {entry} ({exc})"})
            else:
                figures.append({"caption": Path(entry).name, "png": png})
    return figures


def _figure(plain: dict[str, str]) -> Figure:
    png = plain.get("png")
    return Figure(
        plain.get("caption", ""),
        None if png is None else base64.b64decode(png),
        plain.get("not_plotted", ""),
    )


def _outcome(report: pytest.TestReport) -> str | None:
    """The test's outcome as pytest's summary counts it; ``None``: this phase says nothing."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if report.skipped:
        return "skipped"
    return "passed" if report.when == "call" else None


class HtmlReport:
    """The page's plugin object: draws on the workers, gathers and writes on the controller."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.controller = not hasattr(config, "workerinput")
        self.outcomes: dict[str, str] = {}
        self.failures: list[FailedTest] = []
        self.figures: dict[str, list[Figure]] = {}
        self.sweeps: list[SweepRow] = []
        self.written = ""  # the terminal's line: where the page is, or why it is not

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Result[pytest.TestReport], None]:
        # before the report is made from the item: the pictures go on its user_properties
        if call.when == "call":
            draw = item.stash.get(_pending_key, None)
            if draw is not None:
                del item.stash[_pending_key]
                if call.excinfo is not None:
                    record: PageRecord = {"figures": draw_plain(draw)}
                    item.user_properties.append((_REPORT_PROP, record))
        yield

    @pytest.hookimpl(tryfirst=True)  # before junitxml: the pictures are not a property
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.controller:  # a worker sends its reports on whole
            return
        kept = []
        for key, value in report.user_properties:  # plain data from the test (or a worker)
            if key != _REPORT_PROP:
                kept.append((key, value))
                continue
            if report.when != "call":  # setup and teardown reports repeat the call's
                continue
            record = cast(PageRecord, value)
            if "figures" in record:
                self.figures.setdefault(report.nodeid, []).extend(map(_figure, record["figures"]))
            elif "sweep" in record:
                self.sweeps.append(record["sweep"])
        report.user_properties[:] = kept
        outcome = _outcome(report)
        if outcome is not None and self.outcomes.get(report.nodeid) not in ("failed", "error"):
            self.outcomes[report.nodeid] = outcome
        if report.failed:
            self.failures.append(FailedTest(report.nodeid, report.when, report.longreprtext))

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if self.controller and report.failed:
            self.outcomes[report.nodeid or "<collection>"] = "error"
            self.failures.append(FailedTest(report.nodeid, "collect", report.longreprtext))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.controller:
            return
        for failure in self.failures:
            if failure.when == "call":
                failure.figures = self.figures.get(failure.nodeid, [])
        page = Page(
            outcomes=self.outcomes,
            exitstatus=int(exitstatus),
            equivalences=[],
            goldens=[],
            sweeps=self.sweeps,
            failures=self.failures,
        )
        harness = self.config.stash.get(_session_key, None)
        if harness is not None:
            page.equivalences = list(harness.equivalences)
            page.goldens = _golden_lines(harness)
        try:
            size = write_atomically(self.path, render_page(page))
        except OSError as exc:
            self.written = f"spatial report NOT written to {self.path}: {exc}"
        else:
            self.written = f"spatial report: {self.path} ({size // 1024} KiB)"

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.written:
            terminalreporter.write_line(self.written)


def _golden_lines(harness: HarnessSession) -> list[str]:
    """The goldens' changes and tally, as the terminal summary says them."""
    lines: list[str] = []
    for golden in sorted(harness.golden_change):
        status = harness.golden_status.get(golden)
        if status in (GoldenStatus.WRITTEN, GoldenStatus.UPDATED):
            lines += harness.golden_change[golden].lines(golden, status)
    tally = GoldenTally.of(harness.golden_status.values())
    lines += tally.lines(harness.goldens.root) if tally.counts else []
    return lines


def write_atomically(path: Path, text: str) -> int:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place: a reader
    (a browser, CI's artifact upload) sees the old page or the new one, never half of one.
    Returns the size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return len(data)
