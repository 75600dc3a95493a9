"""``pytest --spatial-mutants`` as a user runs it on a model of their own.

The model (``data/ring_model.py``) is written the way a team writes one: a plain
``isend``/``irecv`` halo on a ring, an ``all_reduce`` global mean inside the model with its
own autograd backward, its own gradient hooks. Its test suite (``data/ring_tests.py``) is
one equivalence check on one layout: strong enough to kill every mutant but those no
single-group layout can show, which survive with that reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
MODEL = (DATA / "ring_model.py").read_text()
TESTS = (DATA / "ring_tests.py").read_text()


def _line(marker: str) -> str:
    """``model.py:LINE`` of the call marked ``# MARKER`` in the model."""
    (n,) = [i for i, text in enumerate(MODEL.splitlines(), 1) if text.endswith(f"# {marker}")]
    return f"model.py:{n}"


@pytest.fixture
def ring(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(model=MODEL, test_ring=TESTS)
    pytester.makeini("[pytest]\npythonpath = .\n")
    return pytester


def _rows(out: str) -> dict[tuple[str, str], str]:
    """(mutant, call site) -> verdict, from the summary table."""
    lines = out.split("spatial mutants ===", 1)[1].splitlines()
    rows = {}
    for text in lines[3:]:
        parts = [p for p in text.split("  ") if p.strip()]
        if len(parts) >= 3 and ".py:" in parts[1]:
            rows[(parts[0].strip(), parts[1].strip())] = parts[2].strip()
    return rows


def test_every_distributed_call_of_the_model_is_mutated_at_its_line(ring):
    result = ring.runpytest_subprocess("-p", "no:cacheprovider", "--spatial-mutants")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    rows = _rows(out)
    expected = {
        ("skip all_reduce", _line("ALLREDUCE_FORWARD")),
        ("avg all_reduce", _line("ALLREDUCE_FORWARD")),
        ("max all_reduce", _line("ALLREDUCE_FORWARD")),
        ("world all_reduce", _line("ALLREDUCE_FORWARD")),
        ("double all_reduce", _line("ALLREDUCE_BACKWARD")),  # a backward: summed twice
        ("skip all_reduce", _line("ALLREDUCE_BACKWARD")),  # the identity backward
        ("skip isend", _line("ISEND_RIGHT")),
        ("skip isend", _line("ISEND_LEFT")),
        ("zero irecv", _line("IRECV_LEFT")),
        ("stale irecv", _line("IRECV_RIGHT")),
        ("skip all_reduce", _line("ALLREDUCE_HOOK")),  # the gradient hook dropped
        ("double all_reduce", _line("ALLREDUCE_HOOK")),
        ("rng-per-rank RingCase.build", "test_ring.py:10"),
        ("rng-per-rank RingCase.batch", "test_ring.py:16"),
    }
    assert expected <= set(rows), sorted(set(rows))
    assert not any("collectives.py" in site for _, site in rows)  # the harness's own: not yours
    killed = "killed by test_ring.py::test_ring_matches_serial"
    assert rows[("skip isend", _line("ISEND_LEFT"))] == f"{killed} (deadlock)"  # a hang, ended
    assert rows[("zero irecv", _line("IRECV_LEFT"))].startswith(f"{killed} (field")
    assert rows[("double all_reduce", _line("ALLREDUCE_HOOK"))].startswith(killed)
    for marker in ("ALLREDUCE_FORWARD", "ALLREDUCE_BACKWARD", "ALLREDUCE_HOOK"):
        assert rows[("world all_reduce", _line(marker))] == (
            "SURVIVED: the group is the whole world on every layout the tests ran: test a "
            "layout with data groups (spatial_size < ranks)"
        )
    assert out.rstrip().splitlines()[-2] == "spatial mutation score: 19/22 killed"


def test_a_score_below_the_minimum_fails_the_session(ring):
    result = ring.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spatial-mutants", "--spatial-mutants-min-score", "90"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["below --spatial-mutants-min-score 90%", "spatial mutation score: 19/22 killed"]
    )
    passing = ring.runpytest_subprocess(
        "-p", "no:cacheprovider", "--spatial-mutants", "--spatial-mutants-min-score", "85"
    )
    assert passing.ret == pytest.ExitCode.OK


def test_mutants_spread_over_xdist_workers_add_up_to_the_same_table(ring):
    ring.makepyfile(test_again=TESTS.replace("test_ring_matches_serial", "test_ring_again"))
    result = ring.runpytest_subprocess("-p", "no:cacheprovider", "--spatial-mutants", "-n", "2")
    result.assert_outcomes(passed=2)
    # each worker mutates what its own test reached; the model's 20 mutants are counted once
    # (killed by either test), each file's own case adds its 2
    assert result.stdout.str().rstrip().splitlines()[-2] == "spatial mutation score: 21/24 killed"


def test_mutants_are_not_run_when_a_test_fails_without_one(ring):
    ring.makepyfile(test_broken="def test_broken(spatial):\n    assert spatial.run(int) == [1]\n")
    result = ring.runpytest_subprocess("-p", "no:cacheprovider", "--spatial-mutants")
    result.stdout.fnmatch_lines(
        ["mutants not run: 1 test(s) failed without a mutant (first: test_broken.py::test_broken)*"]
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--spatial-mutants-min-score", "90"],
            "--spatial-mutants-min-score needs --spatial-mutants*",
        ),
        (
            ["--spatial-mutants", "--spatial-mutants-min-score", "101"],
            "*a percentage from 0 to 100, got '101'*",
        ),
    ],
    ids=["without-mutants", "out-of-range"],
)
def test_a_bad_mutants_option_is_a_usage_error(pytester, args, says):
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {says}"])
