"""The harness against torch's own warm multi-process test base, ``MultiProcContinuousTest``.

    python benchmarks/peer.py [--quick] [--tests 200] [--wall-tests 400] [--check-tests 40]
                              [--rounds 3] [--burners 2] [--conditions quiet burners xdist pools]
                              [--baseline OTHER_CHECKOUT]

``torch.testing._internal.common_distributed.MultiProcContinuousTest`` is what a user would
pick instead of the harness: its rank processes are spawned once per test class and each
test is sent to them through a task queue. Needs ``expecttest`` (``pip install -e .[bench]``).

The same tests run through both, each as a pytest session of its own, as a user runs them,
the two kinds alternated within one run of this script (``--rounds`` times):

- trivial: one 4-rank ``all_reduce`` and its check, through ``spatial.run``, against the
  peer's test method doing the same;
- check: a small real check, ``spatial.check`` of the built-in coupled MLP (37 positions,
  2 SGD steps, float64), against a peer test that does the equivalent by hand: the
  reference on rank 0, broadcast, the partitioned run on every rank, and each rank comparing
  the loss, its block of the output field and the parameters with ``assert_close``.

Per test: the median time from the end of one test to the end of the next inside the
session (the start-up, spawning the peer's processes or the harness's pool, excluded).
Conditions: quiet; beside ``--burners`` CPU-burning processes; ``pytest -n 2`` (the wall of
the whole session, start-up included, as a CI job sees it); beside another suite's rank
pools (a second harness session, ``-n 2``, looping trivial spatial tests). The table prints
harness / peer / ratio per condition; ratio < 1 means the harness is faster. ``--quick``
(fewer tests, one round) finishes in under 3 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # this checkout: its harness is measured
sys.path.insert(0, str(HERE))  # benchmarks.pool_overhead: the same timing conftest and test

from benchmarks.pool_overhead import SPATIAL as HARNESS_TRIVIAL  # noqa: E402
from benchmarks.pool_overhead import TIMING  # noqa: E402

HARNESS_CHECK = """
from harness.steppers.mlp import CoupledMLPCase

CASE = CoupledMLPCase(npos=37, batch_size=4)
"""

PEER = """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests


class Peer(MultiProcContinuousTest):
    world_size = 4

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"
"""

PEER_TRIVIAL_TEST = """
    def test_{i}(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 4.0
"""

# The check by hand: what a user of the peer writes to compare the partitioned run with the
# reference (the case's own build/batch/forward, plain SGD, as the harness runs it).
PEER_CHECK = """
from harness.case import Shard
from harness.steppers.mlp import CoupledMLPCase, position_range
from harness.topology import Topology

CASE = CoupledMLPCase(npos=37, batch_size=4)


def run(topo, steps=2, lr=0.1, seed=0):
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        model = CASE.build(topo)
        losses, outs = [], []
        for step in range(steps):
            torch.manual_seed(seed + 1 + step)
            out = CASE.forward(model, CASE.batch(topo, step), topo)
            out.loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
                    p.grad = None
            losses.append(out.loss.detach())
            field = out.fields["out"]
            outs.append((field.values if isinstance(field, Shard) else field).detach())
        return losses, outs, {n: p.detach() for n, p in model.named_parameters()}
    finally:
        torch.set_default_dtype(torch.float32)


def check(rank):
    ref = [run(Topology.single()) if rank == 0 else None]
    dist.broadcast_object_list(ref, src=0)
    losses, outs, params = run(Topology.create())
    ref_losses, ref_outs, ref_params = ref[0]
    cols = position_range(CASE.npos, Topology.create())
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b[:, cols.start:cols.stop], rtol=1e-12, atol=1e-12)
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-12, atol=1e-12)
"""

PEER_CHECK_TEST = """
    def test_{i}(self):
        check(self.rank)
"""

# The other suite of the "beside other pools" condition: its own pools, its own sessions.
BACKGROUND = """
import torch, torch.distributed as dist

def few():
    t = torch.ones(64)
    for _ in range(3):
        dist.all_reduce(t)
    return t[0].item()
