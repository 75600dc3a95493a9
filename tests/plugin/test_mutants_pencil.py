"""``pytest --spatial-mutants`` on a pencil-decomposed model: its transposes are mutated.

The model (``data/pencil_model.py``) rests every layer, forward and backward, on
``all_to_all_single`` with uneven pieces: the transposes of every pencil code and of
distributed SHTs. Before torch 2.13's ``*_single`` methods were watched, such a model scored
a perfect table with its transposes untouched (issue 28). Each transpose must now show in the
table with its own bugs (skipped, pieces rotated, split sizes swapped), and one equivalence
check must kill them all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.plugin.test_mutants import _rows

DATA = Path(__file__).parent / "data"
MODEL = (DATA / "pencil_model.py").read_text()
TESTS = (DATA / "pencil_tests.py").read_text()


def test_every_transpose_of_a_pencil_model_is_mutated_and_killed(pytester: pytest.Pytester):
    pytester.makepyfile(pencil_model=MODEL, test_pencil=TESTS)
    pytester.makeini("[pytest]\npythonpath = .\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--spatial-mutants")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    rows = _rows(out)
    # the line Python reports for the multi-line all_to_all_single call differs between
    # 3.10 and 3.11+: take the transposes' sites from the table, then require each bug there
    transposes = {site for (mutant, site) in rows if mutant.endswith("all_to_all_single")}
    assert transposes, out
    for site in transposes:
        for kind in ("skip", "rotate", "swap-splits"):
            verdict = rows[(f"{kind} all_to_all_single", site)]
            assert verdict.startswith("killed by test_pencil.py::test_pencil_matches_serial"), (
                kind,
                verdict,
            )
