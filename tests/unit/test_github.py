"""The GitHub Actions output on hand-made session data: the job summary's Markdown and a
diagnosis that fails (``harness.plugin.github``; the plugin end to end is in
``tests/plugin/test_github.py``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import EquivalenceReport, Mismatch
from harness.goldens import GoldenChange, GoldenStore
from harness.layouts import Layout, LayoutResult, LayoutsReport
from harness.plugin import github
from harness.plugin.github import GithubSession, annotation, job_summary
from harness.plugin.session import HarnessSession


@pytest.fixture
def gh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GithubSession:
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path))
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/model")
    monkeypatch.setenv("GITHUB_SHA", "abc123")
    monkeypatch.delenv("GITHUB_SERVER_URL", raising=False)
    return GithubSession(SimpleNamespace(rootpath=tmp_path))  # type: ignore[arg-type]


def _md(*cells: str) -> str:
    """A row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def _row(test: str, ok: bool, **extra: object) -> dict[str, object]:
    worst = {"loss": 1e-15, "grad": 0.5 if not ok else 2e-15, "field": None, "param": 3e-15}
    problems = [] if ok else ["grad"]
    row = dict(case="mixer", ranks=2, spatial=2, partition="37 positions", dtype="float64")
    return {**row, "worst": worst, "ok": ok, "problems": problems, "test": test, **extra}


def test_the_job_summary_holds_the_table_the_sweeps_the_goldens_and_the_mutation_score(
    gh: GithubSession, tmp_path: Path
) -> None:
    site = {"file": str(tmp_path / "model.py"), "line": 8, "title": "t", "message": "m"}
    outside = {"file": "/elsewhere/lib.py", "line": 3, "title": "t", "message": "m"}
    harness = HarnessSession(GoldenStore(tmp_path / "goldens"))
    harness.equivalences = [
        _row("t.py::test_b", False, sites=[site]),
        _row("t.py::test_a", True, golden="passed"),
        _row("t.py::test_c", False, sites=[outside]),
    ]
    harness.golden_status = {"goldens/a.pt": "updated", "goldens/b.pt": "passed"}
    harness.golden_change = {
        "goldens/a.pt": GoldenChange(("loss",), (), (), 3, ("loss", 0.5, 0.25))
    }
    gh.sweeps = [
        {"test": "t.py::test_s", "case": "mixer|x", "layouts": 9, "failing": 2,
         "smallest": "2 ranks, grid 2, 1 data group", "sites": [site]},
    ]  # fmt: skip
    mutants = SimpleNamespace(
        not_run="", outcomes=[SimpleNamespace(killed=True), SimpleNamespace(killed=False)]
    )
    lines = job_summary(gh, harness, mutants).splitlines()
    link = "[`model.py:8`](https://github.com/org/model/blob/abc123/model.py#L8)"
    numbers = ("37 positions", "float64", "1.0e-15")
    assert lines[:8] == [
        "## Spatial equivalence",
        "",
        "3 checks: 1 equivalent, 2 mismatched.",
        "",
        _md("test", "case", "ranks", "partition", "dtype", "loss", "grad", "field", "param",
            "golden", "verdict", "where"),
        _md(*["---"] * 12),
        _md("t.py::test_a", "mixer", "2", *numbers, "2.0e-15", "-", "3.0e-15", "passed",
            "equivalent", "-"),
        _md("t.py::test_b", "mixer", "2", *numbers, "5.0e-01", "-", "3.0e-15", "-",
            "**MISMATCH**: grad", link),
    ]  # fmt: skip
    assert lines[8].endswith("| **MISMATCH**: grad | `lib.py:3` |")  # outside: named, no link
    sweep = _md("t.py::test_s", "mixer\\|x", "2 of 9 fail", "2 ranks, grid 2, 1 data group", link)
    header = _md("test", "case", "layouts", "smallest failing layout", "where")
    assert lines[9:15] == ["", "### Layout sweeps", "", header, _md(*["---"] * 5), sweep]
    text = "\n".join(lines)
    assert "### Goldens\n\n2 goldens: 1 updated, 1 passed." in text
    assert "```text\nupdated goldens/a.pt: 1 changed, 0 added, 0 removed, 3 unchanged;" in text
    assert text.endswith("### Mutants\n\nspatial mutation score: 1/2 killed")