""" + "".join(f"\ndef test_{i}(spatial):\n    spatial.run(few)\n" for i in range(200))


def _harness_trivial(n: int) -> str:
    return HARNESS_TRIVIAL + "".join(
        f"\ndef test_{i}(spatial):\n    assert spatial.run(trivial) == [4.0] * 4\n"
        for i in range(n)
    )


def write_suites(folder: Path, tests: int, wall_tests: int, check_tests: int) -> None:
    """One folder per suite, each with the timing conftest: harness/peer x trivial/wall/check
    (wall: the trivial tests, as many as ``-n 2`` runs)."""
    suites = {
        "harness_trivial": _harness_trivial(tests),
        "harness_wall": _harness_trivial(wall_tests),
        "peer_wall": PEER + "".join(PEER_TRIVIAL_TEST.format(i=i) for i in range(wall_tests)),
        "harness_check": HARNESS_CHECK
        + "".join(
            f"\ndef test_{i}(spatial):\n    spatial.check(CASE)\n" for i in range(check_tests)
        ),
        "peer_trivial": PEER + "".join(PEER_TRIVIAL_TEST.format(i=i) for i in range(tests)),
        "peer_check": PEER_CHECK
        + PEER
        + "".join(PEER_CHECK_TEST.format(i=i) for i in range(check_tests)),
    }
    for name, text in suites.items():
        (folder / name).mkdir()
        (folder / name / "conftest.py").write_text(TIMING)
        (folder / name / f"test_{name}.py").write_text(text)
    (folder / "background").mkdir()
    (folder / "background" / "test_background.py").write_text(BACKGROUND)


def session(folder: Path, suite: str, *, workers: int = 0, harness: Path = HERE) -> float:
    """Run one suite as a pytest session: its per-test median (ms), or with ``workers`` the
    wall of the whole session (s), start-up included. ``harness``: the checkout whose
    ``harness`` package the session (and its ranks) import."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    args += ["--spatial-ranks", "4"] + (["-n", str(workers)] if workers else [])
    args.append(f"test_{suite}.py")
    t0 = time.perf_counter()
    out = subprocess.run(
        args, cwd=folder / suite, capture_output=True, text=True, env=_env(harness), timeout=900
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{suite} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    if workers:
        return wall
    found = re.search(r"PER-TEST ([0-9.]+)", out.stdout)
    if not found:
        raise SystemExit(f"{suite}: no timing\n{out.stdout[-4000:]}")
    return float(found.group(1))


def _env(harness: Path = HERE) -> dict[str, str]:
    env = dict(os.environ)  # that checkout's harness first, on every rank too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness), env.get("PYTHONPATH", "")) if p)
    return env


def _burn() -> None:
    while True:
        pass


@contextlib.contextmanager
def burners(n: int) -> Iterator[None]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_burn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


@contextlib.contextmanager
def other_pools(folder: Path) -> Iterator[None]:
    """Another harness suite (``-n 2``: two workers, a 4-rank pool each) looping beside."""
    script = (
        "import subprocess, sys\n"
        "while True:\n"
        "    subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',"
        " '-n', '2', 'test_background.py'], capture_output=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=folder / "background",
        env=_env(),
        start_new_session=True,  # its pytest and ranks are stopped with it, by group
    )
    time.sleep(8.0)  # its pools up and running before we measure
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


def condition(
    name: str, args: argparse.Namespace, folder: Path
) -> contextlib.AbstractContextManager[None]:
    if name == "burners":
        return burners(args.burners)
    if name == "pools":
        return other_pools(folder)
    return contextlib.nullcontext()


LABELS = {
    "quiet": "quiet",
    "burners": "{burners} CPU burners beside",
    "xdist": "pytest -n 2, wall of {n} tests",
    "pools": "beside another -n 2 harness suite",
}


Row = tuple[str, str, list[float], list[float], str, list[float]]


def measure(folder: Path, args: argparse.Namespace) -> list[Row]:
    rows = []
    for cond in args.conditions:
        for kind, n in (("trivial", args.tests), ("check", args.check_tests)):
            harness: list[float] = []
            peer: list[float] = []
            base: list[float] = []
            workers = 2 if cond == "xdist" else 0
            count = args.wall_tests if kind == "trivial" else n
            suite = "wall" if workers and kind == "trivial" else kind
            with condition(cond, args, folder):
                for r in range(args.rounds):
                    # alternated, and the order swapped each round: neither always goes first
                    order = ["harness", "peer"] + (["baseline"] if args.baseline else [])
                    for who in order if r % 2 == 0 else order[::-1]:
                        kit = args.baseline if who == "baseline" else HERE
                        suite_of = f"{'peer' if who == 'peer' else 'harness'}_{suite}"
                        got = session(folder, suite_of, workers=workers, harness=kit)
                        {"harness": harness, "peer": peer, "baseline": base}[who].append(got)
            unit = "s" if workers else "ms"
            label = LABELS[cond].format(burners=args.burners, n=count)
            rows.append((label, kind, harness, peer, unit, base))
            _print_row(rows[-1])
    return rows


def _fmt(xs: list[float], unit: str) -> str:
    med = statistics.median(xs)
    spread = f" ({min(xs):.1f}-{max(xs):.1f})" if len(xs) > 1 else ""
    return f"{med:.1f} {unit}{spread}"


def _print_row(row: Row) -> None:
    label, kind, h, p, unit, base = row
    ratio = statistics.median(h) / statistics.median(p)
    before = ""
    if base:
        before = f" {_fmt(base, unit)} | {statistics.median(base) / statistics.median(p):.2f}x |"
    print(
        f"| {label} | {kind} | {_fmt(h, unit)} | {_fmt(p, unit)} | {ratio:.2f}x |{before}"
        f" load {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tests, one round (< 3 min)")
    parser.add_argument("--tests", type=int, default=200, help="trivial tests per session")
    parser.add_argument("--wall-tests", type=int, default=400, help="trivial tests under -n 2")
    parser.add_argument("--check-tests", type=int, default=40, help="check tests per session")
    parser.add_argument("--rounds", type=int, default=3, help="alternations per condition")
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--conditions", nargs="+", default=list(LABELS), choices=list(LABELS))
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="another checkout of the harness (an older commit) to alternate with this one: "
        "two more columns, its figure and its ratio to the peer",
    )
    args = parser.parse_args()
    if args.quick:
        args.tests, args.wall_tests, args.check_tests, args.rounds = 40, 80, 8, 1
    try:
        import expecttest  # noqa: F401 - torch's test base needs it
    except ImportError:
        raise SystemExit(
            "MultiProcContinuousTest needs expecttest: pip install -e .[bench]"
        ) from None
    import torch

    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at "
        f"start; {args.tests} trivial / {args.check_tests} check tests a session, "
        f"{args.rounds} round(s)\n"
    )
    extra = " baseline | baseline ratio |" if args.baseline else ""
    print(f"| condition | test | harness | MultiProcContinuousTest | ratio |{extra}")
    print("|---|---|---|---|---|" + ("---|---|" if args.baseline else ""))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_suites(folder, args.tests, args.wall_tests, args.check_tests)
        t0 = time.perf_counter()
        measure(folder, args)
    print(f"\n{time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
