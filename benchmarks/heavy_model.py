"""A stand-in for a downstream model package with heavy dependencies (benchmarks only).

Real emulators pull in xarray, netCDF, hydra, torch-geometric...; this one imports packages
that are installed wherever the harness is (sympy with torch, astropy with healpy,
matplotlib with the test extra) and cost seconds to import, then defines a small case.
"""

from __future__ import annotations

import astropy.coordinates
import astropy.io.fits  # noqa: F401
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot
import sympy  # noqa: F401

from harness.steppers.mlp import CoupledMLPCase


class HeavyModelCase(CoupledMLPCase):
    """The coupled MLP, from a module whose import takes seconds."""

    name = "heavy-model"
