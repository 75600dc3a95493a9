"""The plugin as a user meets it: options, errors, fixtures, goldens, xdist, cleanup."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.pool import DEADLOCK_WINDOW, ProgressWatch, process_progress

DOWNSTREAM = """
import torch
from harness import Outputs, Shard, SpatialCase
from harness.collectives import reduce_loss, sync_gradients

BROKEN, SCALE = {broken}, {scale}

class Scale(SpatialCase):
    dtype = torch.float64

    def build(self, topo):
        model = torch.nn.Linear(3, 3)
        if not BROKEN:
            sync_gradients(model, topo)
        return model

    def batch(self, topo, step):
        x = torch.randn(8, 3) * SCALE
        n = 8 // topo.spatial_size
        return x[topo.spatial_rank * n:(topo.spatial_rank + 1) * n]

    def forward(self, model, x, topo):
        y = model(x)
        loss = reduce_loss((y ** 2).sum(), topo) / 24
        if topo.spatial_group is None:
            return Outputs(loss, {{"y": y}})
        n = x.shape[0]
        idx = torch.arange(topo.spatial_rank * n, (topo.spatial_rank + 1) * n)
        return Outputs(loss, {{"y": Shard(y, idx, dim=0)}})

def test_scale_is_equivalent(spatial):
    spatial.check(Scale(), golden=True)
"""


def downstream(*, broken: bool, scale: float = 1.0) -> str:
    """The downstream test module: gradients unsynchronised with ``broken``; the batch
    scaled by ``scale`` (so the reference, and with it a golden, changes)."""
    return DOWNSTREAM.format(broken=broken, scale=scale)


def _tag_env(tag: str) -> dict[str, str]:
    env = dict(os.environ)
    env["HARNESS_TEST_TAG"] = tag
    return env


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``tag``: the run's pytest and its rank processes."""
    found = []
    needle = f"HARNESS_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


#: A wait on a subprocess fails when nothing it started has made progress for this long (no
#: CPU time used, nothing runnable): a loaded machine slows a session, it never stops one.
STALL = 60.0


def _await(what: str, done: Callable[[], bool], proc: subprocess.Popen[bytes], tag: str) -> None:
    """Wait until ``done()``, for as long as the pytest ``proc`` or its ranks (``tag``) make
    progress; fail naming ``what`` if pytest exits first or everything stalls."""
    watch = ProgressWatch(STALL, fallback=10 * STALL)
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"{what}: pytest exited first (code {proc.returncode})")
        if watch.stalled([proc.pid, *_tagged_pids(tag)]):
            pytest.fail(f"{what}: pytest and its ranks made {watch.why()}")
        time.sleep(0.2)


def _wait_gone(tag: str, seconds: float = 30.0) -> list[int]:
    """Tagged processes still alive once they stopped getting anywhere: none runnable or
    exiting (state R or D) and none gone for ``seconds`` (rank watchdogs poll their owner
    every 0.5 s, so a survivor had its chances), or after 10 s of CPU time between them."""
    alive = _tagged_pids(tag)
    moved, cpu = time.monotonic(), 0
    while alive:
        time.sleep(0.2)
        now_alive = _tagged_pids(tag)
        samples = [process_progress(pid) for pid in now_alive]
        if len(now_alive) < len(alive) or any(s and s[0] in "RD" for s in samples):
            moved = time.monotonic()
        cpu = max(cpu, sum(s[1] for s in samples if s))
        alive = now_alive
        if time.monotonic() - moved > seconds or cpu > 10 * os.sysconf("SC_CLK_TCK"):
            break
    return alive


@pytest.mark.parametrize("value", ["0", "abc", "-2", "1.5"])
def test_a_bad_spatial_ranks_is_a_one_line_usage_error(pytester, value):
    result = pytester.runpytest(f"--spatial-ranks={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert errors == [
        f"ERROR: --spatial-ranks must be an integer >= 1, got '{value}'; e.g. --spatial-ranks 4"
    ]


