"""Where CI users look: GitHub Actions annotations and job summary, JUnit XML properties."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import harness

#: a user's model in its own file: the global mean forgets the other ranks' positions
MODEL = '''
import torch


class GlobalMean(torch.nn.Module):
    """The mean over every position of the globe."""

    def forward(self, h, npos, topo):
        return h.sum(dim=1) / npos  # the bug: this rank's positions only (no spatial_sum)


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(3, 8)
        self.decoder = torch.nn.Linear(8, 3)
        self.mean = GlobalMean()

    def forward(self, x, npos, topo):
        h = torch.tanh(self.encoder(x))
        return x + self.decoder(h + self.mean(h, npos, topo)[:, None, :])
'''


def _line_of(source: str, text: str) -> int:
    """The line of ``text`` in ``source`` as pytester writes it (leading blank lines dropped)."""
    return next(i for i, line in enumerate(source.strip().splitlines(), 1) if text in line)


MEAN_FORWARD = _line_of(MODEL, "def forward(self, h")

TESTS = """
from harness.collectives import sync_gradients
from harness.steppers.mlp import CoupledMLPCase
from model import Mixer


class MixerCase(CoupledMLPCase):
    name = "mixer"

    def build(self, topo):
        model = Mixer()
        sync_gradients(model, topo)
        return model


def test_mixer(spatial):
    spatial.check(MixerCase())
"""
CHECK_LINE = _line_of(TESTS, "spatial.check(MixerCase())")

PASSING = """

def test_builtin(spatial):
    spatial.check(CoupledMLPCase())
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A downstream project with a model file and its tests; no GitHub variables unless a
    test sets them (the suite itself may run under GitHub Actions)."""
    for name in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "GITHUB_WORKSPACE", "GITHUB_SHA"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(model=MODEL, test_gh=TESTS + PASSING)
    return pytester.path


def _github(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    summary = root / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    return summary


def _errors(stdout: list[str]) -> list[str]:
    return [line for line in stdout if line.startswith("::error")]


def _assert_annotated_and_summarised(errors: list[str], summary: Path) -> None:
    # the model's line first, escaped as GitHub's toolkit escapes (%3A, %2C, %0A)
    assert errors[0].startswith(
        f"::error file=model.py,line={MEAN_FORWARD},title=mixer%3A first divergence%2C "
        "forward of 'mean' (GlobalMean)::First divergence: forward of 'mean' (GlobalMean)"
    ), errors
    assert "%0AWhat to do: " in errors[0] and "\n" not in errors[0]
    # then the test's own line, its message the failure's text (no xdist header)
    assert errors[1].startswith(
        f"::error file=test_gh.py,line={CHECK_LINE},title=test_gh.py%3A%3Atest_mixer failed::"
        "mixer on 2 ranks"
    ), errors
    assert len(errors) == 2, errors  # the passing check is not annotated
    text = summary.read_text()
    assert "## Spatial equivalence\n\n2 checks: 1 equivalent, 1 mismatched." in text
    rows = [line for line in text.splitlines() if line.startswith("| test_gh.py::")]
    assert rows[0].startswith("| test_gh.py::test_builtin | coupled-mlp | 2 | 37 positions |")
    assert rows[0].endswith("| - | equivalent | - |")
    assert rows[1].startswith("| test_gh.py::test_mixer | mixer | 2 |")
    assert rows[1].endswith(f"**MISMATCH**: field, grad, loss, param | `model.py:{MEAN_FORWARD}` |")


def test_under_github_actions_a_failing_check_is_annotated_at_the_models_line_and_summarised(
    project: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = _github(monkeypatch, project)
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    _assert_annotated_and_summarised(_errors(result.outlines), summary)


def test_under_xdist_the_controller_annotates_and_summarises_every_workers_checks(
    project: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = _github(monkeypatch, project)
    summary.write_text("# earlier step\n")  # a summary is appended to, never replaced
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    _assert_annotated_and_summarised(_errors(result.outlines), summary)
    text = summary.read_text()
    assert text.startswith("# earlier step\n## Spatial equivalence")
    assert text.count("## Spatial equivalence") == 1  # the controller's, not each worker's


def test_outside_github_actions_nothing_is_annotated_or_summarised(
    project: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = project / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))  # set, but not GitHub Actions
    pytester.makepyfile(test_gh=TESTS)
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert not _errors(result.outlines)
    assert not summary.exists()
    # and asked for by name, outside GitHub Actions too (the summary only where its file is)
    forced = pytester.runpytest_subprocess(
        "--spatial-ranks=2", "--spatial-github=on", "-p", "no:cacheprovider"
    )
    assert _errors(forced.outlines)[0].startswith(f"::error file=model.py,line={MEAN_FORWARD},")


def test_a_deadlock_of_a_built_in_fault_is_annotated_at_the_line_that_issued_the_collective(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the built-in HEALPix stepper is the model here: the repository is the harness's own
    repo = Path(harness.__file__).resolve().parent.parent
    _github(monkeypatch, pytester.path)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(repo))
    pytester.makepyfile(
        test_hang="""
