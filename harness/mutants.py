"""The mutant catalogue's older home: it is ``harness.mutation.catalogue`` now.

Kept so that ``from harness.mutants import ...`` goes on working.
"""

from __future__ import annotations

from harness.mutation.catalogue import (
    KINDS,
    REDUCING,
    Mutant,
    Outcome,
    Site,
    SiteStats,
    cannot_matter,
    merge_sites,
    mutants_for,
    quantity_of,
    score,
    score_line,
    table_rows,
)

__all__ = [
    "KINDS",
    "REDUCING",
    "Mutant",
    "Outcome",
    "Site",
    "SiteStats",
    "cannot_matter",
    "merge_sites",
    "mutants_for",
    "quantity_of",
    "score",
    "score_line",
    "table_rows",
]
