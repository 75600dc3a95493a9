"""The equivalence table's rows for everything a test ran, and the progress lines of a
sweep and of a long rollout.

A row per ``spatial.check`` (``steps 2``, ``rollout 150``), per sweep (``layouts 13 of 13``:
``spatial.check_layouts``, ``--spatial-layouts``, a bare ``check_layouts``), per check a
test ran itself (``check_equivalence(..., pool=spatial.pool())``), and one per Hypothesis
test for all its examples (``examples 20``). Rows travel to xdist's controller as the test
report's user properties, like the fixture's own.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, cast

import pytest

from harness._records.observe import listening
from harness.compare import NUMERIC
from harness.layouts import LayoutsReport, block_cases, layouts
from harness.plugin._keys import _EQUIV_PROP
from harness.pool import RankPool
from harness.report import EquivalenceReport, SummaryRow

if TYPE_CHECKING:
    from harness.case import SpatialCase
    from harness.pool.launcher import LauncherRunner


class SummaryRows:
    """The plugin object that hears of the checks a test runs without the fixture's help,
    and folds a Hypothesis test's checks into one row."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, None]:
        heard: list[SummaryRow] = []

        def hear(report: object) -> None:
            row = report_row(report)
            if row is not None:
                row["test"] = item.nodeid
                heard.append(row)

        with listening(hear):
            yield
        item.user_properties.extend((_EQUIV_PROP, row) for row in heard)
        if _is_hypothesis_test(item):
            _fold_examples(item)


def report_row(report: object) -> SummaryRow | None:
    """The summary row of a check's or a sweep's report (``None``: neither)."""
    if isinstance(report, EquivalenceReport):
        return report.summary_row()
    if isinstance(report, LayoutsReport):
        return sweep_row(report)
    return None


def sweep_row(report: LayoutsReport) -> SummaryRow:
    """A sweep's row: ``layouts k of n`` (k checked, the rest refused by the case), the
    worst error of any layout, the smallest failing layout as its partition."""
    reports = [r.report for r in report.results if r.report is not None]
    # plain text keys and values: rows travel to the xdist controller, which takes no enum
    worst = {str(q): _most(rep.worst(q) for rep in reports) for q in NUMERIC}
    smallest = report.smallest_failing
    if smallest is not None:
        partition = f"smallest failing: {smallest}"
    else:
        refused = len(report.refused)
        every = "every covering layout" if report.covering else "every layout"
        partition = every + (f", {refused} refused" if refused else "")
    problems = sorted({q for rep in reports for q in rep.quantities})
    if not report.ok and not problems:
        problems = ["vacuous"] if report.vacuous else ["no layout ran"]
    sizes = [r.layout.world_size for r in report.results] or [report.max_ranks]
    return {
        "case": report.case,
        "ranks": max(sizes),
        "spatial": max((r.layout.spatial_size for r in report.results), default=1),
        "partition": partition,
        "dtype": reports[0].dtype if reports else "-",
        "worst": worst,
        "ok": report.ok,
        "problems": problems,
        "seconds": round(report.seconds, 2),
        # k checked of n: the exhaustive sweep's count, the layouts a covering one left out too
        "label": f"layouts {len(reports)} of {len(report.results) + len(report.left_out)}"
        + (" (covering)" if report.covering else ""),
    }


