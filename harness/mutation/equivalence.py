"""Mutants of the code behind a set of equivalence checks, without pytest.

What ``harness-check --mutants`` runs for the built-in steppers and the real-model adapters
(``pytest --spatial-mutants`` does the same for a test suite, ``harness.plugin.mutants``):
each check runs once as it is, its ranks recording the call sites they reach; then each
mutant of each site inside the chosen code (``include``: directories) reruns the checks that
reached it, fastest first, until one fails. Same warm pool throughout: no pool start per
mutant, unless a mutant's hang or crash ended the processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from harness.equivalence import SpatialCase, check_equivalence
from harness.mutation.catalogue import (
    Outcome,
    Site,
    SiteStats,
    cannot_matter,
    merge_sites,
    mutants_for,
)
from harness.pool import RankPool


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
    reached: list[dict[str, SiteStats]] = []
    checks_of: dict[str, list[tuple[float, Check]]] = {}
    roots = [os.path.abspath(d) + os.sep for d in include]
    pool.record_sites, pool.mutant = True, None
    try:
        for check in checks:
            report = check_equivalence(
                check.make(), ranks=pool.world_size, spatial_size=check.spatial_size,
                pool=pool, timeout=timeout, locate=False,
            )  # fmt: skip
            if not report.ok:
                say(f"  {check.label}: fails as it is ({', '.join(sorted(report.quantities))}): "
                    "left out of the mutants")  # fmt: skip
                continue
            reached += pool.last_sites
            for where in {w for stats in pool.last_sites for w in stats}:
                if any(where.startswith(r) for r in roots):
                    checks_of.setdefault(where, []).append((report.seconds, check))
    finally:
        pool.record_sites = False
    sites = {w: s for w, s in merge_sites(reached).items() if w in checks_of}
    outcomes = []
    try:
        for where in sorted(sites):
            ordered = [c for _, c in sorted(checks_of[where], key=lambda x: x[0])]
            for outcome in _site_outcomes(sites[where], ordered, pool, timeout):
                outcomes.append(outcome)
                verdict = (
                    f"killed by {outcome.killed_by} ({outcome.quantity})"
                    if outcome.killed
                    else "SURVIVED" + (f": {outcome.reason}" if outcome.reason else "")
                )
                say(f"  {outcome.mutant.label} at {outcome.location}: {verdict}")
    finally:
        pool.mutant = None
    return outcomes


def _site_outcomes(
    site: Site, checks: Sequence[Check], pool: RankPool, timeout: float
) -> list[Outcome]:
    out = []
    for mutant in mutants_for(site):
        reason = cannot_matter(mutant, site)
        if reason:
            out.append(Outcome(mutant, site.location, reason=reason))
            continue
        pool.mutant = mutant
        outcome = Outcome(mutant, site.location)
        for check in checks:
            report = check_equivalence(
                check.make(), ranks=pool.world_size, spatial_size=check.spatial_size,
                pool=pool, timeout=min(timeout, 30.0), locate=False,
            )  # fmt: skip
            if not report.ok:
                how = ", ".join(sorted(report.quantities))
                outcome = Outcome(mutant, site.location, check.label, how)
                break
        out.append(outcome)
    return out