def test_spatial_pin_ranks_reaches_every_pool_and_a_bad_one_is_a_one_line_usage_error(pytester):
    pytester.makepyfile("def test_mode(spatial):\n    assert spatial.pool(2).pin_ranks == 'off'\n")
    pytester.makeini("[pytest]\nspatial_pin_ranks = off\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nspatial_pin_ranks = always\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert errors == ["ERROR: spatial_pin_ranks must be one of auto, on, off, got 'always'"]


def test_far_more_ranks_than_cores_is_a_usage_error_that_says_how_to_insist(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--spatial-ranks=100000")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    (line,) = [line for line in result.errlines if line.strip()]
    assert line.startswith("ERROR: --spatial-ranks 100000: 100000 rank processes on a machine")
    assert line.endswith("Use fewer ranks, or pass --spatial-oversubscribe to insist.")
    result = pytester.runpytest("--spatial-ranks=100000", "--spatial-oversubscribe")
    result.assert_outcomes(passed=1)


def test_spatial_plots_without_matplotlib_is_refused_at_startup(pytester):
    pytester.makeconftest("import sys\nsys.modules['matplotlib'] = None  # not installed\n")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--spatial-plots=maps")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --spatial-plots needs matplotlib, which is not installed*drop --spatial-plots"]
    )


def test_an_unknown_marker_option_is_named(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.spatial(rank=2)
        def test_typo(spatial):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    assert (
        "@pytest.mark.spatial got unknown option(s) ['rank']; it takes ranks=, timeout= and fresh="
    ) in result.stdout.str()


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "0.001"])
def test_a_bad_deadlock_window_is_a_usage_error(pytester, value):
    result = pytester.runpytest(f"--spatial-deadlock-window={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: --spatial-deadlock-window must be a finite number of seconds >= 0.05 or 0 "
            f"(off), got '{value}'; e.g. --spatial-deadlock-window 1"
        ]
    )


def test_preload_and_deadlock_window_come_from_the_ini_file_and_show_in_the_header(pytester):
    pytester.makeini(
        "[pytest]\nspatial_preload =\n    json\n    email.mime\nspatial_deadlock_window = 0\n"
    )
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["harness: * deadlock detection off, preload json,email.mime, *"])
    result = pytester.runpytest("--spatial-preload=json,no_such_module_here")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--spatial-preload: no module named 'no_such_module_here'*"])


def test_a_preloaded_module_is_imported_once_before_the_ranks_fork(pytester):
    pytester.makeini("[pytest]\npythonpath = .\nspatial_preload = heavy_model\n")
    pytester.makepyfile(
        heavy_model="import os\nIMPORTED_IN = os.getpid()\n",
        test_preload="""
        import os

        def where_imported():
            import heavy_model
            return heavy_model.IMPORTED_IN, os.getppid()

        def test_preloaded(spatial):
            answers = spatial.run(where_imported, ranks=2)
            # imported in the fork server, the ranks' parent: once, not once per rank
            assert all(imported == parent for imported, parent in answers)
        """,
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


SLOW_BUT_CORRECT = """
import time
import pytest
import torch, torch.distributed as dist

def compute_then_reduce(rank, seconds):
    if dist.get_rank() == rank:
        time.sleep(seconds)          # waiting for a GPU, a slow disk...
    elif dist.get_rank() == (rank + 1) % 4:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            torch.randn(64, 64) @ torch.randn(64, 64)   # ...or really computing
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

@pytest.mark.parametrize("rank", range(4))
@pytest.mark.spatial(timeout=120)
def test_slow(spatial, rank):
    assert spatial.run(compute_then_reduce, rank, 4.0) == [4.0] * 4
"""


@pytest.mark.spatial_pool
def test_slow_but_correct_ranks_raise_no_false_deadlock_under_xdist(pytester):
    # 4 s of computing on some ranks, twice the detection window, while the others wait in
    # a collective; two xdist workers with 4 ranks each on a 2-core machine
    pytester.makepyfile(test_slow=SLOW_BUT_CORRECT)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


@pytest.mark.parametrize("value", ["soon", "inf", "nan", "1e-9", "0", "-1"])
def test_a_bad_timeout_is_a_usage_error(pytester, value):
    result = pytester.runpytest(f"--spatial-timeout={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: --spatial-timeout must be a finite number of seconds >= 1, got '{value}'; "
            "e.g. --spatial-timeout 120"
        ]
    )