def _most(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _is_hypothesis_test(item: pytest.Item) -> bool:
    hypothesis = sys.modules.get("hypothesis")  # a test of it has imported it already
    obj = getattr(item, "obj", None)
    return hypothesis is not None and obj is not None and hypothesis.is_hypothesis_test(obj)


def _fold_examples(item: pytest.Item) -> None:
    """A Hypothesis test's checks, one per example (and per shrink): one row, ``examples
    k``, the worst of them all, failing if any failed."""
    rows = [cast(SummaryRow, v) for key, v in item.user_properties if key == _EQUIV_PROP]
    if not rows:
        return
    item.user_properties[:] = [p for p in item.user_properties if p[0] != _EQUIV_PROP]
    item.user_properties.append((_EQUIV_PROP, fold_rows(rows, f"examples {len(rows)}")))


def fold_rows(rows: list[SummaryRow], label: str) -> SummaryRow:
    """Several checks' rows as one: each column the one value they share, else a count."""

    def one(key: str, what: str) -> str:
        values = sorted({str(r.get(key, "-")) for r in rows})
        return values[0] if len(values) == 1 else f"{len(values)} {what}"

    folded: SummaryRow = {
        "case": one("case", "cases"),
        "ranks": max(r["ranks"] for r in rows),
        "spatial": max(r["spatial"] for r in rows),
        "partition": one("partition", "partitions"),
        "dtype": one("dtype", "dtypes"),
        "worst": {str(q): _most(r["worst"].get(str(q)) for r in rows) for q in NUMERIC},
        "ok": all(r["ok"] for r in rows),
        "problems": sorted({p for r in rows for p in r["problems"]}),
        "seconds": round(sum(r["seconds"] for r in rows), 2),
        "label": label,
        "test": rows[0].get("test", ""),
    }
    goldens = [r["golden"] for r in rows if "golden" in r]
    if goldens:
        folded["golden"] = goldens[-1]  # the last example's: what the run left on disk
    return folded


def planned_layouts(
    case: SpatialCase, max_ranks: int, world_sizes: Iterable[int] | None = None
) -> int | None:
    """How many layouts a sweep of ``case`` will run (``None`` where that cannot be said
    beforehand: the progress line then counts without a total)."""
    try:
        todo = layouts(max_ranks, case.mesh_dims, world_sizes)
        meshes = {x.mesh for x in todo if x.spatial_size > 1}
        variants = {mesh: len(block_cases(case, mesh)) for mesh in meshes}
        return len(todo) + sum(variants.get(x.mesh, 0) for x in todo)
    except Exception:  # noqa: BLE001 - a count for a progress line never fails a test
        return None


def _watched(config: pytest.Config) -> bool:
    """Whether a person watches this session's lines as they come: a terminal, or ``-v``;
    never an xdist worker, whose output the controller does not show (it would interleave
    with the other workers' lines if it did)."""
    if hasattr(config, "workerinput"):
        return False
    tr = config.pluginmanager.get_plugin("terminalreporter")
    return tr is not None and (config.option.verbose > 0 or bool(getattr(tr, "isatty", False)))


def progress(config: pytest.Config, text: str) -> None:
    """``text`` on the terminal now, while the test runs, where a person watches."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or not _watched(config):
        return
    capman = config.pluginmanager.get_plugin("capturemanager")
    shown = capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()
    with shown:
        tr.write_line(text)


#: How often a rollout's progress is read off the ranks' notice board, in seconds: a line at
#: most this often, so a rollout shorter than this says nothing.
ROLLOUT_EVERY = 5.0
_ROLLOUT_STEP = re.compile(r"rollout step (\d+)")
_MODEL_CALLS = re.compile(r"rollout predict \((\d+) model calls?")


def _rollout_phase(phase: str, steps: int) -> str:
    """Rank 0's phase as a progress line's text: ``rollout: step k of N`` where predict
    yields its steps, ``rollout: k model calls of N steps`` where it returns them at the end
    (calls are not steps: a step may call the model twice); another rollout phase as it is
    (``rollout build``); ``""`` outside the rollout."""
    step = _ROLLOUT_STEP.search(phase)
    if step is not None:
        return f"rollout: step {int(step.group(1)) + 1} of {steps}"
    calls = _MODEL_CALLS.search(phase)
    if calls is not None:
        return f"rollout: {calls.group(1)} model calls, of {steps} steps"
    return phase if phase.startswith("rollout") else ""  # its build, batch, or fields


@contextlib.contextmanager
def rollout_progress(
    config: pytest.Config, pool: RankPool | LauncherRunner, label: str, steps: int
) -> Iterator[None]:
    """While a check's rollout of ``steps`` steps runs, ``label: rollout: step k of N`` (or
    ``k model calls``: ``_rollout_phase``) every ``ROLLOUT_EVERY`` seconds, read from rank
    0's phase on the pool's board (what the rank wrote for itself: no message, no CPU time
    of the rank). Nothing where nobody watches or the runner has no board (torchrun/srun);
    the reader stops before the check returns."""
    if not steps or not isinstance(pool, RankPool) or not _watched(config):
        yield
        return
    done = threading.Event()

    def watch() -> None:
        said = ""
        while not done.wait(ROLLOUT_EVERY):
            try:
                # the pool's board now: a rank replaced mid-check comes with a new one
                found = _rollout_phase(pool.board.read(0).phase, steps)
            except Exception:  # noqa: BLE001 - no board this moment (pool restarting): a line less
                continue
            if found and found != said:
                said = found
                progress(config, f"{label}: {found}")

    reader = threading.Thread(target=watch, name="harness-rollout-progress", daemon=True)
    reader.start()
    try:
        yield
    finally:
        done.set()
        reader.join()
