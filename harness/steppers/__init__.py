"""Built-in reference steppers: the harness's own test subjects, with switchable faults.

Importing this package is cheap: each stepper module is imported on first use of one of
its names, so ``import harness.steppers`` pulls in neither torch-harmonics nor healpy.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS = {
    "SFNO_FAULTS": "harness.steppers.sfno",
    "SFNOCase": "harness.steppers.sfno",
    "SFNOConfig": "harness.steppers.sfno",
    "SFNOStepper": "harness.steppers.sfno",
    "CoupledMLPCase": "harness.steppers.mlp",
    "HEALPIX_FAULTS": "harness.steppers.healpix",
    "HealpixCase": "harness.steppers.healpix",
    "HealpixStepper": "harness.steppers.healpix",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness.steppers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
