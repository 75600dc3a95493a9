"""The fault catalogue (FAULTS.md): every fault is caught, with the quantity it names.

One table (harness.steppers.catalogue) drives this test, the main job's fault matrix and
FAULTS.md, the one copy of the fault table (docs/faults.md points to it), so they cannot
disagree. Each fault must make check_equivalence fail
with an expected quantity and a message naming the rank, the step and where; the same
layout without the fault must pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import check_equivalence
from harness.steppers import catalogue
from harness.steppers.catalogue import fault_matrix

RANKS = 4
HANG_TIMEOUT = 8  # seconds for faults caught as a hang: ample on a loaded 2-core machine
MATRIX = list(fault_matrix(RANKS))


@pytest.mark.parametrize(
    "entry", MATRIX, ids=[f"{stepper}:{fault}" for stepper, *_, fault, _ in MATRIX]
)
def test_each_fault_is_caught_with_its_quantity_and_a_message_that_locates_it(spatial, entry):
    stepper, make, kwargs, spatial_size, fault, expected = entry
    timeout = HANG_TIMEOUT if "deadlock" in expected else None
    report = check_equivalence(
        make(**kwargs, faults=(fault,)),
        ranks=RANKS,
        spatial_size=spatial_size,
        pool=spatial.pool(RANKS),
        timeout=timeout,
    )
    assert not report.ok, f"{stepper} {fault} went unnoticed"
    assert report.quantities & expected, report
    caught = next(m for m in report.mismatches if m.quantity in expected)
    assert caught.where, caught  # where: a position, a cell, a traceback's summary
    if caught.quantity in ("error", "crash", "timeout", "deadlock"):
        assert caught.rank is not None and caught.detail  # the rank and its traceback/stack
    else:
        # the step it first shows at; a parameter wrong right after build shows at build
        assert caught.step is not None or caught.quantity == "param"
        text = str(report)
        assert f"First: {report.mismatches[0].headline()}" in text and "What to do:" in text
    assert_located_where_the_fault_lives(report, catalogue.LOCATED[(stepper, fault)])


def assert_located_where_the_fault_lives(report, expected):
    found = report.first_divergence
    # the run raised or hung (its traceback says where), or only coverage failed (by key)
    if expected is None or expected == "coverage":
        assert found is None, found
        return
    assert found is not None, report
    if expected == "sync":  # a parameter's gradient departs alone: its synchronisation
        assert found.cause == "synchronisation" and found.quantity.startswith("grad '"), found
        assert found.located == f"gradient synchronisation of {found.name!r}", found.line()
    else:
        assert found.located == expected, found.line()
    lines = [line for line in str(report).splitlines() if line.startswith("First divergence:")]
    assert lines == [found.line()]


CLEAN = {
    (stepper, repr(sorted(kwargs.items())), spatial_size): (make, kwargs, spatial_size)
    for stepper, make, kwargs, spatial_size, _, _ in MATRIX
}


@pytest.mark.parametrize("key", sorted(CLEAN), ids=[f"{k[0]}:{k[1]}:{k[2]}" for k in sorted(CLEAN)])
def test_every_fault_layout_passes_without_its_fault_and_no_module_departs(spatial, key):
    make, kwargs, spatial_size = CLEAN[key]
    report = check_equivalence(
        make(**kwargs),
        ranks=RANKS,
        spatial_size=spatial_size,
        pool=spatial.pool(RANKS),
        locate=True,
    )
    assert report.ok, report
    assert report.first_divergence is None, report.first_divergence
    assert report.location is not None and report.location.compared > 0
    assert "First divergence" not in str(report)


ROOT = Path(__file__).resolve().parents[2]


def test_faults_md_is_the_catalogue_as_the_code_has_it():
    assert (ROOT / "FAULTS.md").read_text() == catalogue.document(), (
        "FAULTS.md drifted from harness/steppers/catalogue.py: "
        "python -m harness.steppers.catalogue > FAULTS.md"
    )


def test_the_fault_table_has_one_copy_in_faults_md_and_the_docs_page_points_to_it():
    page = (ROOT / "docs" / "faults.md").read_text()
    assert "](../FAULTS.md)" in page, "docs/faults.md must point to FAULTS.md"
    rows = catalogue.markdown_table()[2:] + catalogue.inference_table()[2:]
    copied = [row for row in rows if row in page]
    assert not copied, f"docs/faults.md copies FAULTS.md's table (keep one, in FAULTS.md): {copied}"


def test_every_fault_of_the_matrix_is_described_and_located():
    assert {(s, f) for s, *_, f, _ in MATRIX} == set(catalogue.DESCRIPTIONS)
    assert set(catalogue.LOCATED) == set(catalogue.DESCRIPTIONS)