def test_a_session_without_checks_goldens_or_mutants_says_so_in_one_line(gh: GithubSession) -> None:
    assert job_summary(gh, None, None) == "## Spatial equivalence\n\nNo spatial check ran.\n"
    stopped = SimpleNamespace(not_run="the session was stopped", outcomes=[])
    assert job_summary(gh, None, stopped).endswith("mutants not run: the session was stopped\n")


def test_a_diagnosis_that_fails_is_an_annotation_without_a_file_that_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(report: object, case: object) -> list[object]:
        raise ValueError("a source it cannot read")

    monkeypatch.setattr(github, "failure_sites", broken)
    report = EquivalenceReport("c", 2, 2, "", 2, "float64", None, [Mismatch("grad", "w", 0, 1)])
    [site] = github._sites(report, object())  # type: ignore[arg-type]
    assert site == {
        "file": "",
        "line": 0,
        "title": "Not located",
        "message": "ValueError: a source it cannot read",
    }
    assert annotation(site["message"], title=site["title"]) == (
        "::error title=Not located::ValueError: a source it cannot read"
    )


def test_a_failing_sweep_reaches_the_summary_and_is_annotated_at_its_smallest_layouts_line(
    gh: GithubSession, tmp_path: Path
) -> None:
    model = str(tmp_path / "model.py")
    stack = f'Current thread 0x1 (most recent call first):\n  File "{model}", line 41 in halo'
    hang = Mismatch("deadlock", "c", 0, 0, where="waits in all_reduce #1", detail=stack)
    smallest = Layout(2, 2, 1, (2,))

    def run(ranks: int, *mismatches: Mismatch) -> EquivalenceReport:
        return EquivalenceReport("c", ranks, ranks, "", 2, "float64", None, list(mismatches))

    sweep = LayoutsReport("c", 4, 1, [
        LayoutResult(Layout(1, 1, 1, (1,)), run(1)),
        LayoutResult(Layout(4, 4, 1, (4,)), run(4, hang)),
        LayoutResult(smallest, run(2, hang)),
        LayoutResult(Layout(3, 3, 1, (3,), "uneven"), None, refused="no uneven blocks"),
    ])  # fmt: skip
    node = SimpleNamespace(nodeid="t.py::test_s", user_properties=[], path=Path(__file__))
    github.record_sweep(node, sweep, object())  # type: ignore[arg-type]
    [(_, plain)] = [(k, v) for k, v in node.user_properties if k == github._SWEEP_PROP]
    assert (plain["layouts"], plain["failing"]) == (3, 2)  # the refused layout did not run
    assert plain["smallest"] == "2 ranks, grid 2, 1 data group"
    assert plain["problems"] == ["deadlock"]
    assert ("spatial.layouts", "2 of 3 fail") in node.user_properties
    assert ("spatial.smallest_failing_layout", plain["smallest"]) in node.user_properties
    report = SimpleNamespace(
        when="call", failed=True, user_properties=node.user_properties, nodeid="t.py::test_s",
        longreprtext="c: 2 of 3 layouts fail",
    )  # fmt: skip
    gh.pytest_runtest_logreport(report)  # type: ignore[arg-type]
    assert gh.sweeps == [plain]
    assert gh.annotations == [
        "::error file=model.py,line=41,title=c%3A deadlock on rank 0::rank 0: deadlock: waits "
        "in all_reduce #1",
        "::error title=t.py%3A%3Atest_s failed::c: 2 of 3 layouts fail",  # this file: outside
    ]
