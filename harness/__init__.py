"""harness: prove that a spatially parallel model computes what its reference computes.

The downstream contract::

    from harness import Outputs, Shard, SpatialCase, Topology, check_equivalence
"""

from harness._base.version import __version__
from harness.adopt import GroupMismatch, check_group
from harness.compare import Bound, Mismatch, Quantity, Tolerance
from harness.divergence import Divergence, Positions
from harness.equivalence import Outputs, Shard, SpatialCase, check_equivalence, data_share
from harness.errors import (
    ConfigError,
    EquivalenceFailure,
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
from harness.layouts import Layout, LayoutsReport, check_layouts
from harness.partition import CellPartition, LatLonPartition, cell_of, split_sizes
from harness.pool import PoolRegistry, RankPool, Runner
from harness.report import EquivalenceReport
from harness.rollout import RolloutPoint, RolloutRecord
from harness.topology import Topology

__all__ = [
    "Bound",
    "CellPartition",
    "ConfigError",
    "Divergence",
    "EquivalenceFailure",
    "EquivalenceReport",
    "GoldenError",
    "GoldenStore",
    "GroupMismatch",
    "HarnessError",
    "HarnessWarning",
    "LatLonPartition",
    "Layout",
    "LayoutsReport",
    "Mismatch",
    "Outputs",
    "PicklingProblem",
    "PoolRegistry",
    "Positions",
    "Quantity",
    "RankCrash",
    "RankDeadlock",
    "RankError",
    "RankFailure",
    "RankPending",
    "RankPool",
    "RankProblem",
    "RankTimeout",
    "RolloutPoint",
    "RolloutRecord",
    "Runner",
    "Shard",
    "SpatialCase",
    "Tolerance",
    "Topology",
    "UnwaitedWork",
    "__version__",
    "cell_of",
    "check_equivalence",
    "check_group",
    "check_layouts",
    "data_share",
    "split_sizes",
]
