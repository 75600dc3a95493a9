"""Mutants of the code behind a set of equivalence checks, without pytest.

What ``harness-check --mutants`` runs for the built-in steppers and the real-model adapters
(``pytest --spatial-mutants`` does the same for a test suite, ``harness.plugin.mutants``):
each check runs once as it is, its ranks recording the call sites they reach; then each
mutant of each site inside the chosen code (``include``: directories) reruns the checks that
reached it, fastest first, until one fails (``harness._mutation.campaign``). Same warm pool
throughout: no pool start per mutant, unless a mutant's hang or crash ended the processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from harness._mutation.campaign import Killed, Reached, campaign, verdict
from harness._mutation.catalogue import Outcome
from harness._mutation.mode import RECORD, MutantMode, running
from harness.equivalence import SpatialCase, check_equivalence
from harness.pool import RankPool

#: a mutant's rerun of a check gets at most this many seconds (or the whole timeout, if less)
RERUN_LIMIT = 30.0


@dataclass(frozen=True)
class Check:
    """One equivalence check to measure mutants with."""

    label: str
    make: Callable[[], SpatialCase]
    spatial_size: int | None = None


def run_mutants(
    checks: Sequence[Check],
    pool: RankPool,
    *,
    include: Sequence[str],
    timeout: float = 120.0,
    say: Callable[[str], None] = print,
) -> list[Outcome]:
    """Every mutant of every site the ``checks`` reach under the ``include`` directories,
    killed by the first check that fails with it, or survived."""
    roots = tuple(os.path.abspath(d) + os.sep for d in include)
    reached: Reached[Check] = Reached(lambda where: where.startswith(roots))
    with running(RECORD):
        for check in checks:
            report = check_equivalence(
                check.make(), ranks=pool.world_size, spatial_size=check.spatial_size,
                pool=pool, timeout=timeout, locate=False,
            )  # fmt: skip
            if not report.ok:
                say(f"  {check.label}: fails as it is ({', '.join(sorted(report.quantities))}): "
                    "left out of the mutants")  # fmt: skip
                continue
            reached.add(check, report.seconds, pool.last_sites)

    def rerun(check: Check, mode: MutantMode) -> Killed | None:
        report = check_equivalence(
            check.make(), ranks=pool.world_size, spatial_size=check.spatial_size,
            pool=pool, timeout=mode.timeout or timeout, locate=False,
        )  # fmt: skip
        return None if report.ok else Killed(check.label, ", ".join(sorted(report.quantities)))

    return campaign(
        reached,
        rerun,
        timeout=lambda _: min(timeout, RERUN_LIMIT),
        say=lambda o: say(f"  {o.mutant.label} at {o.location}: {verdict(o)}"),
    )