@pytest.mark.parametrize(
    ("marker", "says"),
    [
        ("ranks=0", "@pytest.mark.spatial(ranks=0): ranks must be an integer >= 1, e.g. ranks=4"),
        (
            "ranks=2.5",
            "@pytest.mark.spatial(ranks=2.5): ranks must be an integer >= 1, e.g. ranks=4",
        ),
        (
            "ranks=True",
            "@pytest.mark.spatial(ranks=True): ranks must be an integer >= 1, e.g. ranks=4",
        ),
        (
            "timeout=-1",
            "@pytest.mark.spatial(timeout=-1): timeout must be a finite number of seconds >= 1, "
            "got -1; e.g. timeout=120",
        ),
        (
            "timeout='abc'",
            "@pytest.mark.spatial(timeout='abc'): timeout must be a finite number of seconds >= "
            "1, got 'abc'; e.g. timeout=120",
        ),
        (
            "timeout=float('inf')",
            "@pytest.mark.spatial(timeout=inf): timeout must be a finite number of seconds >= "
            "1, got inf; e.g. timeout=120",
        ),
    ],
    ids=["ranks-0", "ranks-float", "ranks-bool", "timeout-negative", "timeout-str", "timeout-inf"],
)
def test_a_bad_marker_option_is_one_clear_line_and_nothing_runs(pytester, marker, says):
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.spatial({marker})
        def test_marked(spatial):
            spatial.run(print)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([says])
    assert "Traceback" not in result.stdout.str()


def test_marker_ranks_obey_the_same_oversubscription_rule_as_the_command_line(pytester):
    cores = os.cpu_count() or 1
    too_many = max(8, 4 * cores) + 1
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.spatial(ranks={too_many})
        def test_marked(spatial):
            spatial.run(print)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"@pytest.mark.spatial(ranks={too_many}): {too_many} rank processes on a machine *"]
    )
    assert "pass --spatial-oversubscribe to insist" in result.stdout.str()


def test_the_ini_file_sets_defaults_and_the_header_shows_them(pytester):
    pytester.makeini("[pytest]\nspatial_ranks = 3\nspatial_timeout = 7\n")
    pytester.makepyfile("def test_ranks(spatial):\n    assert spatial.ranks == 3\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "harness: spatial ranks 3, backend gloo, start method forkserver, deadlock "
            f"detection after {DEADLOCK_WINDOW:g}s, timeout 7s, torch *"
        ]
    )


