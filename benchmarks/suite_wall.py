"""Wall time of the test suite, and the peak memory of each rank process.

    python benchmarks/suite_wall.py [pytest args, default: tests/]

Runs ``pytest -n auto --spatial-ranks 4 --hypothesis-profile ci`` and, as the baseline in
the same run, ``pytest -n 0`` on the same tests, sampling every process of each run
(tagged through the environment) for its peak resident memory (VmHWM). Prints both wall
times, their ratio, and the peak memory of the largest rank process and of pytest itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path


def _tagged(tag: bytes) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag in (entry / "environ").read_bytes():
                    found[int(entry.name)] = (
                        (entry / "cmdline")
                        .read_bytes()
                        .decode("utf-8", "replace")
                        .replace("\0", " ")
                    )
            except OSError:
                continue
    return found


def _hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(args: list[str]) -> tuple[float, int, int, str]:
    tag = uuid.uuid4().hex
    env = dict(os.environ, HARNESS_BENCH_TAG=tag)
    peaks: dict[int, tuple[int, str]] = {}
    done = threading.Event()

    def sample() -> None:
        needle = f"HARNESS_BENCH_TAG={tag}".encode()
        while not done.is_set():
            for pid, cmd in _tagged(needle).items():
                kib = _hwm_kib(pid)
                if kib > peaks.get(pid, (0, ""))[0]:
                    peaks[pid] = (kib, cmd)
            time.sleep(0.5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    ranks = [kib for kib, cmd in peaks.values() if "forkserver" in cmd or "spawn" in cmd]
    pytests = [kib for kib, cmd in peaks.values() if "pytest" in cmd]
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return wall, max(ranks, default=0), max(pytests, default=0), last


def main() -> None:
    tests = sys.argv[1:] or ["tests/"]
    common = ["--spatial-ranks", "4", "--hypothesis-profile", "ci", *tests]
    print(f"tests: {' '.join(tests)}  ({os.cpu_count()} cores)\n")
    results = {}
    for label, extra in (("-n auto", ["-n", "auto"]), ("-n 0 (baseline)", ["-n", "0"])):
        wall, rank_kib, pytest_kib, last = run(extra + common)
        results[label] = wall
        print(
            f"{label:<16} wall {wall:7.1f} s   peak RSS: rank {rank_kib / 1024:6.0f} MiB, "
            f"pytest {pytest_kib / 1024:6.0f} MiB   [{last}]"
        )
    ratio = results["-n 0 (baseline)"] / results["-n auto"]
    print(f"\n-n auto is {ratio:.2f}x faster than -n 0 on this machine")


if __name__ == "__main__":
    main()
