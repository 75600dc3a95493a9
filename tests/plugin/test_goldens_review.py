"""Goldens a reviewer can read: what ``--update-goldens`` changed, the versions a golden was
recorded with, and unused goldens listed and pruned only after a whole, passing run.

These run pytest in-process on ``golden.check`` tests (no rank pool is needed to record a
golden), so each is quick; the layout a ``spatial.check`` golden records is tested on the
golden policy itself (tests/unit/test_goldens.py).
"""

from __future__ import annotations

import pytest
import torch

TESTS = """
import torch

SCALE, EXTRA = {scale}, {extra}

def test_a(golden):
    values = {{"x": torch.arange(4, dtype=torch.float64) * SCALE}}
    if EXTRA:
        values["y"] = torch.ones(2, dtype=torch.float64)
    else:
        values["old"] = torch.zeros(1, dtype=torch.float64)
    golden.check(values)

def test_b(golden):
    golden.check({{"z": torch.ones(3, dtype=torch.float64)}})
{more}
"""


def _module(pytester, *, scale=1.0, extra=False, more=""):
    pytester.makepyfile(test_review=TESTS.format(scale=scale, extra=extra, more=more))


def _golden(pytester, test):
    return pytester.path / "goldens" / "test_review" / f"{test}.pt"


def _recorded(pytester, *, more=""):
    """Every test's golden written."""
    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    _module(pytester, more=more)
    written = pytester.runpytest("-p", "no:cacheprovider", "--update-goldens")
    written.assert_outcomes(passed=3 if more else 2)


def test_update_goldens_says_per_rewritten_golden_what_changed_and_only_counts_the_rest(
    pytester,
):
    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    _module(pytester)
    first = pytester.runpytest("--update-goldens")
    first.assert_outcomes(passed=2)
    a, b = _golden(pytester, "test_a"), _golden(pytester, "test_b")
    lines = first.stdout.lines
    assert f"written {a}: new golden, 2 tensors" in lines
    assert f"written {b}: new golden, 1 tensor" in lines

    _module(pytester, scale=3.0, extra=True)  # x: [0,1,2,3] -> [0,3,6,9], y added, old removed
    second = pytester.runpytest("--update-goldens")
    second.assert_outcomes(passed=2)
    lines = second.stdout.lines
    start = lines.index(
        f"updated {a}: 1 changed, 1 added, 1 removed, 0 unchanged; largest "
        "change x: max abs 6, max rel 2"
    )
    assert lines[start + 1 : start + 6] == [
        "  changed: x",
        "  added: y",
        "  removed: old",
        "2 goldens: 1 updated, 1 unchanged.",
        f"Review and commit the changes under {pytester.path / 'goldens'}.",
    ]
    assert not any(str(b) in line for line in lines)  # unchanged: counted, not listed


def _save_golden(path, tensors, provenance, version=2):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "format": "harness-golden",
            "version": version,
            "provenance": provenance,
            "tensors": tensors,
        },
        path,
    )


def test_a_failing_golden_recorded_with_other_versions_says_so(pytester):
    from importlib.metadata import version

    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    _module(pytester)
    then = {"torch": "1.0.0", "torch_harmonics": version("torch-harmonics")}
    x = torch.arange(4, dtype=torch.float64)
    _save_golden(_golden(pytester, "test_a"), {"x": x * 2, "old": torch.zeros(1).double()}, then)
    _save_golden(_golden(pytester, "test_b"), {"z": torch.ones(3).double()}, then)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1, passed=1)  # test_b: same values, other versions: passes
    result.stdout.fnmatch_lines(
        [
            "*x: 3/4 over tolerance*",
            f"Recorded with torch 1.0.0, this run has torch {torch.__version__}: a likely "
            "cause of the difference (kernels round differently across versions); if only "
            "rounding moved, review and update.",
        ]
    )


def test_a_format_1_golden_is_checked_and_rewritten_in_the_new_format(pytester):
    from harness import GoldenStore

    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    _module(pytester)
    old = {"harness": "0.1.0", "torch": str(torch.__version__)}
    a = _golden(pytester, "test_a")
    x = torch.arange(4, dtype=torch.float64)
    _save_golden(a, {"x": x, "old": torch.zeros(1).double()}, old, version=1)
    _save_golden(_golden(pytester, "test_b"), {"z": torch.ones(3).double()}, old, version=1)
    pytester.runpytest().assert_outcomes(passed=2)
    _module(pytester, scale=2.0)
    failed = pytester.runpytest()
    failed.assert_outcomes(failed=1, passed=1)
    failed.stdout.fnmatch_lines(["*does not record its torch-harmonics version (format 1*"])
    pytester.runpytest("--update-goldens").assert_outcomes(passed=2)
    provenance = GoldenStore(pytester.path).load(a)["provenance"]
    assert GoldenStore(pytester.path).load(a)["version"] == 2
    assert "torch_harmonics" in provenance


