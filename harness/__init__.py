"""harness: prove that a spatially parallel model computes what its reference computes."""

from harness.errors import (
    ConfigError,
    GoldenError,
    HarnessError,
    PicklingProblem,
    RankCrash,
    RankError,
    RankFailure,
    RankProblem,
    RankTimeout,
)
from harness.pool import RankPool
from harness.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GoldenError",
    "HarnessError",
    "PicklingProblem",
    "RankCrash",
    "RankError",
    "RankFailure",
    "RankPool",
    "RankProblem",
    "RankTimeout",
    "Topology",
    "__version__",
]
