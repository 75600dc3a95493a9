"""The catalogue's faults that live only in inference: a training check passes them, a
rollout check fails at the step where each enters, naming it and the field."""

from __future__ import annotations

import pytest

from harness import check_equivalence
from harness.steppers import catalogue
from harness.steppers.catalogue import INFERENCE_ROLLOUT, inference_matrix

RANKS = 4
MATRIX = list(inference_matrix(RANKS))
IDS = [f"{stepper}:{fault}" for stepper, *_, fault, _ in MATRIX]

pytestmark = pytest.mark.assumes_ranks(RANKS)


@pytest.mark.parametrize("entry", MATRIX, ids=IDS)
def test_an_inference_fault_is_caught_by_a_rollout_at_the_step_where_it_enters(spatial, entry):
    _, make, kwargs, spatial_size, fault, enters = entry
    report = check_equivalence(
        make(**kwargs, faults=(fault,)),
        ranks=RANKS,
        spatial_size=spatial_size,
        pool=spatial.pool(RANKS),
        rollout=INFERENCE_ROLLOUT,
    )
    # the training steps stay equivalent: only the rollout shows it
    assert report.quantities == {"rollout"}, report
    first = report.rollout.first
    assert first is not None and first.step == enters, report
    assert first.name in ("state", "forecast")  # the field the stepper predicts
    assert (
        f"First divergent step: step {enters} of {INFERENCE_ROLLOUT}, field '{first.name}'"
        in str(report)
    )


@pytest.mark.parametrize("entry", MATRIX, ids=IDS)
def test_an_inference_fault_passes_the_training_check(spatial, entry):
    _, make, kwargs, spatial_size, fault, _ = entry
    report = check_equivalence(
        make(**kwargs, faults=(fault,)),
        ranks=RANKS,
        spatial_size=spatial_size,
        pool=spatial.pool(RANKS),
    )
    assert report.ok, report


CLEAN = {(s, repr(sorted(kw.items()))): (make, kw) for s, make, kw, *_ in MATRIX}


@pytest.mark.parametrize("key", sorted(CLEAN), ids=[f"{k[0]}:{k[1]}" for k in sorted(CLEAN)])
def test_every_inference_fault_layout_rolls_out_equivalent_without_its_fault(spatial, key):
    make, kwargs = CLEAN[key]
    report = check_equivalence(
        make(**kwargs), ranks=RANKS, pool=spatial.pool(RANKS), rollout=INFERENCE_ROLLOUT
    )
    assert report.ok, report
    assert report.rollout is not None and len(report.rollout.curve) >= INFERENCE_ROLLOUT


def test_every_inference_fault_is_described():
    assert {(s, f) for s, *_, f, _ in MATRIX} == set(catalogue.INFERENCE_DESCRIPTIONS)
