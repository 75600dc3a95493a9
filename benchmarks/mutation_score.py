"""The mutation score of the checking code, after ``mutmut run`` (``tox -e mutation``).

    mutmut run --max-children 2 ; python benchmarks/mutation_score.py [--min 90]

Prints killed / survived / untested per file and per function, and the score
killed / (killed + survived + untested): a mutant that no test runs counts as surviving.
Timeouts count as killed (the mutant made a test hang, which fails it). Exits 1 when the
score is under ``--min``, so the tox env fails on a regression. docs/mutation.md records
the score and why each remaining survivor is harmless.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout", "segfault"}
SURVIVED = {"survived", "no tests", "suspicious"}
LINE = re.compile(
    r"^\s*(?P<module>[\w.]+)\.x[ƛǁ]?(?P<func>\w+?)__mutmut_(?P<n>\d+): (?P<status>.+)$"
)


def results() -> list[tuple[str, str, str]]:
    """(module, function, status) of every mutant mutmut knows."""
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            rows.append((m["module"], m["func"].replace("ǁ", "."), m["status"].strip()))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=float, default=90.0, help="lowest passing score, %%")
    parser.add_argument("--top", type=int, default=15, help="functions with most survivors")
    args = parser.parse_args(argv)
    rows = results()
    if not rows:
        print("no mutation results: run `mutmut run` first (tox -e mutation does both)")
        return 1
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    survivors: Counter[str] = Counter()
    for module, func, status in rows:
        kind = "killed" if status in KILLED else "survived" if status in SURVIVED else status
        per_file[module][kind] += 1
        if kind == "survived":
            survivors[f"{module}.{func}"] += 1
    print(f"{'file':<24} {'killed':>7} {'survived':>9} {'score':>7}")
    total = Counter[str]()
    for module, counts in sorted(per_file.items()):
        total.update(counts)
        print(f"{module:<24} {counts['killed']:>7} {counts['survived']:>9} {_score(counts):>6.1f}%")
    score = _score(total)
    print(f"{'all':<24} {total['killed']:>7} {total['survived']:>9} {score:>6.1f}%")
    if survivors:
        print("\nfunctions with most survivors (`mutmut show <name>` shows each):")
        for name, n in survivors.most_common(args.top):
            print(f"  {n:>4}  {name}")
    print(f"\nmutation score {score:.1f}% (minimum {args.min:g}%)")
    return 0 if score >= args.min else 1


def _score(counts: Counter[str]) -> float:
    tested = counts["killed"] + counts["survived"]
    return 100.0 * counts["killed"] / tested if tested else 0.0


if __name__ == "__main__":
    sys.exit(main())
