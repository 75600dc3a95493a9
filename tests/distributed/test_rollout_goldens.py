"""The built-in steppers' rollouts pinned by goldens: the reference's per-step fields of an
8-step inference rollout (steps 0, 1, 2, 4, 7; docs/goldens.md), beside the training
goldens of tests/distributed/test_sfno.py and test_healpix.py, which stay as they were.
Regenerate with --update-goldens."""

from __future__ import annotations

from harness.steppers.healpix import HealpixCase
from harness.steppers.sfno import SFNOCase

#: stores steps 0, 1, 2, 4 and 7: where the catalogue's inference faults enter (0, 1), and later
ROLLOUT = 8


def test_the_sfno_reference_rollout_still_matches_its_golden(spatial):
    # forced at each step (SFNOCase.predict); small sizes keep the golden small
    case = SFNOCase(nlat=12, nlon=20, embed=4, h=2, w=2)
    spatial.check(case, golden=True, ranks=4, rollout=ROLLOUT)


def test_the_healpix_reference_rollout_still_matches_its_golden(spatial):
    case = HealpixCase(nside=2, bounds=(0, 10, 10, 30, 48), batch_size=2)
    spatial.check(case, golden=True, ranks=4, rollout=ROLLOUT)
