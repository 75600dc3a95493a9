"""The tests that depend on the torch / torch-harmonics pair are all listed in .ci/pair-tests,
which CI runs on the second documented pair too (and `tox -e py311-th09-pair`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what ties a test module to the pair: torch-harmonics itself, or the SFNO built on it
USES_THE_PAIR = re.compile(r"torch_harmonics|SFNOCase|SFNOStepper|steppers\.sfno")


def listed() -> list[str]:
    lines = (ROOT / ".ci" / "pair-tests").read_text().splitlines()
    return [line for line in lines if line.startswith("tests/")]  # as .ci/run and tox read it


def test_every_test_module_using_torch_harmonics_or_the_sfno_runs_on_both_pairs():
    tests = ROOT / "tests"
    using = {
        path.relative_to(ROOT).as_posix()
        for path in tests.rglob("test_*.py")
        # contrib: each real model runs in a venv of its own, with its own pins;
        # plugin/data: a downstream project's sources, not tests of this one
        if not {"contrib", "data"} & set(path.relative_to(tests).parts)
        and path.name != Path(__file__).name  # this module names the pattern, not the pair
        and USES_THE_PAIR.search(path.read_text())
    }
    missing = sorted(using - set(listed()))
    assert not missing, f"add them to .ci/pair-tests: {missing}"


def test_every_module_the_pair_list_names_exists():
    assert [path for path in listed() if not (ROOT / path).is_file()] == []
