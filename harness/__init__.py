"""harness: prove that a spatially parallel model computes what its reference computes.

The downstream contract::

    from harness import Outputs, Shard, SpatialCase, Topology, check_equivalence
"""

from harness._version import __version__
from harness.compare import Bound, Mismatch, Quantity, Tolerance
from harness.equivalence import Outputs, Shard, SpatialCase, check_equivalence, data_share
from harness.errors import (
    ConfigError,
    GoldenError,
    HarnessError,
    HarnessWarning,
    PicklingProblem,
    RankCrash,
    RankDeadlock,
    RankError,
    RankFailure,
    RankPending,
    RankProblem,
    RankTimeout,
    UnwaitedWork,
)
from harness.goldens import GoldenStore
from harness.partition import CellPartition, LatLonPartition, cell_of, split_sizes
from harness.pool import PoolRegistry, RankPool, Runner
from harness.report import EquivalenceReport
from harness.topology import Topology

__all__ = [
    "Bound",
    "CellPartition",
    "ConfigError",
    "EquivalenceReport",
    "GoldenError",
    "GoldenStore",
    "HarnessError",
    "HarnessWarning",
    "LatLonPartition",
    "Mismatch",
    "Outputs",
    "PicklingProblem",
    "PoolRegistry",
    "Quantity",
    "RankCrash",
    "RankDeadlock",
    "RankError",
    "RankFailure",
    "RankPending",
    "RankPool",
    "RankProblem",
    "RankTimeout",
    "Runner",
    "Shard",
    "SpatialCase",
    "Tolerance",
    "Topology",
    "UnwaitedWork",
    "__version__",
    "cell_of",
    "check_equivalence",
    "data_share",
    "split_sizes",
]