def test_the_marker_overrides_ranks_and_timeout(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.spatial(ranks=2, timeout=5)
        def test_marked(spatial):
            assert (spatial.ranks, spatial.timeout) == (2, 5)
        """
    )
    pytester.runpytest("--spatial-ranks=4").assert_outcomes(passed=1)


def test_a_downstream_case_passes_writes_its_golden_and_then_checks_it(pytester):
    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    pytester.makepyfile(test_down=downstream(broken=False))
    first = pytester.runpytest_subprocess("--spatial-ranks=2")
    first.assert_outcomes(failed=1)
    first.stdout.fnmatch_lines(["*no golden at*--update-goldens*"])

    update = pytester.runpytest_subprocess("--spatial-ranks=2", "--update-goldens")
    update.assert_outcomes(passed=1)
    update.stdout.fnmatch_lines(
        ["*spatial equivalence*", "*Scale*2*written*equivalent*", "*1 golden: 1 written.*"]
    )
    assert (pytester.path / "goldens" / "test_down" / "test_scale_is_equivalent.pt").exists()

    again = pytester.runpytest_subprocess("--spatial-ranks=2", "--goldens-unused")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["*1 golden: 1 passed.*", "*every golden file was used*"])


def test_a_broken_downstream_case_fails_with_the_table(pytester):
    pytester.makepyfile(test_down=downstream(broken=True))
    result = pytester.runpytest_subprocess("--spatial-ranks=2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Scale on 2 ranks*mismatch(es) with the reference*",
            "*First: rank 0: grad 'weight' at step 0*",
            "*quantity*name*step*rank*max abs*",
            "*sync*",
            "*What to do:*",
        ]
    )


def test_update_goldens_never_writes_the_golden_of_a_failing_check(pytester):
    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    pytester.makepyfile(test_down=downstream(broken=False))
    pytester.runpytest_subprocess("--spatial-ranks=2", "--update-goldens").assert_outcomes(passed=1)
    golden = pytester.path / "goldens" / "test_down" / "test_scale_is_equivalent.pt"
    before = golden.read_bytes()
    pytester.makepyfile(test_down=downstream(broken=True))
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "--update-goldens")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*1 golden: 1 not updated (check failed).*",
            "*Goldens are only written from passing, finite checks*",
        ]
    )
    assert "Review and commit" not in result.stdout.str()
    assert golden.read_bytes() == before  # the old golden is kept
    (golden.parent / "other.pt").unlink(missing_ok=True)
    golden.unlink()
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "--update-goldens")
    result.assert_outcomes(failed=1)
    assert not golden.exists()  # nor a new one


def test_a_golden_check_of_nonfinite_values_fails_and_is_never_written(pytester):
    pytester.makepyfile(
        """
        import torch

        def test_nan(golden):
            golden.check({"x": torch.tensor([1.0, float("nan")])})

        def test_declared(golden):
            golden.check({"x": torch.tensor([1.0, float("nan")])}, allow_nonfinite=True)
        """
    )
    result = pytester.runpytest("--update-goldens")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*x: this run produced 1 NaN of 2 (first at (1,))*",
            "*2 goldens: 1 written, 1 refused (not finite).*",
        ]
    )
    assert [p.name for p in (pytester.path / "goldens").rglob("*.pt")] == ["test_declared.pt"]


def test_a_leftover_of_an_interrupted_golden_write_is_removed_and_named(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    stale = pytester.path / "goldens" / "t" / ".x.pt.999999999.k2j3h4.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a golden")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*removed *.x.pt.999999999.k2j3h4.tmp: the temporary file of "
            "a golden write that was interrupted*"
        ]
    )
    assert not stale.exists()


def test_what_a_rank_prints_is_shown_with_a_failing_test(pytester):
    pytester.makepyfile(
        """
        import torch.distributed as dist

        def shout():
            print(f"hello from rank {dist.get_rank()}")
            return dist.get_rank()

        def test_prints(spatial):
            assert spatial.run(shout, ranks=2) == [0, 0]
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Captured rank 1 stdout call*", "hello from rank 1"])


def test_long_rank_output_is_cut_in_the_report_and_saved_whole(pytester):
    pytester.makepyfile(
        """
        import torch.distributed as dist

        def chatty():
            for i in range(5000):
                print(f"rank {dist.get_rank()} line {i}")
            return dist.get_rank()

        def test_chatty(spatial):
            assert spatial.run(chatty, ranks=2) == [0, 0]
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank 1 line 0\n" in out and "rank 1 line 4999" in out  # head and tail kept
    assert "rank 1 line 2500\n" not in out  # the middle cut
    saved = re.search(r"characters\) is in (\S+\.rank1\.txt) \.\.\.", out)
    assert saved, out[-2000:]
    whole = Path(saved.group(1)).read_text()
    assert whole.count("\n") == 5000 and "rank 1 line 2500\n" in whole


def test_a_spatial_test_that_never_runs_anything_is_warned_about(pytester):
    pytester.makepyfile(
        """
        def test_forgot(spatial):
            assert spatial.ranks == 4

        def test_used(spatial):
            spatial.pool(2)
        """
    )
    # in a subprocess: in-process, whether pytest can still rewrite the already imported
    # harness depends on which test this xdist worker ran before (a warning of its own)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*test_forgot*",
            "*SpatialUnusedWarning: this test takes the "
            "spatial fixture but never ran anything on the ranks*",
        ]
    )


def test_a_spatial_test_that_skips_itself_before_the_ranks_is_not_warned_about(pytester):
    pytester.makepyfile(
        """
        import pytest

        def test_skips(spatial):
            pytest.skip("needs 4 ranks")

        @pytest.mark.xfail(reason="known", strict=True)
        def test_xfails(spatial):
            raise AssertionError
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1, xfailed=1)
    assert "SpatialUnusedWarning" not in result.stdout.str()


def test_goldens_are_counted_on_the_controller_under_xdist(pytester):
    pytester.makepyfile(
        **{
            f"test_g{i}": textwrap.dedent(
                f"""
                import torch

                def test_a(golden):
                    golden.check({{"x": torch.arange(3.0) * {i}}})

                def test_b(golden):
                    golden.check({{"y": torch.ones(2)}}, name="other")
                """
            )
            for i in range(3)
        }
    )
    result = pytester.runpytest_subprocess("-n", "2", "--update-goldens")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["*6 goldens: 6 written.*"])
    assert len(list((pytester.path / "goldens").rglob("*.pt"))) == 6


