"""Which built-in stepper configurations the main job checks, and the fault matrix.

One table serves the main job (``harness-check``), the fault tests in ``tests/faults`` and
the README, so the three cannot disagree about what catches what.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from harness.equivalence import SpatialCase

Maker = Callable[..., SpatialCase]


def _mlp(**kw: Any) -> SpatialCase:
    from harness.steppers.mlp import CoupledMLPCase

    return CoupledMLPCase(**kw)


#: fault id -> (stepper label, quantities that FAULTS.md says catch it)
MLP_FAULTS: dict[str, set[str]] = {
    "no-grad-sync": {"grad", "sync"},
    "wrong-shard-index": {"field"},
    "non-differentiable-reduce": {"grad"},
}


def _sfno(**kw: Any) -> SpatialCase:
    from harness.steppers.sfno import SFNOCase

    return SFNOCase(**kw)


Config = tuple[str, Maker, dict[str, Any], int | None]
Fault = tuple[str, Maker, dict[str, Any], int | None, str, set[str]]


def _healpix(**kw: Any) -> SpatialCase:
    from harness.steppers.healpix import HealpixCase

    return HealpixCase(**kw)


def main_configs(ranks: int) -> list[Config]:
    """(label, case factory, kwargs, spatial_size) for each check of the main job."""
    import torch

    out: list[Config] = [("coupled-mlp", _mlp, {"npos": 37, "batch_size": 4}, None)]
    if ranks == 4:
        out += [
            ("sfno", _sfno, {"nlat": 16, "nlon": 32, "h": 2, "w": 2}, None),
            (
                "sfno uneven",
                _sfno,
                {"nlat": 30, "nlon": 62, "h": 4, "w": 1, "grid": "legendre-gauss", "noise": 1},
                None,
            ),
            (
                "sfno float32",
                _sfno,
                {"nlat": 16, "nlon": 32, "h": 1, "w": 4, "dtype": torch.float32},
                None,
            ),
            ("sfno s×d", _sfno, {"nlat": 16, "nlon": 32, "h": 2, "w": 1, "batch_size": 4}, 2),
        ]
        out += [
            ("healpix", _healpix, {"nside": 4}, None),
            (
                "healpix empty rank",
                _healpix,
                {"nside": 2, "bounds": (0, 20, 20, 30, 48), "empty_ranks": (3,)},
                None,
            ),
            ("healpix s×d", _healpix, {"nside": 2, "batch_size": 4}, 2),
        ]
    else:
        out.append(("sfno", _sfno, {"nlat": 16, "nlon": 32, "h": ranks, "w": 1}, None))
        out.append(("healpix", _healpix, {"nside": 2}, None))
    if ranks % 2 == 0 and ranks > 2:
        out.append(("coupled-mlp s×d", _mlp, {"npos": 37, "batch_size": 4}, ranks // 2))
    return out


def fault_matrix(ranks: int) -> Iterator[Fault]:
    """(stepper, factory, kwargs, spatial_size, fault id, expected quantities) per fault.

    The stepper layouts are sized for 4 ranks; with another count only the MLP's run.
    """
    for fault, expected in MLP_FAULTS.items():
        yield "coupled-mlp", _mlp, {"npos": 37}, None, fault, expected
    if ranks != 4:
        return
    from harness.steppers.sfno import FAULT_CHECKS

    for fault, (expected, kwargs, spatial_size) in FAULT_CHECKS.items():
        yield "sfno", _sfno, kwargs, spatial_size, fault, expected
    from harness.steppers.healpix import FAULT_CHECKS as HEALPIX_CHECKS

    for fault, (expected, kwargs, spatial_size) in HEALPIX_CHECKS.items():
        yield "healpix", _healpix, kwargs, spatial_size, fault, expected
