"""Findings in real models, kept as tests that fail the day the model is fixed.

A findings test runs the check and, when the report shows exactly the known upstream
symptom, raises ``UpstreamBug``; it is marked ``xfail(strict=True, raises=UpstreamBug)``, so
it fails on any other failure (a harness bug, another model bug) and on a pass (fixed
upstream: drop the mark and keep the test as a guard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness import EquivalenceReport, SpatialCase, check_equivalence
from harness.compare import Mismatch


class UpstreamBug(Exception):
    """The report shows the known upstream symptom."""


Symptom = Callable[[Mismatch, EquivalenceReport], bool]


def expect_upstream(report: EquivalenceReport, symptom: Symptom) -> None:
    """Raise ``UpstreamBug`` if the report's first mismatch is the symptom (given the first
    mismatch and the whole report); otherwise the check must pass."""
    first = report.mismatches[0] if report.mismatches else None
    if first is not None and symptom(first, report):
        raise UpstreamBug(first.headline())
    assert report.ok, report


def finding(spatial: Any, case: SpatialCase, ranks: int, symptom: Symptom) -> None:
    """Check ``case`` on ``ranks`` ranks; ``UpstreamBug`` if it shows the known symptom."""
    report = check_equivalence(case, ranks=ranks, pool=spatial.pool(ranks))
    expect_upstream(report, symptom)


def assert_fault_caught(spatial: Any, fault: tuple[Any, ...], ranks: int) -> None:
    """A ``fault_matrix`` entry: the check fails, first with one of the expected quantities."""
    _stepper, factory, kwargs, spatial_size, fault_id, expected = fault
    faults = (fault_id,)
    report = check_equivalence(
        factory(faults=faults, **kwargs),
        ranks=ranks,
        spatial_size=spatial_size,
        pool=spatial.pool(ranks),
    )
    assert not report.ok, f"{fault_id} not caught"
    assert report.mismatches[0].quantity in expected, str(report)


def upstream_bug(reason: str) -> Any:
    """The mark of a findings test: ``xfail(strict=True, raises=UpstreamBug, reason=...)``,
    the reason naming the model, its version and the cause."""
    return pytest.mark.xfail(strict=True, raises=UpstreamBug, reason=reason)