def test_spatial_runs_under_xdist_with_a_pool_per_worker(pytester):
    pytester.makepyfile(
        """
        import pytest
        import torch, torch.distributed as dist

        def total():
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        @pytest.mark.parametrize("i", range(4))
        def test_sum(spatial, i):
            assert spatial.run(total) == [4.0] * 4
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "--spatial-ranks=4")
    result.assert_outcomes(passed=4)


HANG = """
import time
import pytest
import torch, torch.distributed as dist

def hang():
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))
    return 0

@pytest.mark.spatial(timeout={timeout})
def test_hang(spatial):
    spatial.run(hang)

def test_next(spatial):
    assert spatial.run(dist.get_rank) == [0, 1, 2, 3]
"""


#: a run that is never proven deadlocked (rank 0 is only late, for ever): it stays up until
#: the timeout, so a test can interrupt or kill pytest while its ranks are busy
LATE_FOREVER = """
import time
import pytest
import torch, torch.distributed as dist

def late():
    open("entered-%d" % dist.get_rank(), "w").close()  # the test waits for this, not a clock
    if dist.get_rank() == 0:
        time.sleep(1000)
    dist.all_reduce(torch.ones(1))
    return 0

@pytest.mark.spatial(timeout={timeout})
def test_hang(spatial):
    spatial.run(late)