def test_an_unused_golden_is_pruned_after_a_whole_passing_run(pytester):
    _recorded(pytester, more="def test_c(golden):\n    golden.check({'c': torch.ones(1)})\n")
    c = _golden(pytester, "test_c")
    assert c.exists()
    _module(pytester)  # test_c is gone; its golden is not used any more
    listed = pytester.runpytest("-p", "no:cacheprovider")
    listed.assert_outcomes(passed=2)
    listed.stdout.fnmatch_lines(
        [
            "*= unused goldens =*",
            "1 golden file no test of this run used:",
            f"  {c}",
            "Delete them with --goldens-prune if their tests are gone (or restore the tests).",
        ]
    )
    assert c.exists()  # listed, not removed
    pruned = pytester.runpytest("-p", "no:cacheprovider", "--goldens-prune")
    pruned.assert_outcomes(passed=2)
    pruned.stdout.fnmatch_lines(
        [
            "1 golden file no test of this run used, removed (--goldens-prune):",
            f"  removed {c}",
            f"Commit the removal under {pytester.path / 'goldens'}.",
        ]
    )
    assert sorted(p.name for p in (pytester.path / "goldens").rglob("*.pt")) == [
        "test_a.pt",
        "test_b.pt",
    ]


FAILING = "def test_c():\n    assert False\n"
# ends the session, exit status 0, before test_d runs: nothing failed, yet not every test ran
STOPS = (
    "import pytest\n\ndef test_c():\n    pytest.exit('enough', returncode=0)\n\n"
    "def test_d():\n    pass\n"
)


@pytest.mark.parametrize(
    ("args", "more", "why"),
    [
        (["-k", "test_a"], "", "the run was partial (-k 'test_a')"),
        (
            ["test_review.py::test_a"],
            "",
            "the run was partial (node ids given: test_review.py::test_a)",
        ),
        ([], FAILING, "the run failed (1 test failed)"),
        (["-x"], FAILING, "the run failed (1 test failed)"),
        (["-m", "slow"], "", "the run was partial (-m 'slow')"),
        (["--deselect", "test_review.py::test_b"], "", "the run was partial (--deselect)"),
        (
            [],
            STOPS,
            "the run stopped early (1 of 4 collected tests did not run: -x, --maxfail or a "
            "lost worker)",
        ),
    ],
    ids=["-k", "node id", "failing", "-x", "-m", "--deselect", "pytest.exit"],
)
def test_prune_is_refused_after_a_partial_or_failing_run_and_says_why(pytester, args, more, why):
    _recorded(pytester)
    gone = pytester.path / "goldens" / "test_review" / "test_gone.pt"
    gone.write_bytes(_golden(pytester, "test_b").read_bytes())  # a test since deleted
    if more:
        _module(pytester, more=more)
    result = pytester.runpytest("-p", "no:cacheprovider", "--goldens-prune", *args)
    assert result.ret in (0, 1, 5)
    assert (
        f"unused goldens nothing pruned: {why}; they are only listed after a run in which "
        "every test ran and passed."
    ) in result.stdout.lines
    assert gone.exists()
    assert "removed" not in result.stdout.str()


def test_prune_is_refused_after_a_run_that_exits_non_zero_though_no_test_failed(pytester):
    # a run that collects no test (every test module emptied, a path that holds none) fails
    # no test and misses none it collected, yet used no golden: pruning would remove them all
    _recorded(pytester)
    pytester.makepyfile(test_review="import torch\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--goldens-prune")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    assert (
        "unused goldens nothing pruned: the run did not pass (exit status 5); they are only "
        "listed after a run in which every test ran and passed."
    ) in result.stdout.lines
    assert _golden(pytester, "test_a").exists() and _golden(pytester, "test_b").exists()


def test_unused_goldens_are_neither_listed_nor_pruned_after_a_partial_run_unless_asked(
    pytester,
):
    _recorded(pytester)
    gone = pytester.path / "goldens" / "test_review" / "test_gone.pt"
    gone.write_bytes(_golden(pytester, "test_b").read_bytes())
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "test_a")
    assert "unused goldens" not in result.stdout.str()  # not asked: nothing said
    result = pytester.runpytest("-p", "no:cacheprovider", "--goldens-unused", "-k", "test_a")
    result.stdout.fnmatch_lines(["unused goldens not listed: the run was partial (-k 'test_a')*"])
    assert gone.exists()


def test_a_run_of_one_file_judges_only_that_files_goldens(pytester):
    _recorded(pytester)
    other = pytester.path / "goldens" / "test_other" / "test_elsewhere.pt"
    other.parent.mkdir()
    other.write_bytes(_golden(pytester, "test_b").read_bytes())  # another file's test
    result = pytester.runpytest("-p", "no:cacheprovider", "--goldens-prune", "test_review.py")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["every golden file was used by a test of this run."])
    assert other.exists()


