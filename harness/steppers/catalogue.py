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


def main_configs(ranks: int) -> list[tuple[str, Maker, dict[str, Any], int | None]]:
    """(label, case factory, kwargs, spatial_size) for each check of the main job."""
    out: list[tuple[str, Maker, dict[str, Any], int | None]] = [
        ("coupled-mlp", _mlp, {"npos": 37, "batch_size": 4}, None),
    ]
    if ranks % 2 == 0 and ranks > 2:
        out.append(("coupled-mlp s×d", _mlp, {"npos": 37, "batch_size": 4}, ranks // 2))
    return out


def fault_matrix(ranks: int) -> Iterator[tuple[str, Maker, dict[str, Any], int | None, str, set[str]]]:
    """(stepper, factory, kwargs, spatial_size, fault id, expected quantities) per fault."""
    for fault, expected in MLP_FAULTS.items():
        yield "coupled-mlp", _mlp, {"npos": 37}, None, fault, expected
