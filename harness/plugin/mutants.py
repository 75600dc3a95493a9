"""``pytest --spatial-mutants``: would the selected tests notice a bug in the distributed calls?

A plugin object of ``harness.plugin``, registered only with ``--spatial-mutants``. The
session first runs the selected tests as they are, with every rank recording the call sites
its code reaches (``harness._mutation.catalogue``); they must all pass. Then, still on the
warm pools, each mutant of each site reached inside the project (the rootdir, not installed
packages) reruns the tests that reached it, fastest first, until one fails: killed by that
test, with how it failed; or every one passes: SURVIVED, with the reason where one is known.
Under xdist each worker mutates the sites of the tests it ran; the controller adds them up.

The terminal summary is a table (mutant, call site, verdict) ending in
``spatial mutation score: K/N killed``; ``--spatial-mutants-min-score P`` fails the session
under P %.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import pytest

from harness._mutation.campaign import Killed, Reached, campaign
from harness._mutation.catalogue import (
    Mutant,
    MutantKind,
    Outcome,
    SiteStats,
    quantity_of,
    score,
    score_line,
    table_rows,
)
from harness._mutation.mode import RECORD, MutantMode, running
from harness.plugin._keys import _EQUIV_PROP
from harness.pool import RankPool
from harness.pool.launcher import LauncherRunner
from harness.report import SummaryRow, format_table

SITES_KEY = pytest.StashKey[list[dict[str, SiteStats]]]()
_OUTPUT = "harness_mutants"
#: a mutant rerun gets this many times its test's first duration (at least the floor), not
#: the whole timeout: a mutant that hangs where nothing can prove it is ended sooner
RERUN_FACTOR, RERUN_FLOOR = 10.0, 30.0


class MutantSession:
    """The mutation run of one pytest process (see the module docstring)."""

    def __init__(self, config: pytest.Config, min_score: float | None) -> None:
        self.config, self.min_score = config, min_score
        self.durations: dict[str, float] = {}
        self.failed: list[str] = []
        self.outcomes: list[Outcome] = []
        self.not_run = ""
        self.mutating = False

    # ------------------------------------------------------------------ the first run

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.mutating:
            return
        if report.failed:
            self.failed.append(report.nodeid)
        if report.when == "call":
            self.durations[report.nodeid] = report.duration

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        with running(RECORD):  # the first run: every rank records the call sites it reaches
            result = yield
        if getattr(self.config.option, "numprocesses", None) and not hasattr(
            self.config, "workerinput"
        ):
            return result  # the xdist controller: its workers mutate, it adds up
        if session.shouldfail or session.shouldstop:
            self.not_run = "the session was stopped"
        elif self.failed:
            self.not_run = (
                f"{len(self.failed)} test(s) failed without a mutant (first: {self.failed[0]}); "
                "mutants measure passing tests: fix them first"
            )
        else:
            self.outcomes = self.mutate(session)
        if hasattr(self.config, "workerinput"):
            self.config.workeroutput[_OUTPUT] = {  # type: ignore[attr-defined]
                "not_run": self.not_run,
                "outcomes": [_plain(o) for o in self.outcomes],
            }
        return result

    # ------------------------------------------------------------------ mutating

    def mutate(self, session: pytest.Session) -> list[Outcome]:
        ran = {item.nodeid: item for item in session.items if item.nodeid in self.durations}
        root = self.config.rootpath.resolve()
        reached: Reached[pytest.Item] = Reached(lambda where: _inside(where, root))
        for nodeid, item in ran.items():
            recorded: list[dict[str, SiteStats]] = item.stash.get(SITES_KEY, [])
            reached.add(item, self.durations[nodeid], recorded)
        self.mutating = True
        try:
            return campaign(reached, _rerun, timeout=_rerun_timeout)
        finally:
            self.mutating = False

    # ------------------------------------------------------------------ adding up

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: object, error: object) -> None:
        out = getattr(node, "workeroutput", {}).get(_OUTPUT)
        if not out:
            return
        if out["not_run"] and not self.not_run:
            self.not_run = out["not_run"]
        merged = {o.mutant: o for o in self.outcomes}
        for raw in out["outcomes"]:
            o = _outcome(raw)
            if o.mutant not in merged or (o.killed and not merged[o.mutant].killed):
                merged[o.mutant] = o
        self.outcomes = list(merged.values())

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput") or self.min_score is None:
            return
        killed, total = score(self.outcomes)
        if self.not_run or (total and 100.0 * killed / total < self.min_score):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if hasattr(self.config, "workerinput"):
            return
        tr = terminalreporter
        tr.write_sep("=", "spatial mutants")
        if self.not_run:
            tr.write_line(f"mutants not run: {self.not_run}")
            return
        if not self.outcomes:
            tr.write_line(
                "no torch.distributed call of the project's own code was reached by the "
                "selected tests: nothing to mutate"
            )
        else:
            header = ("mutant", "call site", "verdict")
            for line in format_table(header, table_rows(self.outcomes)):
                tr.write_line(line)
        killed, total = score(self.outcomes)
        line = score_line(self.outcomes)
        if self.min_score is not None and total and 100.0 * killed / total < self.min_score:
            tr.write_line(f"below --spatial-mutants-min-score {self.min_score:g}%")
        tr.write_line(line)


def collect_sites(node: pytest.Item, pool: RankPool | LauncherRunner) -> None:
    """After a run of the ``spatial`` fixture: keep the call sites its ranks recorded (the
    pool's; a launcher's ranks run in place, where no mutant is injected)."""
    if isinstance(pool, RankPool) and pool.last_sites:
        node.stash.setdefault(SITES_KEY, []).extend(pool.last_sites)


def _rerun(item: pytest.Item, mode: MutantMode) -> Killed | None:
    """Run ``item`` again (in ``mode``, which its ``spatial`` fixture reads): how it failed,
    or ``None`` if it passed."""
    from _pytest.runner import runtestprotocol

    before = len(item.user_properties)
    _fresh_request(item)
    try:
        reports = runtestprotocol(item, nextitem=None, log=False)
        failed = next((r for r in reports if r.failed), None)
        if failed is None:
            return None
        props = item.user_properties[before:]
        rows = [cast(SummaryRow, v) for k, v in props if k == _EQUIV_PROP]
        problems = [q for row in rows for q in row.get("problems", ())]
        return Killed(
            item.nodeid, ", ".join(sorted(set(problems))) or quantity_of(failed.longreprtext)
        )
    finally:
        del item.user_properties[before:]


def _rerun_timeout(seconds: float) -> float:
    """A mutant's rerun of a test that took ``seconds`` as it is: its checks' limit."""
    return max(RERUN_FLOOR, RERUN_FACTOR * seconds)


def _inside(site: str, root: Path) -> bool:
    path = Path(site.split(" in ", 1)[0].rsplit(":", 1)[0])
    try:
        path.resolve().relative_to(root)
    except ValueError:
        return False
    return "site-packages" not in path.parts


def _fresh_request(item: pytest.Item) -> None:
    """pytest keeps an item's fixture request from its first run; a rerun needs a new one
    (private ``Function._initrequest``, as pytest-rerunfailures uses; pytest 7-9)."""
    init = getattr(item, "_initrequest", None)
    if init is not None:
        init()


def _plain(o: Outcome) -> dict[str, object]:
    """``o`` in built-in types, as a worker reports it to xdist's controller (execnet carries
    no enum): the mutant's kind as its text."""
    raw = dataclasses.asdict(o)
    raw["mutant"]["kind"] = o.mutant.kind.value
    return raw


def _outcome(raw: dict[str, Any]) -> Outcome:
    """The ``Outcome`` a worker reported (``_plain``), its kind a ``MutantKind`` again."""
    mutant = Mutant(**{**raw["mutant"], "kind": MutantKind(raw["mutant"]["kind"])})
    fields = ("location", "killed_by", "quantity", "reason")
    return Outcome(mutant, *(raw[k] for k in fields))
