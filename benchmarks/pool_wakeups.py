"""What one warm run costs the machine: wall, parent CPU, and every process's wake-ups.

    python benchmarks/pool_wakeups.py [--runs 200] [--baseline OTHER_CHECKOUT]

A 4-rank ``RankPool`` (forkserver) runs a trivial job (one ``all_reduce``) ``--runs`` times;
printed: the median and mean wall per run, the parent's CPU time and context switches (all
its threads) per run, and each rank's. On a loaded machine every wake-up waits for a core, so
fewer wake-ups per run is what keeps the harness's runs short beside other suites.
``--baseline``: the same measured with another checkout's harness, alternated with this one
(each in a process of its own), twice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def trivial() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _switches(pid: int) -> int:
    """Context switches of every thread of ``pid`` (voluntary: it slept and was woken)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def measure(runs: int) -> None:
    from harness import RankPool

    with RankPool(4, start_method="forkserver") as pool:
        for _ in range(5):
            pool.run(trivial)
        pids, me = pool.pids, os.getpid()
        cpu0, sw0 = [_cpu(p) for p in pids], [_switches(p) for p in pids]
        pcpu0, psw0 = time.process_time(), _switches(me)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            pool.run(trivial)
            times.append(time.perf_counter() - t0)
        time.sleep(0.3)  # the last run's ranks finish putting things back
        cpu1, sw1 = [_cpu(p) for p in pids], [_switches(p) for p in pids]
        pcpu, psw = time.process_time() - pcpu0, _switches(me) - psw0
    print(
        f"load {os.getloadavg()[0]:.1f}: median {statistics.median(times) * 1e3:.2f} ms, mean "
        f"{statistics.mean(times) * 1e3:.2f} ms; parent CPU {pcpu / runs * 1e3:.2f} ms, "
        f"{psw / runs:.1f} switches; ranks CPU "
        f"{[round((b - a) / runs * 1e3, 2) for a, b in zip(cpu0, cpu1)]} ms, switches "
        f"{[round((b - a) / runs, 1) for a, b in zip(sw0, sw1)]} a run",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--baseline", type=Path, default=None, metavar="CHECKOUT")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.baseline is None:
        measure(args.runs)
        return
    here = Path(__file__).resolve().parents[1]
    for _ in range(2):
        for label, kit in (("this checkout", here), ("baseline", args.baseline)):
            print(f"{label}: ", end="", flush=True)
            env = {**os.environ, "PYTHONPATH": str(kit)}
            cmd = [sys.executable, __file__, "--child", "--runs", str(args.runs)]
            subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
