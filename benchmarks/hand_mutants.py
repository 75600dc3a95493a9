"""How many hand-made mutants of the rollout, autocast, predict, rollout-golden, golden-change
and prune code the harness's own tests kill.

    python benchmarks/hand_mutants.py [--distributed] [-k autocast] [--list]

Each mutant is one text replacement in one module (its text must occur exactly once), made
in a copy of the repository (``.git`` left out) in a temporary directory; the module's fast
tests run there (``pytest -x``, that copy first on ``PYTHONPATH``, so the rank processes of
a distributed test import it too). A mutant is killed when a test fails (or the run hangs
past ``--timeout``), survives when they all pass. ``--distributed``: a survivor of the fast
tests that names distributed tests runs them too (a warm pool of ranks: minutes, not
seconds), and is killed if one fails.

Printed: each mutant's outcome and which stage killed it, then the score per area and in
all. A measurement, not a test (issue #36, item 6): the mutants are what an author could
plausibly get wrong here (a comparison flipped, a term dropped, the wrong rank, member or
field, max for min, an off-by-one), the survivors of the first count named first.
Exits 0 whatever the score.

Measured 2026-12-05, fast tests only (no ``--distributed``), the tests of e9f57a3 (``--rev``)
and after the tests of issue #36 item 6: rollout 3/11 -> 11/11, autocast 1/11 -> 11/11,
predict 3/10 -> 10/10, rollout goldens 3/6 -> 5/6, golden changes 2/6 -> 6/6, prune 0/3 ->
3/3; all 12/47 (25.5%) -> 46/47 (97.9%). The survivor, a field's sampling line taken from
its last stored step instead of its first, differs only for a field whose shape or dtype
changes during a rollout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("HARNESS_PYTHON", sys.executable)

ROLLOUT_UNIT = (
    "tests/unit/test_rollout.py",
    "tests/unit/test_autocast.py",
    "tests/unit/test_rollout_goldens.py",
)
ROLLOUT_DIST = ("tests/distributed/test_rollout.py", "tests/distributed/test_autocast.py")
AUTOCAST_UNIT = ("tests/unit/test_autocast.py", "tests/unit/test_rollout.py")
AUTOCAST_DIST = ("tests/distributed/test_autocast.py",)
# quickest first: ``pytest -x`` stops at the first failure, and the ring's 150-step
# rollouts of test_rollout_goldens.py take the longest
GOLDEN_UNIT = (
    "harness/_records/samples.py",  # its doctests
    "harness/goldens/_changes.py",
    "tests/unit/test_goldens.py",
    "tests/unit/test_rollout_goldens.py",
)
GOLDEN_DIST = ("tests/distributed/test_rollout_goldens.py",)
# the review file's rollout goldens start rank pools (minutes): only its unused/prune tests
# ("prun": pruning and prune)
PRUNE_UNIT = (
    "tests/unit/test_goldens.py",
    "tests/plugin/test_goldens_review.py",
    "-k",
    "prun or unused",
)


@dataclass(frozen=True)
class Mutant:
    area: str
    path: str
    old: str
    new: str
    what: str
    unit: tuple[str, ...]
    distributed: tuple[str, ...] = ()


def _m(area: str, path: str, old: str, new: str, what: str) -> Mutant:
    unit, dist = {
        "rollout": (ROLLOUT_UNIT, ROLLOUT_DIST),
        "autocast": (AUTOCAST_UNIT, AUTOCAST_DIST),
        "predict": (ROLLOUT_UNIT, ROLLOUT_DIST),
        "rollout goldens": (GOLDEN_UNIT, GOLDEN_DIST),
        "golden changes": (GOLDEN_UNIT, ()),
        "prune": (PRUNE_UNIT, ()),
    }[area]
    return Mutant(area, path, old, new, what, unit, dist)


R, A, P = "harness/rollout.py", "harness/equivalence/_autocast.py", "harness/_rank/predict.py"
G, S, C = (
    "harness/goldens/_rollout.py",
    "harness/_records/samples.py",
    "harness/goldens/_changes.py",
)
Q = "harness/plugin/session.py"
GS = "harness/goldens/__init__.py"

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- rollout
    _m(
        "rollout",
        R,
        "spread = max((_max_abs(_flat(m, shards), ref_values)",
        "spread = min((_max_abs(_flat(m, shards), ref_values)",
        "envelope from the nearest member, not the furthest",
    ),
    _m(
        "rollout",
        R,
        "max(factor * spread, floor), scale)",
        "factor * spread, scale)",
        "step envelope without its floor",
    ),
    _m(
        "rollout",
        R,
        "floor = bound.atol + bound.rtol * scale",
        "floor = bound.atol",
        "floor without its relative term",
    ),
    _m(
        "rollout",
        R,
        "scale = float(ref_values.abs().max())",
        "scale = float(ref_values.abs().min())",
        "field scale from the smallest value, not the largest",
    ),
    _m(
        "rollout",
        R,
        "for j in range(members)",
        "for j in [0] * members",
        "every ensemble member the same member (one nudge)",
    ),
    _m(
        "rollout",
        R,
        "call = (rollout_entry, case, given, steps, seed, autocast)",
        "call = (rollout_entry, case, given, steps, seed, None)",
        "ranks roll out without autocast, the reference with it",
    ),
    _m(
        "rollout",
        R,
        "shards = recs[g * spatial_size : (g + 1) * spatial_size]",
        "shards = recs[:spatial_size]",
        "every data group assembled from the first group's shards",
    ),
    _m(
        "rollout",
        R,
        "    if a.shape != b.shape:\n        return math.inf\n    if not a.numel():",
        "    if a.shape != b.shape:\n        return 0.0\n    if not a.numel():",
        "a shape mismatch is no distance",
    ),
    _m(
        "rollout",
        R,
        "            if n in broken or n in stopped:",
        "            if n in stopped:",
        "a field whose structure broke is judged by value too",
    ),
    _m(
        "rollout",
        R,
        "    keyed |= {n for fs in rank_fields for n, f in fs.items() if f.keyed}\n",
        "",
        "keyed only where the reference says so, not the ranks",
    ),
    _m(
        "rollout",
        R,
        "max_rel=first.error / first.scale if first.scale else math.inf",
        "max_rel=first.error if first.scale else math.inf",
        "the mismatch's max rel not divided by the field's scale",
    ),
    # ---------------------------------------------------------------- autocast
    _m(
        "autocast",
        A,
        "    with autocast_context(dtype):\n        return rank_entry(",
        "    with autocast_context(None):\n        return rank_entry(",
        "training ranks run without autocast, the serial reference with it",
    ),
    _m(
        "autocast",
        A,
        "        for rank, st in enumerate(steps):\n            yield Quantity.LOSS",
        "        for rank, st in enumerate(steps[:1]):\n            yield Quantity.LOSS",
        "loss and gradients judged on rank 0 only",
    ),
    _m(
        "autocast",
        A,
        "        for rank, st in enumerate(steps):\n            for n, v in h.params.items():",
        "        for rank, st in enumerate(steps[:1]):\n            for n, v in h.params.items():",
        "parameters judged on rank 0 only",
    ),
    _m(
        "autocast",
        A,
        "yield Quantity.FIELD, n, k, None, _flat(f, got), _flat(s.fields[n], got), p",
        "yield Quantity.FIELD, n, k, None, _flat(f, got), _flat(f, got), p",
        "a field's serial run taken from the high-precision run",
    ),
    _m(
        "autocast",
        A,
        "floor = bound.atol * math.sqrt(max(h.numel(), 1)) + bound.rtol * size",
        "floor = bound.atol + bound.rtol * size",
        "L2 floor not scaled by the tensor's size",
    ),
    _m(
        "autocast",
        A,
        "if math.isfinite(d_p) and d_p <= ratio * d_s + floor:",
        "if math.isfinite(d_p) and d_p <= ratio * d_s:",
        "ratio rule without its floor",
    ),
    _m(
        "autocast",
        A,
        "unit = float(torch.finfo(getattr(torch, dtype)).eps) / 2",
        "unit = float(torch.finfo(getattr(torch, dtype)).eps) * 2",
        "one rounding taken as 4x the unit roundoff",
    ),
    _m(
        "autocast",
        A,
        "if key in worst and not (r > worst[key].max_rel):",
        "if key in worst and not (r < worst[key].max_rel):",
        "the mismatch names the best rank, not the worst",
    ),
    _m(
        "autocast",
        A,
        "loss_zero = all(float(st.loss.abs()) == 0.0 for st in high.steps)",
        "loss_zero = any(float(st.loss.abs()) == 0.0 for st in high.steps)",
        "one zero loss makes the check vacuous",
    ),
    _m(
        "autocast",
        A,
        "        for st in high.steps[-1:]\n",
        "        for st in high.steps[:1]\n",
        "parameters moved judged after the first step, not the last",
    ),
    _m(
        "autocast",
        A,
        "report.mismatches[:0] = guard(high, case.label)",
        "report.mismatches[:0] = []",
        "the vacuous guard never reported",
    ),
    # ---------------------------------------------------------------- predict
    _m(
        "predict",
        P,
        "                    p.copy_(_nudged(p, self.generator))",
        "                    pass",
        "only the batch nudged, the parameters not",
    ),
    _m(
        "predict",
        P,
        "            batch = nudge.batch(batch)",
        "            batch = batch",
        "only the parameters nudged, the batch not",
    ),
    _m(
        "predict",
        P,
        "manual_seed(20_261_204 + 7919 * member)",
        "manual_seed(20_261_204)",
        "every member nudged alike (one generator seed)",
    ),
    _m(
        "predict",
        P,
        "sign = torch.randint(0, 2, t.shape",
        "sign = torch.randint(1, 2, t.shape",
        "every value nudged upwards (no random sign)",
    ),
    _m(
        "predict",
        P,
        "return t * (1 + NUDGE_ULPS * torch.finfo(real).eps * sign)",
        "return t * (1 + NUDGE_ULPS * torch.finfo(torch.float64).eps * sign)",
        "the nudge sized by float64's eps whatever the dtype",
    ),
    _m(
        "predict",
        P,
        "return t * (1 + NUDGE_ULPS * torch.finfo(real).eps * sign)",
        "return t * (1 + 10 * NUDGE_ULPS * torch.finfo(real).eps * sign)",
        "the nudge 10x too large",
    ),
    _m(
        "predict",
        P,
        "        with torch.no_grad(), autocast_context(autocast):",
        "        with torch.no_grad():",
        "predict never under autocast",
    ),
    _m(
        "predict",
        P,
        "    return run_prediction(case, topo, steps, seed, autocast=autocast, progress=",
        "    return run_prediction(case, topo, steps, seed, autocast=None, progress=",
        "the ranks' rollout never under autocast",
    ),
    _m(
        "predict",
        P,
        "    if len(out) != steps:",
        "    if len(out) < steps:",
        "predict returning too many steps accepted",
    ),
    _m(
        "predict",
        P,
        "        if not isinstance(fields, dict) or not fields:",
        "        if not isinstance(fields, dict):",
        "an empty step accepted",
    ),
    # ---------------------------------------------------------------- rollout goldens
    _m(
        "rollout goldens",
        G,
        "return max(self.factor * self.spread, self.floor)",
        "return self.factor * self.spread",
        "a step bound without its floor",
    ),
    _m(
        "rollout goldens",
        G,
        "field_bound.atol + field_bound.rtol * p.scale,",
        "field_bound.atol,",
        "a step's floor without its relative term",
    ),
    _m(
        "rollout goldens",
        G,
        "                record.factor,\n",
        "                1.0,\n",
        "a step bound of 1x the spread, not the check's factor",
    ),
    _m(
        "rollout goldens",
        S,
        "return (0, 0, name) if parsed is None else (1, parsed[0], parsed[1])",
        "return (0, 0, name) if parsed is None else (1, 0, name)",
        "a rollout's tensors ordered by name, not by step",
    ),
    _m(
        "rollout goldens",
        S,
        "    return max(steps) + 1 if steps else 0",
        "    return max(steps) if steps else 0",
        "a golden's rollout length one short",
    ),
    _m(
        "rollout goldens",
        S,
        "sampling.setdefault(\n                    name,",
        "sampling.__setitem__(\n                    name,",
        "a field's sampling said from its last stored step",
    ),
    # ---------------------------------------------------------------- golden changes
    _m(
        "golden changes",
        C,
        'return shown + (f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")',
        'return shown + (f", and {len(names) - _SHOWN} more" if len(names) >= _SHOWN else "")',
        "a list of exactly _SHOWN names says 'and 0 more'",
    ),
    _m(
        "golden changes",
        C,
        "if largest is None or (d.max_rel, d.max_abs) > (largest[2], largest[1]):",
        "if largest is None or (d.max_rel, d.max_abs) < (largest[2], largest[1]):",
        "the largest change is the smallest",
    ),
    _m(
        "golden changes",
        C,
        "if largest is None or (d.max_rel, d.max_abs) > (largest[2], largest[1]):",
        "if largest is None or (d.max_abs, d.max_rel) > (largest[1], largest[2]):",
        "the largest change by max abs, not max rel",
    ),
    _m(
        "golden changes",
        C,
        "bound if step is None else step.bound, allow_nonfinite=True",
        "bound, allow_nonfinite=True",
        "rollout tensors changed by the fixed tolerance, not their step's bound",
    ),
    _m(
        "golden changes",
        C,
        "        elif self.counts[GoldenStatus.MISSING] or self.counts[GoldenStatus.FAILED]:",
        "        elif self.counts[GoldenStatus.MISSING]:",
        "a failed golden not told to update",
    ),
    _m(
        "golden changes",
        C,
        "return f\"{len(items)} {noun}{'s' if len(items) != 1 else ''}\"",
        "return f\"{len(items)} {noun}{'s' if len(items) > 1 else ''}\"",
        "'0 tensor', not '0 tensors'",
    ),
    # ---------------------------------------------------------------- prune
    _m(
        "prune",
        Q,
        "if exitstatus != pytest.ExitCode.OK or self.failed:",
        "if self.failed:",
        "prune after a nonzero exit status with no test failed",
    ),
    _m(
        "prune",
        GS,
        "            parent = parent.parent\n    return lines",
        "            break\n    return lines",
        "only the golden's own directory removed, not the empty ones above it",
    ),
    _m(
        "prune",
        GS,
        "        while parent != root and root in parent.parents:",
        "        while root == parent or root in parent.parents:",
        "the goldens' root removed when pruning empties it",
    ),
]


def _copy(rev: str | None) -> Path:
    """The working tree (``rev`` None), or the tree of commit ``rev``, in a new directory."""
    where = Path(tempfile.mkdtemp(prefix="hand-mutant-"))
    if rev is None:
        skip = shutil.ignore_patterns(".git", "__pycache__", ".venv*", "*.egg-info", ".hypothesis")
        shutil.copytree(ROOT, where / "repo", ignore=skip)
    else:
        (where / "repo").mkdir()
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(where / "repo")], input=tar, check=True)
    return where / "repo"


def _tests(repo: Path, tests: tuple[str, ...], timeout: float) -> str:
    """The first test of ``tests`` that failed in ``repo`` ("timeout" if the run hung), or
    "" if they all passed."""
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
    # a test file the tree does not have yet (measuring an older commit) is left out
    tests = tuple(t for t in tests if t.startswith("-") or (repo / t).exists() or "/" not in t)
    cmd = [PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *tests]
    try:
        done = subprocess.run(
            cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    if done.returncode not in (0, 1):
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-5:])
        raise RuntimeError(f"pytest exited {done.returncode} (not a test outcome):\n{tail}")
    if done.returncode == 0:
        return ""
    failed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    return failed[0].split("::")[-1] if failed else "?"


def run(
    mutant: Mutant, distributed: bool, timeout: float, rev: str | None = None
) -> tuple[str, str]:
    """``unit`` or ``distributed`` (the stage that killed it) and the test that failed, or
    ``survived``."""
    repo = _copy(rev)
    try:
        target = repo / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            raise RuntimeError(
                f"{mutant.path}: the mutant's text occurs {text.count(mutant.old)} times "
                f"(not once): {mutant.what}"
            )
        target.write_text(text.replace(mutant.old, mutant.new))
        failed = _tests(repo, mutant.unit, timeout)
        if failed:
            return "unit", failed
        if distributed and mutant.distributed:
            failed = _tests(repo, mutant.distributed, 4 * timeout)
            if failed:
                return "distributed", failed
        return "survived", ""
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distributed", action="store_true", help="survivors' rank tests too")
    parser.add_argument("-k", dest="select", default="", help="only areas/whats containing it")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument(
        "--only", default="", help="only these mutants, by number (as --list numbers them): 1,4,7"
    )
    # generous: none of these mutants hangs, and on a loaded machine (load 60-150 on 2
    # cores) the fast tests took over 300 s, which read as kills ("by timeout")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per fast run")
    parser.add_argument("--rev", help="measure the tests of this commit (default: the worktree)")
    args = parser.parse_args()
    only = {int(n) for n in args.only.split(",") if n}
    chosen = [
        (i, m)
        for i, m in enumerate(MUTANTS, 1)
        if args.select in f"{m.area}: {m.what}" and (not only or i in only)
    ]
    if args.list:
        for i, m in chosen:
            print(f"{i:>3}  {m.area:<16} {m.path:<28} {m.what}")
        return
    outcomes: list[tuple[Mutant, str]] = []
    t0 = time.perf_counter()
    for i, m in chosen:
        outcome, by = run(m, args.distributed, args.timeout, args.rev)
        outcomes.append((m, outcome))
        mark = "killed" if outcome != "survived" else "SURVIVED"
        print(f"{i:>3}  {mark:<8} {outcome:<11} {m.area:<16} {m.what}", flush=True)
        if by:
            print(f"{'':<24} by {by}", flush=True)
    killed: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for m, outcome in outcomes:
        total[m.area] += 1
        killed[m.area] += outcome != "survived"
    print(f"\n{'area':<16} {'killed':>6} {'of':>4} {'score':>7}")
    for area in dict.fromkeys(m.area for m, _ in outcomes):
        print(f"{area:<16} {killed[area]:>6} {total[area]:>4} {_pct(killed[area], total[area])}")
    k, n = sum(killed.values()), sum(total.values())
    print(f"{'all':<16} {k:>6} {n:>4} {_pct(k, n)}")
    stage = "on" if args.distributed else "off"
    print(f"({time.perf_counter() - t0:.0f} s; distributed stage {stage})")


def _pct(k: int, n: int) -> str:
    return f"{100.0 * k / n:>6.1f}%" if n else "     -"


if __name__ == "__main__":
    main()