from harness.steppers.healpix import FAULT_CHECKS, HealpixCase

def test_empty_skip(spatial):
    _, kwargs, spatial_size = FAULT_CHECKS["empty-skip"]
    case = HealpixCase(**kwargs, faults={"empty-skip"})
    spatial.check(case, ranks=4, spatial_size=spatial_size, timeout=8)
"""
    )
    result = pytester.runpytest_subprocess("--spatial-ranks=4", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    source = (repo / "harness/steppers/healpix.py").read_text().splitlines()
    errors = _errors(result.outlines)
    hit = re.match(
        r"::error file=harness/steppers/healpix\.py,line=(\d+),title=([^:]*)::", errors[0]
    )
    assert hit, errors
    # the stepper's own call of the gather the ranks wait in, not the harness's or torch's
    assert "all_gather_uneven(" in source[int(hit[1]) - 1]
    assert hit[2] == "healpix%3A deadlock on ranks 0%2C 2%2C 3"
    assert "rank 1: deadlock: returned after" in errors[0]  # the rank that skipped it, said
    # the test file lies outside the repository: its annotation names no file
    assert errors[1].startswith("::error title=test_hang.py%3A%3Atest_empty_skip failed::")


def test_junit_xml_carries_each_checks_spatial_properties_and_none_of_the_plain_data(
    project: Path, pytester: pytest.Pytester
) -> None:
    result = pytester.runpytest_subprocess(
        "--spatial-ranks=2", "--junitxml=junit.xml", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, failed=1)
    cases = ET.parse(project / "junit.xml").getroot().iter("testcase")
    props = {
        c.get("name"): [(p.get("name"), p.get("value")) for p in c.iter("property")] for c in cases
    }
    failing, passing = dict(props["test_mixer"]), dict(props["test_builtin"])
    assert all(
        name.startswith("spatial.") for name, _ in props["test_mixer"] + props["test_builtin"]
    )
    assert failing["spatial.case"] == "mixer"
    assert failing["spatial.layout"] == "2 ranks (spatial 2, 37 positions)"
    assert failing["spatial.verdict"] == "mismatch"
    assert failing["spatial.quantity"] == "field, grad, loss, param"
    assert failing["spatial.step"] == "0"
    assert failing["spatial.first"].startswith("rank 0: loss 'loss' at step 0: max abs")
    assert failing["spatial.first_divergence"] == "forward of 'mean' (GlobalMean)"
    assert failing["spatial.site"] == f"{project / 'model.py'}:{MEAN_FORWARD}"
    assert re.fullmatch(r"field \d\.\d\de\+01 \(relative\)", failing["spatial.worst_error"])
    assert passing["spatial.verdict"] == "equivalent"
    assert "spatial.quantity" not in passing
    # float64 and a correct model: rounding only (cf. the summary's 5.1e-14)
    assert float(passing["spatial.worst_error"].split()[1]) < 1e-12
