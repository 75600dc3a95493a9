"""Where CI users look: GitHub Actions annotations and job summary, and JUnit XML properties.

- **Annotations.** Under GitHub Actions (``GITHUB_ACTIONS=true``, or ``--spatial-github=on``)
  a failing check prints an ``::error file=...,line=...`` workflow command at the line in
  the user's code its evidence names (``harness.report.sites``: the diverging module's
  ``forward``, the line that issued a deadlocked collective, a raising rank's frame) and one
  at the test's line that ran the check; paths relative to the repository
  (``GITHUB_WORKSPACE``, else pytest's rootdir).
- **Job summary.** At the end of the session the controller appends Markdown to
  ``$GITHUB_STEP_SUMMARY``: the equivalence table, the goldens' tally and changes, the
  layout sweeps' smallest failing layouts and the mutation score.
- **JUnit.** Every check records readable ``spatial.*`` properties (case, layout, verdict,
  quantity, step, worst error, first divergence) on its test, which ``--junitxml`` writes;
  the harness's own plain-data properties (rows that travel to the xdist controller) are
  kept out of the XML, where they would read as Python reprs.

What a check found reaches the controller as plain data in ``report.user_properties``
(``_EQUIV_PROP`` rows, ``_SWEEP_PROP`` sweeps), as the session's summary does.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

import pytest

from harness.compare import NUMERIC
from harness.errors import exception_summary
from harness.plugin._keys import _EQUIV_PROP, _GOLDEN_PROP
from harness.plugin.options import GITHUB_MODES
from harness.report import SummaryRow
from harness.report.sites import failure_sites

if TYPE_CHECKING:
    from harness.case import SpatialCase
    from harness.layouts import Layout, LayoutsReport
    from harness.plugin.session import HarnessSession
    from harness.report import EquivalenceReport

#: a layout sweep (``spatial.check_layouts``), as plain data, for the job summary
_SWEEP_PROP = "harness_sweep"


class SweepRecord(TypedDict):
    """A layout sweep as the job summary and its annotations read it: plain data, so it
    travels from an xdist worker to the controller in the test report's properties."""

    test: str
    case: str
    layouts: int  # run (not refused by the case)
    failing: int
    smallest: str  # the smallest failing layout, "" when none failed
    call_site: list[object]  # [file, line] of the test's line that ran the sweep
    #: the smallest failing layout's lines in the user's code (``harness.report.sites.Site``)
    sites: NotRequired[list[dict[str, Any]]]
    problems: NotRequired[list[str]]


#: a failing check's row or a failing sweep: what an annotation points from
Failure = SummaryRow | SweepRecord

#: the harness's plain-data properties, kept out of JUnit XML (``spatial.*`` say them there)
_PLAIN_PROPS = frozenset({_EQUIV_PROP, _GOLDEN_PROP, _SWEEP_PROP})
#: at most this many lines of a failure's text in the annotation at the test's line
TEST_LINES = 20


def enabled(config: pytest.Config) -> bool:
    """Annotate and summarise for GitHub Actions in this session?"""
    mode = config.getoption("spatial_github", None) or config.getini("spatial_github") or "auto"
    if mode not in GITHUB_MODES:
        raise pytest.UsageError(
            f"spatial_github must be one of {', '.join(GITHUB_MODES)}, got {mode!r}"
        )
    return mode == "on" or (mode == "auto" and os.environ.get("GITHUB_ACTIONS") == "true")


def register(config: pytest.Config) -> None:
    """The plugin objects of this module: JUnit's always, GitHub's where ``enabled``."""
    config.pluginmanager.register(JunitProperties(config), "harness-junit")
    if enabled(config) and not hasattr(config, "workerinput"):  # the controller speaks
        config.pluginmanager.register(GithubSession(config), "harness-github")


# ---------------------------------------------------------------------- recording a check


def check_places(node: pytest.Item, report: EquivalenceReport, case: SpatialCase) -> SummaryRow:
    """A check's row's places: the user's lines its failure points at (``sites``, none when
    it passed) and the test's line that ran it (``call_site``)."""
    places: SummaryRow = {} if report.ok else {"sites": _sites(report, case)}
    places["call_site"] = call_site(node)
    return places


