"""The tests that depend on the torch / torch-harmonics pair are all listed in .ci/pair-tests,
which CI runs on the second documented pair too (and `tox -e py311-th09-pair`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what ties a test module to the pair: torch-harmonics itself, or the SFNO built on it
USES_THE_PAIR = re.compile(r"torch_harmonics|SFNOCase|SFNOStepper|steppers\.sfno")


FIRST_ONLY = "first-pair-only: "


def _lines() -> list[str]:
    return (ROOT / ".ci" / "pair-tests").read_text().splitlines()


def listed() -> list[str]:
    """What runs on both pairs (as .ci/run and tox read it)."""
    return [line for line in _lines() if line.startswith("tests/")]


def first_pair_only() -> list[str]:
    """What the list keeps on the first pair, each under a comment saying why."""
    return [line[len(FIRST_ONLY) :] for line in _lines() if line.startswith(FIRST_ONLY)]


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
    missing = sorted(using - set(listed()) - set(first_pair_only()))
    assert not missing, f"add them to .ci/pair-tests (or say why first-pair-only): {missing}"


def test_every_module_the_pair_list_names_exists_once():
    names = listed() + first_pair_only()
    assert [path for path in names if not (ROOT / path).is_file()] == []
    assert len(names) == len(set(names))