"""


def test_a_deadlock_fails_before_the_timeout_the_next_test_passes_and_no_rank_survives(pytester):
    pytester.makepyfile(test_hang=HANG.format(timeout=60))
    tag = uuid.uuid4().hex
    # "before the 60s timeout" is the proof's own word (the board's evidence, not a clock);
    # a wall-clock bound here would only measure the machine's load
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_hang.py"],
        cwd=pytester.path,
        env=_tag_env(tag),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out
    assert "run deadlocked on rank 1/4, 2/4, 3/4 (found " in out
    assert "before the 60s timeout): they wait for rank 0/4, which returned without" in out
    assert out.count("in hang") >= 3  # each waiting rank's stack names the function
    assert _wait_gone(tag) == []


#: pytest as a terminal starts it, with Ctrl-C live: a shell that runs CI in the background
#: (``.ci/run &``) starts it with SIGINT ignored, every process below inherits that, and
#: Python then installs no KeyboardInterrupt handler (this test waited for ever there)
LIVE_CTRL_C = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.console_main())"
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_a_cancelled_job_leaves_no_rank_and_no_directory_behind(pytester, sig):
    # a timeout no loaded runner reaches before the signal: the run is interrupted, not over
    pytester.makepyfile(test_hang=LATE_FOREVER.format(timeout=3600))
    tag = uuid.uuid4().hex
    tmp = Path(tempfile.mkdtemp(prefix="hk-"))  # short: the fork server's socket lives there
    log = pytester.path / "session.log"  # a file, not a pipe nobody reads while we wait
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LIVE_CTRL_C, "-p", "no:cacheprovider", "test_hang.py"],
            cwd=pytester.path,
            env={**_tag_env(tag), "TMPDIR": str(tmp)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    # No start deadline: the ranks start as slowly as the machine lets them (minutes at load
    # 30-50); each says it is inside the run's function with a file, then waits (rank 0
    # sleeps, the others wait for it in the all_reduce).
    entered = [pytester.path / f"entered-{r}" for r in range(4)]
    _await("the ranks entering the run", lambda: all(p.exists() for p in entered), proc, tag)
    proc.send_signal(sig)
    _await("pytest ending after the signal", lambda: proc.poll() is not None, proc, tag)
    assert b"KeyboardInterrupt" in log.read_bytes()  # stopped as on Ctrl-C: the session ended
    assert _wait_gone(tag) == []
    ours = [p.name for p in tmp.iterdir() if p.name.startswith(("harness-", "pymp-"))]
    assert ours == []  # no pool directory, no fork server socket directory
    shutil.rmtree(tmp, ignore_errors=True)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _exited(pid: int) -> bool:
    """Gone, or a zombie (exited, waiting for whoever adopted it to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigkill_of_pytest_leaves_no_rank_and_no_fork_server_behind(pytester):
    pytester.makepyfile(test_hang=LATE_FOREVER.format(timeout=100))
    tag = uuid.uuid4().hex
    # where the pool makes its directory; short: the fork server's socket lives there too
    tmp = Path(tempfile.mkdtemp(prefix="hk-"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_hang.py"],
        cwd=pytester.path,
        env={**_tag_env(tag), "TMPDIR": str(tmp)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(_tagged_pids(tag)) < 6 and time.monotonic() < deadline:  # + fork server
        time.sleep(0.2)
    assert len(_tagged_pids(tag)) >= 6, "ranks never started"
    (server,) = [
        pid
        for pid in _tagged_pids(tag)  # pytest's child; the ranks are its children
        if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes() and _parent(pid) == proc.pid
    ]
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    # The fork server sees EOF at once; it used to spend seconds tearing torch down (6-10 s
    # on a loaded machine, >= 1.5 s idle), outliving the session. Now it exits at once: a
    # liveness bound, with a wide margin over the ~0.1 s it takes.
    t0 = time.monotonic()
    while not _exited(server) and time.monotonic() - t0 < 1.0:
        time.sleep(0.02)
    assert _exited(server), "the fork server outlived its session"
    assert _wait_gone(tag, seconds=5.0) == []  # ranks poll their owner every 0.5 s
    assert list(tmp.glob("harness-pool*")) == []  # the ranks took the pool's directory along
    shutil.rmtree(tmp, ignore_errors=True)


ERROR_MAPS = """
from harness.steppers.healpix import HealpixCase
from harness.steppers.sfno import SFNOCase

def test_healpix_rank_order(spatial):
    spatial.check(HealpixCase(nside=2, faults=("rank-order",)))

def test_sfno_per_rank_noise(spatial):
    spatial.check(SFNOCase(nlat=12, nlon=20, h=2, w=2, noise=1, faults=("per-rank-noise",)))
"""


def test_spatial_plots_writes_an_error_map_per_failing_field_and_names_it(pytester):
    pytest.importorskip("matplotlib")
    pytester.makepyfile(test_maps=ERROR_MAPS)
    result = pytester.runpytest_subprocess("--spatial-ranks=4", "--spatial-plots=maps")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*Error maps:*", "*maps/test_maps.test_healpix_rank_order.*png"])
    maps = sorted(p.name for p in (pytester.path / "maps").glob("*.png"))
    healpix = "test_maps.test_healpix_rank_order.prediction.step0"
    assert any(name.startswith(healpix) for name in maps)
    assert any(name.startswith("test_maps.test_sfno_per_rank_noise.") for name in maps)
    for name in maps:
        assert (pytester.path / "maps" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_table_fits_the_terminal_shortening_a_long_partition(pytester, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    long_describe = downstream(broken=False).replace(
        "class Scale(SpatialCase):",
        "class Scale(SpatialCase):\n    def describe(self, topo=None):\n        return 'x' * 150\n",
    )
    pytester.makepyfile(test_down=long_describe.replace("golden=True", "golden=False"))
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    table = result.stdout.lines[
        result.stdout.lines.index(
            next(line for line in result.stdout.lines if line.startswith("worst relative error"))
        ) :
    ][:4]
    assert len(table) == 4 and max(map(len, table)) <= 100, table
    assert "xxx..." in table[3]


def test_a_rank_failure_is_reported_without_the_harness_own_frames(pytester):
    pytester.makepyfile(
        test_fails="""
        import torch, torch.distributed as dist

        def check_halo():
            if dist.get_rank() == 2:
                raise ValueError("halo of the wrong width")
            dist.all_reduce(torch.ones(1))

        def test_halo(spatial):
            spatial.run(check_halo)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank 2/4 raised ValueError: halo of the wrong width" in out
    assert 'raise ValueError("halo of the wrong width")' in out  # the rank's own line
    for plumbing in ("_run.py", "_rank/", "pool.py", "plugin/"):
        assert f"harness/{plumbing}" not in out, plumbing


def test_a_module_the_ranks_cannot_import_is_reported_with_its_own_frames_only(pytester):
    """The ranks load the test's module by its file; when that raises on a rank (here: only
    in a process that multiprocessing started), the rank says it could not load the function,
    and its traceback is the module's, not the rank loop's that loaded it."""
    pytester.makepyfile(
        test_loads="""
        import multiprocessing

        if multiprocessing.parent_process() is not None:  # a rank, not pytest
            raise ImportError("the site config is missing on this node")

        def check():
            pass

        def test_loads(spatial):
            spatial.run(check, ranks=2)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "could not load the rank function on rank 0" in out
    assert 'raise ImportError("the site config is missing on this node")' in out
    for plumbing in ("_run.py", "_rank/", "pool.py", "plugin/"):
        assert f"harness/{plumbing}" not in out, plumbing


def test_a_module_that_failed_to_load_on_a_warm_rank_is_loaded_again_on_the_next_run(pytester):
    """A half-run module must not stay in a warm rank's ``sys.modules`` (Python's own import
    removes it): once the cause is gone (here a flag file the second test writes), the next
    run loads it afresh instead of failing on the stand-in's missing function."""
    pytester.makepyfile(
        test_reloads="""
        import multiprocessing, os, pathlib

        FLAG = pathlib.Path(__file__).with_name("configured")
        if multiprocessing.parent_process() is not None and not FLAG.exists():
            raise ImportError("not configured yet")

        def check():
            return 1

        def test_first(spatial):
            spatial.run(check, ranks=2)

        def test_second(spatial):
            FLAG.touch()
            assert spatial.run(check, ranks=2) == [1, 1]
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*_ test_first _*", "*could not load the rank function*ImportError('not configured yet')*"]
    )


def test_a_failing_check_whose_golden_also_fails_says_both(pytester):
    pytester.makeini("[pytest]\ngolden_dir = goldens\n")
    pytester.makepyfile(test_down=downstream(broken=False))
    pytester.runpytest_subprocess("--spatial-ranks=2", "--update-goldens").assert_outcomes(passed=1)
    # the gradients go unsynchronised (the check fails) and the reference changes (the
    # golden fails): the failure says both, the report first
    pytester.makepyfile(test_down=downstream(broken=True, scale=2.0))
    result = pytester.runpytest_subprocess("--spatial-ranks=2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Scale on 2 ranks*mismatch(es) with the reference*",
            "*What to do:*",
            "*The golden check failed too:*",
            "*golden *test_scale_is_equivalent.pt: failed*",
        ]
    )
    # a golden that cannot be read is said with the failing check's report too
    golden = pytester.path / "goldens" / "test_down" / "test_scale_is_equivalent.pt"
    golden.write_bytes(b"not a golden")
    result = pytester.runpytest_subprocess("--spatial-ranks=2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Scale on 2 ranks*mismatch(es) with the reference*",
            "*The golden check failed too:*",
            "*golden *test_scale_is_equivalent.pt cannot be read*",
        ]
    )


HYPOTHESIS_REPORT = """
from hypothesis import HealthCheck, given, settings, strategies as st
from harness import check_equivalence
from test_down import Scale

@settings(
    max_examples=2,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.integers(0, 1))
def test_drawn(spatial, n):
    report = check_equivalence(Scale(), ranks=2, pool=spatial.pool(2))
    report.raise_if_failed()
"""


def test_raise_if_failed_fails_a_hypothesis_test_with_the_whole_report(pytester):
    pytester.makepyfile(
        test_down=downstream(broken=True).split("def test_")[0],
        test_drawn=HYPOTHESIS_REPORT,
    )
    result = pytester.runpytest_subprocess("--spatial-ranks=2")
    result.assert_outcomes(failed=1)
    # every part of the report, to its last line, and counted as a failure (an
    # AssertionError), with the user's line as the last frame, not the harness's
    result.stdout.fnmatch_lines(
        [
            "*report.raise_if_failed()",
            "E*EquivalenceFailure: Scale on 2 ranks*mismatch(es) with the reference",
            "E*First: rank 0: grad 'weight' at step 0*",
            "E*quantity*name*step*rank*max abs*",
            "E*What to do:*",
            "E*sync: Ranks of one spatial group hold different parameters*",
        ]
    )
    assert "raise EquivalenceFailure" not in result.stdout.str()