def record_sweep(node: pytest.Item, report: LayoutsReport, case: SpatialCase) -> None:
    """A layout sweep's outcome, plain, for the job summary (and its annotations)."""
    smallest, failed = report.smallest_failing, report.smallest_report
    sweep: SweepRecord = {
        "test": node.nodeid,
        "case": report.case,
        "layouts": len(report.passed) + len(report.failing),  # run (not refused by the case)
        "failing": len(report.failing),
        "smallest": "" if smallest is None else _layout_text(smallest),
        "call_site": call_site(node),
    }
    if failed is not None:
        sweep["sites"] = _sites(failed, case)
        sweep["problems"] = sorted(failed.quantities)
    node.user_properties.append((_SWEEP_PROP, sweep))
    node.user_properties.append(
        ("spatial.layouts", f"{sweep['failing']} of {sweep['layouts']} fail")
    )
    if smallest is not None:
        node.user_properties.append(("spatial.smallest_failing_layout", sweep["smallest"]))


def _layout_text(layout: Layout) -> str:
    """``"2 ranks, grid 2x1 uneven, 1 data group"``."""
    groups = f"{layout.data_size} data group{'s' if layout.data_size != 1 else ''}"
    return f"{layout.world_size} ranks, grid {layout.row}, {groups}"


def _sites(report: EquivalenceReport, case: SpatialCase) -> list[dict[str, Any]]:
    """``failure_sites`` as plain dicts; a diagnosis that fails is said, never raised (the
    annotation falls back to the test's line, and says why)."""
    try:
        return [dict(site) for site in failure_sites(report, case)]
    except Exception as exc:  # noqa: BLE001 - a diagnosis never takes the verdict down
        return [{"file": "", "line": 0, "title": "Not located", "message": exception_summary(exc)}]


def call_site(node: pytest.Item) -> list[object]:
    """``[file, line]`` of the test's line that is running the check: the innermost frame
    in the test's own file (the test's first line where none is on the stack)."""
    path = str(getattr(node, "path", ""))
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == path:
            return [path, frame.f_lineno]
        frame = frame.f_back
    fspath, line, _ = node.location
    return [str(node.config.rootpath / fspath), (line or 0) + 1]


def junit_properties(report: EquivalenceReport, row: SummaryRow) -> list[tuple[str, str]]:
    """The check's ``spatial.*`` properties: what a JUnit viewer shows of it."""
    worst = [(q, v) for q, v in row["worst"].items() if v is not None]
    props = [
        ("spatial.case", report.case),
        ("spatial.layout", _check_layout(report)),
        ("spatial.dtype", report.dtype),
        ("spatial.verdict", "equivalent" if report.ok else "mismatch"),
    ]
    if worst:
        q, v = max(worst, key=lambda w: w[1])
        props.append(("spatial.worst_error", f"{q} {v:.2e} (relative)"))
    if not report.ok:
        first = report.mismatches[0]
        from harness.report import step_cell

        props += [
            ("spatial.quantity", ", ".join(sorted(report.quantities))),
            ("spatial.step", step_cell(first)),
            ("spatial.first", first.headline()),
        ]
    if report.first_divergence is not None:
        props.append(("spatial.first_divergence", report.first_divergence.located))
    for site in row.get("sites", []):
        if site["file"]:
            props.append(("spatial.site", f"{site['file']}:{site['line']}"))
    return props


def _check_layout(report: EquivalenceReport) -> str:
    """``"4 ranks (spatial 2, 37 positions)"``: as the report's first line says it."""
    layout = f"spatial {report.spatial_size}"
    if report.partition and report.partition != layout:
        layout += f", {report.partition}"
    return f"{report.ranks} ranks ({layout})"


class JunitProperties:
    """Keeps the harness's plain-data properties out of ``--junitxml`` (which writes each
    user property's ``str``): its ``spatial.*`` properties say the same, readably."""

    def __init__(self, config: pytest.Config) -> None:
        self.active = bool(getattr(config.option, "xmlpath", None)) and not hasattr(
            config, "workerinput"
        )

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, None, None]:
        # junitxml writes the properties of the teardown report; the summaries read the
        # call report's, which is left as it is
        if not self.active or report.when != "teardown":
            return (yield)
        kept = report.user_properties
        report.user_properties = [(k, v) for k, v in kept if k not in _PLAIN_PROPS]
        try:
            return (yield)
        finally:
            report.user_properties = kept


