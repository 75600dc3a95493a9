"""The mutation campaign: one loop, whoever reruns the checks.

A first run of the checks records the call sites each reaches (``MutantMode(record=True)``);
``Reached`` keeps, per site inside the chosen code, the checks that reached it, fastest
first. ``campaign`` then takes each site in order and each of its mutants
(``catalogue.mutants_for``): one that ``cannot_matter`` there survives unrun, with the
reason; any other reruns the checks that reached the site, fastest first, in the mutant's
mode, until one fails (killed by it) or none does (SURVIVED).

What a check is and how it reruns is the caller's: ``harness-check --mutants`` reruns an
equivalence check (``harness.__main__.run_mutants``), ``pytest --spatial-mutants`` a test
item (``harness.plugin.mutants``); each passes its ``rerun``.

No torch, no pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from harness._mutation.catalogue import (
    Mutant,
    Outcome,
    Site,
    SiteStats,
    cannot_matter,
    merge_sites,
    mutants_for,
)
from harness._mutation.mode import MutantMode, running

T = TypeVar("T")


@dataclass(frozen=True)
class Killed:
    """A rerun that failed: which check (its name in the table) and how (``grad``,
    ``deadlock``, ``assert``...)."""

    by: str
    how: str


class Reached(Generic[T]):
    """The call sites the first run reached, and the checks that reached each one."""

    def __init__(self, inside: Callable[[str], bool]) -> None:
        self._inside = inside  # is a site in the code to mutate (not torch's, not a package's)
        self._recorded: list[Mapping[str, SiteStats]] = []
        self._checks: dict[str, list[tuple[float, T]]] = {}

    def add(self, check: T, seconds: float, recorded: Iterable[Mapping[str, SiteStats]]) -> None:
        """What one check's run recorded (one mapping per rank and run); ``seconds``: how
        long the check took as it is, to rerun the fastest first."""
        recorded = list(recorded)
        self._recorded += recorded
        for where in {w for stats in recorded for w in stats}:
            if self._inside(where):
                self._checks.setdefault(where, []).append((seconds, check))

    def sites(self) -> dict[str, Site]:
        """Each site inside the code, as every check and layout that reached it saw it."""
        return {w: s for w, s in merge_sites(self._recorded).items() if w in self._checks}

    def checks(self, where: str) -> list[tuple[float, T]]:
        """The checks that reached ``where``, fastest first (then in the order they ran)."""
        return sorted(self._checks.get(where, []), key=lambda c: c[0])


def campaign(
    reached: Reached[T],
    rerun: Callable[[T, MutantMode], Killed | None],
    *,
    timeout: Callable[[float], float | None] = lambda seconds: None,
    say: Callable[[Outcome], None] = lambda outcome: None,
) -> list[Outcome]:
    """Every mutant of every site ``reached``, killed by the first check whose ``rerun``
    fails in the mutant's mode, or survived. ``timeout``: a rerun's limit from its check's
    first seconds (``MutantMode.timeout``); ``say``: told each outcome as it is known."""
    sites = reached.sites()
    outcomes = []
    for where in sorted(sites):
        site = sites[where]
        for mutant in mutants_for(site):
            outcome = _measure(mutant, site, reached.checks(where), rerun, timeout)
            say(outcome)
            outcomes.append(outcome)
    return outcomes


def _measure(
    mutant: Mutant,
    site: Site,
    checks: list[tuple[float, T]],
    rerun: Callable[[T, MutantMode], Killed | None],
    timeout: Callable[[float], float | None],
) -> Outcome:
    reason = cannot_matter(mutant, site)
    if reason:
        return Outcome(mutant, site.location, reason=reason)
    for seconds, check in checks:
        mode = MutantMode(mutant=mutant, timeout=timeout(seconds))
        with running(mode):
            killed = rerun(check, mode)
        if killed is not None:
            return Outcome(mutant, site.location, killed_by=killed.by, quantity=killed.how)
    return Outcome(mutant, site.location)


def verdict(outcome: Outcome) -> str:
    """``"killed by <check> (<how>)"`` or ``"SURVIVED: <reason>"``: one line of progress."""
    if outcome.killed:
        return f"killed by {outcome.killed_by} ({outcome.quantity})"
    return "SURVIVED" + (f": {outcome.reason}" if outcome.reason else "")