def test_prune_under_xdist_sees_every_workers_tests(pytester):
    pytest.importorskip("xdist")
    _recorded(pytester)
    gone = pytester.path / "goldens" / "test_review" / "test_gone.pt"
    gone.write_bytes(_golden(pytester, "test_b").read_bytes())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--goldens-prune")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"  removed {gone}"])
    assert not gone.exists() and _golden(pytester, "test_b").exists()


def test_goldens_of_an_ignored_directory_are_not_judged_unused(pytester):
    _recorded(pytester)
    slow = pytester.path / "slow"
    slow.mkdir()
    (slow / "test_slow.py").write_text(
        "import torch\n\ndef test_s(golden):\n    golden.check({'s': torch.ones(1)})\n"
    )
    pytester.runpytest("-p", "no:cacheprovider", "--update-goldens").assert_outcomes(passed=3)
    kept = pytester.path / "goldens" / "slow" / "test_slow" / "test_s.pt"
    gone = pytester.path / "goldens" / "test_review" / "test_gone.pt"
    gone.write_bytes(_golden(pytester, "test_b").read_bytes())
    result = pytester.runpytest("-p", "no:cacheprovider", "--goldens-prune", "--ignore=slow")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"  removed {gone}"])
    assert kept.exists() and not gone.exists()


# ---------------------------------------------------------------------- rollout goldens

ROLLOUT = """
from harness.steppers.sfno import SFNOCase

def test_roll(spatial):
    case = SFNOCase(nlat=16, nlon=32, embed=4, h=1, w=2)
    spatial.check(case, ranks=2, rollout={steps}, golden=True)
"""


def _edit_golden(path, edit):
    data = torch.load(path, weights_only=True)
    edit(data["tensors"])
    torch.save(data, path)


def test_a_rollout_golden_is_recorded_judged_per_step_and_summarised_on_update(pytester):
    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    pytester.makepyfile(test_r=ROLLOUT.format(steps=5))
    path = pytester.path / "goldens" / "test_r" / "test_roll.pt"
    run = ("-p", "no:cacheprovider", "--spatial-ranks=2")
    pytester.runpytest_subprocess(*run, "--update-goldens").assert_outcomes(passed=1)
    stored = torch.load(path, weights_only=True)["tensors"]
    rolled = [n for n in stored if n.startswith("rollout/")]
    assert rolled == [f"rollout/step{k}/state" for k in (0, 1, 2, 4)]
    # 2 x 2 x 16 x 32 = 2048 values over the cap of 1024: one in 3 (2 divides 32), 683 kept
    assert stored["rollout/step4/state"].shape == (683,)

    # a step moved far beyond rounding: the failure names the step and the field
    _edit_golden(path, lambda t: t["rollout/step2/state"].add_(1e-3))
    failed = pytester.runpytest_subprocess(*run)
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(
        [
            "*rollout/step2/state: rollout step 2 of 5, field 'state': max abs 0.001 over the "
            "bound * (10x the rounding spread * of 4 nudged reruns at this step, at least the "
            "field tolerance *"
        ]
    )
    # the update summary lists it among the changed tensors, by its step's bound
    updated = pytester.runpytest_subprocess(*run, "--update-goldens")
    updated.assert_outcomes(passed=1)
    updated.stdout.fnmatch_lines(
        [
            f"updated {path}: 1 changed, 0 added, 0 removed, * unchanged; largest change "
            "rollout/step2/state: max abs 0.001*",
            "  changed: rollout/step2/state (*x its step's bound)",
        ]
    )

    # a golden recorded before rollout goldens: one clear failure, saying to update
    _edit_golden(path, lambda t: [t.pop(n) for n in rolled])
    old = pytester.runpytest_subprocess(*run)
    old.assert_outcomes(failed=1)
    old.stdout.fnmatch_lines(
        ["  the golden has no rollout part, and this check rolls out 5 steps*--update-goldens*"]
    )
    assert "produced but not in the golden" not in old.stdout.str()


def test_an_unused_rollout_golden_is_listed_and_pruned_like_the_rest(pytester):
    from harness._records.samples import rollout_name

    _recorded(pytester)
    gone = pytester.path / "goldens" / "test_review" / "test_rolled_once.pt"
    _save_golden(
        gone,
        {"step0/loss": torch.ones(()), **{rollout_name(k, "x"): torch.ones(3) for k in (0, 1)}},
        {"rollout_steps": 2},
    )
    pruned = pytester.runpytest("-p", "no:cacheprovider", "--goldens-prune")
    pruned.assert_outcomes(passed=2)
    pruned.stdout.fnmatch_lines(
        [
            "1 golden file no test of this run used, removed (--goldens-prune):",
            f"  removed {gone}",
        ]
    )
    assert not gone.exists()