# ---------------------------------------------------------------------- GitHub Actions


def escape_data(text: str) -> str:
    """A workflow command's message, escaped as GitHub's toolkit does.

    >>> escape_data("50% off\\nnext")
    '50%25 off%0Anext'
    """
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value (file, title), escaped as GitHub's toolkit does.

    >>> escape_property("a: b, c")
    'a%3A b%2C c'
    """
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(message: str, *, file: str = "", line: int = 0, title: str = "") -> str:
    """One ``::error`` workflow command (``file``: relative to the repository; ``""``: none).

    >>> annotation("x\\ny", file="m.py", line=3, title="t: 1")
    '::error file=m.py,line=3,title=t%3A 1::x%0Ay'
    """
    props = []
    if file:
        props += [f"file={escape_property(file)}", f"line={int(line)}"]
    if title:
        props.append(f"title={escape_property(title)}")
    head = f"::error {','.join(props)}" if props else "::error"
    return f"{head}::{escape_data(message)}"


class GithubSession:
    """The controller's GitHub Actions output: annotations, gathered from every test report
    (any xdist worker's), printed with the terminal summary; the job summary written at the
    session's end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        workspace = os.environ.get("GITHUB_WORKSPACE")
        self.root = Path(workspace).resolve() if workspace else config.rootpath.resolve()
        self.annotations: list[str] = []
        self.sweeps: list[SweepRecord] = []

    def relative(self, path: str) -> str:
        """``path`` relative to the repository, ``""`` when it lies outside it."""
        try:
            return Path(path).resolve().relative_to(self.root).as_posix()
        except ValueError:
            return ""

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        found: list[Failure] = []  # failing checks and sweeps of this test
        for key, value in report.user_properties:  # plain data from the test (or a worker)
            if key == _SWEEP_PROP:
                sweep = cast(SweepRecord, value)
                self.sweeps.append(sweep)
                if sweep["failing"]:
                    found.append(sweep)
            elif key == _EQUIV_PROP and not cast(SummaryRow, value)["ok"]:
                found.append(cast(SummaryRow, value))
        if report.failed and found:
            self._annotate(report, found)

    def _annotate(self, report: pytest.TestReport, found: list[Failure]) -> None:
        """The failure's lines in the user's code first, then the test's own line."""
        for value in found:
            for site in value.get("sites", []):
                self.annotations.append(
                    annotation(
                        site["message"],
                        file=self.relative(site["file"]) if site["file"] else "",
                        line=site["line"],
                        title=site["title"],
                    )
                )
        path, line = cast(tuple[str, int], found[0]["call_site"])
        text = report.longreprtext.strip().splitlines()
        if text and re.match(r"\[gw\d+\] ", text[0]):  # xdist's "[gw1] linux -- Python ..."
            text = text[1:]
        more = (
            [f"... {len(text) - TEST_LINES} more lines in the log"]
            if len(text) > TEST_LINES
            else []
        )
        self.annotations.append(
            annotation(
                "\n".join(text[:TEST_LINES] + more),
                file=self.relative(path),
                line=line,
                title=f"{report.nodeid} failed",
            )
        )

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.annotations:
            return
        terminalreporter.write_sep("=", "spatial annotations (GitHub Actions)")
        for line in self.annotations:
            terminalreporter.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        target = os.environ.get("GITHUB_STEP_SUMMARY")
        if not target:
            return
        from harness.plugin.session import _session_key

        harness: HarnessSession | None = self.config.stash.get(_session_key, None)
        text = job_summary(self, harness, self.config.pluginmanager.get_plugin("harness-mutants"))
        with open(target, "a", encoding="utf-8") as out:
            out.write(text)


# ---------------------------------------------------------------------- the job summary


def job_summary(gh: GithubSession, harness: HarnessSession | None, mutants: object) -> str:
    """The session in Markdown: the equivalence table, the sweeps, the goldens, the
    mutation score (each where it has something to say)."""
    lines = ["## Spatial equivalence", ""]
    rows = (
        sorted(harness.equivalences, key=lambda r: (r.get("test", ""), r["case"]))
        if harness
        else []
    )
    if rows:
        good = sum(1 for r in rows if r["ok"])
        lines += [
            f"{len(rows)} check{'s' if len(rows) != 1 else ''}: {good} equivalent, "
            f"{len(rows) - good} mismatched.",
            "",
        ]
        lines += markdown_table(
            ("test", "case", "ranks", "partition", "dtype", *NUMERIC, "golden", "verdict", "where"),
            [_row_cells(gh, r) for r in rows],
        )
    else:
        lines.append("No spatial check ran.")
    if gh.sweeps:
        lines += ["", "### Layout sweeps", ""]
        lines += markdown_table(
            ("test", "case", "layouts", "smallest failing layout", "where"),
            [
                (
                    s["test"],
                    s["case"],
                    f"{s['failing']} of {s['layouts']} fail",
                    s["smallest"] or "-",
                    _where(gh, s),
                )
                for s in sorted(gh.sweeps, key=lambda s: s["test"])
            ],
        )
    if harness is not None:
        lines += _golden_lines(harness)
    lines += _mutant_lines(mutants)
    return "\n".join(lines) + "\n"


def _row_cells(gh: GithubSession, r: SummaryRow) -> tuple[str, ...]:
    w = r["worst"]
    verdict = "equivalent" if r["ok"] else "**MISMATCH**: " + ", ".join(r["problems"])
    return (
        r.get("test", ""),
        r["case"],
        str(r["ranks"]),
        r["partition"],
        r["dtype"],
        *("-" if w.get(q) is None else f"{w[q]:.1e}" for q in NUMERIC),
        r.get("golden", "-"),
        verdict,
        _where(gh, r),
    )


def _where(gh: GithubSession, value: Failure) -> str:
    """The first user line a failure points at, linked to the commit on GitHub when the
    job says which (``GITHUB_REPOSITORY``, ``GITHUB_SHA``)."""
    site = next((s for s in value.get("sites", []) if s["file"]), None)
    if site is None:
        return "-"
    path = gh.relative(site["file"]) or os.path.basename(site["file"])
    text = f"{path}:{site['line']}"
    repo, sha = os.environ.get("GITHUB_REPOSITORY"), os.environ.get("GITHUB_SHA")
    if repo and sha and gh.relative(site["file"]):
        server = os.environ.get("GITHUB_SERVER_URL", "https://github.com")
        return f"[`{text}`]({server}/{repo}/blob/{sha}/{path}#L{site['line']})"
    return f"`{text}`"


def _golden_lines(harness: HarnessSession) -> list[str]:
    from harness.goldens import GoldenStatus, GoldenTally

    tally = GoldenTally.of(harness.golden_status.values())
    if not tally.counts:
        return []
    lines = ["", "### Goldens", "", *tally.lines(harness.goldens.root)]
    changes = []
    for golden in sorted(harness.golden_change):
        status = harness.golden_status.get(golden)
        if status in (GoldenStatus.WRITTEN, GoldenStatus.UPDATED):
            changes += harness.golden_change[golden].lines(golden, status)
    if changes:
        lines += ["", "```text", *changes, "```"]
    return lines


def _mutant_lines(mutants: object) -> list[str]:
    """The mutation score, where mutants ran (``--spatial-mutants``)."""
    if mutants is None:
        return []
    from harness._mutation.catalogue import score_line

    not_run = getattr(mutants, "not_run", "")
    text = (
        f"mutants not run: {not_run}" if not_run else score_line(getattr(mutants, "outcomes", []))
    )
    return ["", "### Mutants", "", text]


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    r"""A GitHub Markdown table; ``|`` and newlines in a cell escaped.

    >>> markdown_table(("a", "b"), [("x|y", "1")])
    ['| a | b |', '| --- | --- |', '| x\\|y | 1 |']
    """

    def cells(values: tuple[str, ...]) -> str:
        return (
            "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in values) + " |"
        )

    return [cells(header), "| " + " | ".join("---" for _ in header) + " |", *map(cells, rows)]
