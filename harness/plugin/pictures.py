"""A failing check's and a failing sweep's pictures: error maps, the rollout curve, the
layout map, written under ``--spatial-plots`` (their paths said in the failure) and drawn
for ``--spatial-report``'s page. A picture is a diagnosis: one that cannot be drawn is a
``Not plotted:`` line, and the failure it illustrates stands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from harness.errors import exception_summary
from harness.goldens import golden_stem
from harness.layouts import LayoutsReport
from harness.plugin.html_report import defer_figures
from harness.report import EquivalenceReport


def check_failure(node: pytest.Item, report: EquivalenceReport) -> str:
    """A failing check's text, with the paths of its error maps and rollout curve under
    ``--spatial-plots``; its pictures for ``--spatial-report`` are drawn if the test fails."""
    text = str(report)
    plots = node.config.getoption("spatial_plots")
    if plots and report.field_errors:
        maps = write_error_maps(report, plots, node.nodeid)
        text += "\n\nError maps:\n" + "\n".join(f"  {p}" for p in maps)
    if plots and report.rollout is not None and report.rollout.curve:
        curve = drawn(
            "the rollout error curve", lambda: write_rollout_curve(report, plots, node.nodeid)
        )
        text += f"\n\nRollout error curve: {curve}"
    defer_figures(node, lambda out: check_figures(report, out, node.nodeid))
    return text


def sweep_failure(node: pytest.Item, report: LayoutsReport) -> str:
    """A failing sweep's text, with its layout map's path under ``--spatial-plots``; its
    pictures for ``--spatial-report`` are drawn if the test fails."""
    defer_figures(node, lambda out: sweep_figures(report, out, node.nodeid))
    text = str(report)
    plots = node.config.getoption("spatial_plots")
    if plots:  # the map as a picture too
        path = drawn("the layout map", lambda: str(report.plot(_layout_map(plots, node.nodeid))))
        text += f"\n\nLayout map: {path}"
    return text


def check_figures(report: EquivalenceReport, directory: str, nodeid: str) -> list[str]:
    """A failing report's pictures drawn under ``directory`` (for ``--spatial-report``):
    paths, or ``Not plotted:`` lines."""
    # a map per failing field, or its Not plotted line (write_error_maps says why)
    figures = write_error_maps(report, directory, nodeid) if report.field_errors else []
    if report.rollout is not None and report.rollout.curve:
        curve = lambda: write_rollout_curve(report, directory, nodeid)  # noqa: E731
        figures.append(drawn("the rollout error curve", curve))
    return figures


def sweep_figures(report: LayoutsReport, directory: str, nodeid: str) -> list[str]:
    """A failing sweep's pictures: its layout map, then the smallest failing layout's."""
    out = _layout_map(directory, nodeid)
    figures = [drawn("the layout map", lambda: str(report.plot(out)))]
    smallest = report.smallest_report
    return figures + (check_figures(smallest, directory, nodeid) if smallest is not None else [])


def write_error_maps(report: EquivalenceReport, directory: str, nodeid: str) -> list[str]:
    """One PNG per failing field of ``report`` under ``directory``; returns the paths, and a
    ``Not plotted:`` line for a field whose map could not be drawn (a picture is a diagnosis:
    it never takes the verdict down)."""
    out = Path(directory)
    stem = _stem(nodeid)
    from harness.report import plots as plots

    paths = []
    for fe in report.field_errors:
        title = f"{report.case}: |partitioned - reference| of {fe.name!r}, step {fe.step}"
        try:  # every field gets its map, whatever its layout, or says why not
            path = plots.plot_field_error(
                fe,
                out / f"{stem}.{fe.name}.step{fe.step}.png",
                title=title,
                spatial_size=report.spatial_size,
                latitudes=report.latitudes,
            )
        except Exception as exc:  # noqa: BLE001 - any failure: said, and the report stands
            paths.append(
                f"Not plotted: field {fe.name!r}, step {fe.step} ({exception_summary(exc)})"
            )
        else:
            paths.append(str(path))
    return paths


def write_rollout_curve(report: EquivalenceReport, directory: str, nodeid: str) -> str:
    """The rollout's per-step error curve of ``report`` as a PNG under ``directory``."""
    from harness.rollout import plot_rollout

    assert report.rollout is not None
    path = Path(directory) / f"{_stem(nodeid)}.rollout.png"
    title = f"{report.case}: rollout of {report.rollout.steps} steps"
    return str(plot_rollout(report.rollout, path, title=title))


def drawn(what: str, draw: Callable[[], str]) -> str:
    """The path ``draw`` wrote, or a ``Not plotted:`` line: a picture is a diagnosis, and
    never takes the failure it illustrates down."""
    try:
        return draw()
    except Exception as exc:  # noqa: BLE001 - any failure: said, and the report stands
        return f"Not plotted: {what} ({exception_summary(exc)})"


def _layout_map(directory: str, nodeid: str) -> Path:
    return Path(directory) / f"{_stem(nodeid)}.layouts.png"


def _stem(nodeid: str) -> str:
    """A test's files' common stem: its golden's, one file name (no directories)."""
    return golden_stem(nodeid).replace("/", ".")
