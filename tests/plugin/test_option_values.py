"""Options that take a value, written with a space: they work, or pytest stops in one line
where the value was read as a test path and moved the rootdir (the newcomer's layout: the
project's pytest.ini in a subdirectory, the plots directory beside it)."""

from __future__ import annotations

import pytest
from _pytest.config.argparsing import Parser

from harness.plugin._rootdir import taken_as_paths, value_options
from harness.plugin.options import pytest_addoption

GOLDEN = """
import torch

def test_golden(golden):
    golden.check({"x": torch.ones(2)})
"""


@pytest.fixture
def newcomer(pytester, monkeypatch):
    """work/proj/pytest.ini (ranks 2, goldens under proj/goldens), work/plots beside it;
    pytest runs in work/proj."""
    proj = pytester.mkdir("proj")
    (proj / "pytest.ini").write_text("[pytest]\nspatial_ranks = 2\ngolden_dir = goldens\n")
    (proj / "tests").mkdir()
    (proj / "tests" / "test_g.py").write_text(GOLDEN)
    pytester.mkdir("plots")
    monkeypatch.chdir(proj)
    return proj


def test_a_value_read_as_a_path_that_moves_the_rootdir_is_refused_in_one_line(pytester, newcomer):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spatial-plots", "../plots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.strip()]
    assert errors == [
        f"ERROR: --spatial-plots ../plots: pytest read ../plots as a test path before the "
        f"harness's options were known and took rootdir {pytester.path} with no config file "
        f"instead of {newcomer} with pytest.ini; write --spatial-plots=../plots"
    ]
    assert not (pytester.path / "goldens").exists()  # nothing recorded in the wrong place


def test_the_same_value_written_with_an_equals_sign_keeps_the_projects_ini(pytester, newcomer):
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spatial-plots=../plots", "--update-goldens"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["harness: spatial ranks 2,*", f"rootdir: {newcomer}"])
    assert (newcomer / "goldens" / "tests" / "test_g" / "test_golden.pt").is_file()


def test_a_value_with_a_space_that_moves_nothing_works(pytester, newcomer):
    (newcomer / "maps").mkdir()  # inside the project: pytest still finds proj/pytest.ini
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spatial-plots", "maps", "--spatial-ranks", "2",
        "--update-goldens",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"rootdir: {newcomer}"])


def test_every_option_that_takes_a_value_is_checked(tmp_path):
    parser = Parser(_ispytest=True)  # the one pytest hands the plugin's pytest_addoption
    pytest_addoption(parser)
    assert sorted(value_options(parser)) == [
        "--spatial-deadlock-window",
        "--spatial-github",
        "--spatial-layouts",
        "--spatial-mutants-min-score",
        "--spatial-plots",
        "--spatial-preload",
        "--spatial-ranks",
        "--spatial-report",
        "--spatial-timeout",
    ]
    (tmp_path / "4").mkdir()
    args = ["--spatial-ranks", "4", "--spatial-plots=4", "--update-goldens", "tests", "-k", "4"]
    # only a value written with a space, of an option that takes one, naming what exists
    assert taken_as_paths(args, value_options(parser), tmp_path) == [("--spatial-ranks", "4")]
