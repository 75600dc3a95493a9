"""Findings in real models, kept as tests that fail the day the model is fixed.

A findings test runs the check and, when the report shows exactly the known upstream
symptom, raises ``UpstreamBug``; it is marked ``xfail(strict=True, raises=UpstreamBug)``, so
it fails on any other failure (a harness bug, another model bug) and on a pass (fixed
upstream: drop the mark and keep the test as a guard).
"""

from __future__ import annotations

from collections.abc import Callable

from harness import EquivalenceReport
from harness.compare import Mismatch


class UpstreamBug(Exception):
    """The report shows the known upstream symptom."""


def expect_upstream(report: EquivalenceReport, symptom: Callable[[Mismatch], bool]) -> None:
    """Raise ``UpstreamBug`` if the first mismatch is the symptom; else the check must pass."""
    first = report.mismatches[0] if report.mismatches else None
    if first is not None and symptom(first):
        raise UpstreamBug(first.headline())
    assert report.ok, report
