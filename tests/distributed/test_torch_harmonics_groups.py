"""harness.contrib.torch_harmonics: torch-harmonics' polar and azimuth groups adopted from the
topology in one call, checked against it, and put back after the run (torch-harmonics 0.8 and
0.9: listed in .ci/pair-tests)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import (
    ConfigError,
    Outputs,
    Shard,
    SpatialCase,
    Topology,
    check_equivalence,
    data_share,
)
from harness.adopt import GroupMismatch, group_ranks, patch, undo
from harness.collectives import reduce_loss, sync_gradients
from harness.contrib.torch_harmonics import (
    TorchHarmonicsNotInstalled,
    adopt_groups,
    check_groups,
)
from harness.partition import LatLonPartition
from harness.topology import cached_groups

# every split even (8 latitudes and degrees, 16 longitudes, 8 orders, 4 channels over up to
# 4 ranks): torch-harmonics 0.8 exchanges its transposes with gloo's all_to_all, which takes
# only equal chunks (the SFNO stepper's uneven grids need harness._base.compat's transport)
NLAT, NLON, MODES, CHANNELS, BATCH = 8, 16, 8, 4, 4


class SpectralFilter(torch.nn.Module):
    """x + tanh(a learned filter per degree l), through torch-harmonics' distributed SHT: the
    serial transform for the reference (no groups), the distributed one on the ranks."""

    def __init__(self, topo: Topology) -> None:
        import torch_harmonics.distributed as thd

        super().__init__()
        self.sht = thd.DistributedRealSHT(NLAT, NLON, lmax=MODES, mmax=MODES)
        self.isht = thd.DistributedInverseRealSHT(NLAT, NLON, lmax=MODES, mmax=MODES)
        rank = thd.polar_group_rank()  # this rank's degrees l: the SHT's own split of them
        start = sum(self.sht.l_shapes[:rank])
        self.degrees = slice(start, start + self.sht.l_shapes[rank])
        self.weight = torch.nn.Parameter(torch.linspace(1.0, -0.5, MODES).repeat(CHANNELS, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coeffs = self.sht(x) * self.weight[:, self.degrees, None]
        return x + torch.tanh(self.isht(coeffs))


class SpectralFilterCase(SpatialCase):
    """The filter on the harness's h x w mesh, with torch-harmonics' groups adopted."""

    name, dtype, mesh_dims = "th-spectral-filter", torch.float64, 2

    def partition(self, topo: Topology) -> LatLonPartition:
        return LatLonPartition(NLAT, NLON, *topo.mesh_shape(2))

    def build(self, topo: Topology) -> torch.nn.Module:
        adopt_groups(topo)
        model = SpectralFilter(topo)
        sync_gradients(model, topo)  # each rank's part of d loss / d weight, summed
        return model

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        x, target = torch.randn(2, BATCH, CHANNELS, NLAT, NLON)
        rows, cols = self.partition(topo).slices(topo.spatial_rank)
        samples = data_share(BATCH, topo)
        return {"x": x[samples, :, rows, cols], "target": target[samples, :, rows, cols]}

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        y = model(batch["x"])
        # each data group's mean over its own samples (reduce_loss averages the data groups')
        count = y.shape[0] * CHANNELS * NLAT * NLON
        loss = reduce_loss(((y - batch["target"]) ** 2).sum(), topo) / count
        rows, cols = self.partition(topo).slices(topo.spatial_rank)
        return Outputs(loss, {"y": Shard.grid(y.detach(), rows, cols, NLAT, NLON)})


# (ranks, spatial size, h x w): 2x2 and 4x1, alone and beside a second data group (8 ranks:
# the most the harness runs on 2 cores)
LAYOUTS = [
    (4, 4, (2, 2)),
    (4, 4, (4, 1)),
    (4, 2, (2, 1)),
    (8, 4, (2, 2)),
    (8, 4, (4, 1)),
]


@pytest.mark.spatial_pool  # the 8-rank layouts start a pool of their own
@pytest.mark.parametrize(
    ("ranks", "spatial_size", "mesh"),
    LAYOUTS,
    ids=["2x2", "4x1", "2x1_x_data2", "2x2_x_data2", "4x1_x_data2"],
)
def test_a_model_on_the_adopted_groups_matches_its_reference(
    spatial: Any, ranks: int, spatial_size: int, mesh: tuple[int, int]
) -> None:
    report = check_equivalence(
        SpectralFilterCase(),
        ranks=ranks,
        spatial_size=spatial_size,
        mesh=mesh,
        pool=spatial.pool(ranks),
    )
    assert report.ok, str(report)
    # float64, the same quadratures summed in another order: measured at most 4.4e-16 (2 eps
    # of values of order 2) on every layout, with torch-harmonics 0.8 and 0.9; a wrong group
    # or filter slice is off by 1e-2 or more
    assert max(report.stats[q].max_abs for q in ("loss", "grad", "field", "param")) < 1e-14


def adopted_on_a_rank(spatial_size: int, h: int, w: int) -> dict[str, Any]:
    """What torch-harmonics answers after ``adopt_groups`` and again after ``undo``."""
    import torch_harmonics.distributed as thd

    topo = Topology.create(spatial_size=spatial_size)
    before = object()
    thd.init(before, before)  # a previous owner's groups: undo must bring them back
    polar, azimuth = adopt_groups(topo, h, w)
    seen = {
        "returned": (polar is thd.polar_group(), azimuth is thd.azimuth_group()),
        "ranks": (group_ranks(thd.polar_group()), group_ranks(thd.azimuth_group())),
        "sizes": (thd.polar_group_size(), thd.azimuth_group_size()),
        "initialized": thd.is_initialized(),
    }
    undo()
    seen["after undo"] = (thd.polar_group() is before, thd.azimuth_group() is before)
    return seen


@pytest.mark.parametrize(
    ("spatial_size", "h", "w", "polar", "azimuth"),
    [
        # rank -> (polar ranks, azimuth ranks): spatial rank p * w + a, as Topology.grid lays it
        (4, 2, 2, [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
        (2, 2, 1, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0], [1], [2], [3]]),
        (2, 1, 2, [[0], [1], [2], [3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ],
    ids=["2x2", "2x1_x_data2", "1x2_x_data2"],
)
def test_the_library_answers_the_topologys_grid_and_its_previous_groups_after_undo(
    spatial: Any,
    spatial_size: int,
    h: int,
    w: int,
    polar: list[list[int]],
    azimuth: list[list[int]],
) -> None:
    for rank, seen in enumerate(spatial.run(adopted_on_a_rank, spatial_size, h, w)):
        assert seen["returned"] == (True, True)
        assert seen["ranks"] == (polar[rank], azimuth[rank])
        assert seen["sizes"] == (h, w)
        assert seen["initialized"] is True  # on 0.8 too, whose init forgets to say so
        assert seen["after undo"] == (True, True)


def test_the_reference_gets_no_groups_and_the_librarys_back_after_undo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch_harmonics.distributed as thd

    before = object()  # a previous owner's state: undo must bring it back
    for name in ("_POLAR_PARALLEL_GROUP", "_AZIMUTH_PARALLEL_GROUP", "_IS_INITIALIZED"):
        monkeypatch.setattr(thd.utils, name, before)
    assert adopt_groups(Topology.single()) == (None, None)
    assert (thd.polar_group(), thd.azimuth_group(), thd.is_initialized()) == (None, None, True)
    assert adopt_groups(Topology.single(), 2) == (None, None)  # the case's h: not the reference's
    undo()
    assert (thd.polar_group(), thd.azimuth_group(), thd.is_initialized()) == (before,) * 3


def the_models_own_groups(layout: str) -> tuple[Any, Any]:
    """torch-harmonics' groups as a model might build them, on 4 ranks: ``docstring`` as
    torch-harmonics' ``init`` docstring does, over the whole world (2 spatial groups of 2
    ranks, grid 2x1); ``swapped`` (2x2) polar and azimuth handed in the wrong order;
    ``reversed`` (2x2) the polar group numbered from its last rank."""
    rank = dist.get_rank()
    if layout == "docstring":  # column: r % w == rank % w over the world, w = 1
        polar_lists, azimuth_lists = [[0, 1, 2, 3]], [[0], [1], [2], [3]]
    else:
        polar_lists, azimuth_lists = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
        if layout == "reversed":
            polar_lists = [[2, 0], [3, 1]]
    groups = cached_groups(("test_th", layout), polar_lists + azimuth_lists, sort_ranks=False)
    mine = [
        g for g, ranks in zip(groups, polar_lists + azimuth_lists, strict=True) if rank in ranks
    ]
    polar, azimuth = mine
    return (azimuth, polar) if layout == "swapped" else (polar, azimuth)


def check_the_models_groups(layout: str) -> str:
    import torch_harmonics.distributed as thd

    spatial_size, grid = (2, (2, 1)) if layout == "docstring" else (4, (2, 2))
    topo = Topology.create(spatial_size=spatial_size)
    thd.init(*the_models_own_groups(layout))
    try:
        check_groups(topo, *grid)
    except GroupMismatch as exc:
        return str(exc)
    finally:
        thd.init(None, None)
    return "ok"


@pytest.mark.parametrize(
    ("layout", "line"),
    [
        (
            "docstring",
            "torch-harmonics' polar group is not the topology's 2x1 grid (polar group: this "
            "rank's column of 2, azimuth group: its row of 1, in order, within its spatial "
            "group): its polar group differs on rank 0, 1, 2, 3: rank 0 "
            "holds [0, 1, 2, 3], must hold [0, 1]; rank 1 holds [0, 1, 2, 3], must hold "
            "[0, 1] (and 2 more ranks); call harness.contrib.torch_harmonics.adopt_groups(topo) "
            "in build instead of thd.init, or build them with topo.grid(h, w)",
        ),
        (
            "swapped",
            "torch-harmonics' polar and azimuth groups are not the topology's 2x2 grid "
            "(polar group: this rank's column of 2, azimuth group: its row of 2, in order, "
            "within its spatial group): its polar group differs on "
            "rank 0, 1, 2, 3: rank 0 holds [0, 1], must hold [0, 2]; rank 1 holds [0, 1], "
            "must hold [1, 3] (and 2 more ranks); its azimuth group differs on rank 0, 1, 2, "
            "3: rank 0 holds [0, 2], must hold [0, 1]; rank 1 holds [1, 3], must hold [0, 1] "
            "(and 2 more ranks); call harness.contrib.torch_harmonics.adopt_groups(topo) in "
            "build instead of thd.init, or build them with topo.grid(h, w)",
        ),
        (
            "reversed",
            "torch-harmonics' polar group is not the topology's 2x2 grid (polar group: this "
            "rank's column of 2, azimuth group: its row of 2, in order, within its spatial "
            "group): its polar group differs on rank 0, 1, 2, 3: rank 0 "
            "holds [2, 0], must hold [0, 2]; rank 1 holds [3, 1], must hold [1, 3] (and 2 "
            "more ranks); call harness.contrib.torch_harmonics.adopt_groups(topo) in build "
            "instead of thd.init, or build them with topo.grid(h, w)",
        ),
    ],
    ids=["docstring_over_the_world", "polar_and_azimuth_swapped", "polar_order_reversed"],
)
def test_groups_that_are_not_the_topologys_grid_are_one_line_on_every_rank(
    spatial: Any, layout: str, line: str
) -> None:
    assert spatial.run(check_the_models_groups, layout) == [line] * 4


def adopt_where_init_swaps_the_groups() -> str:
    """``adopt_groups`` under a library whose ``init`` keeps the groups the other way round:
    what the library answers is checked, not what was handed to it."""
    import torch_harmonics.distributed as thd

    topo = Topology.create(spatial_size=4)
    init = thd.init
    patch(thd, "init", lambda polar, azimuth: init(azimuth, polar))
    try:
        adopt_groups(topo, 2, 2)
    except GroupMismatch as exc:
        return str(exc).split(":")[0]
    finally:
        undo()
    return "adopted"


def test_adopting_checks_what_the_library_answers_not_what_it_was_handed(spatial: Any) -> None:
    assert (
        spatial.run(adopt_where_init_swaps_the_groups)
        == [
            "torch-harmonics' polar and azimuth groups are not the topology's 2x2 grid (polar group"
        ]
        * 4
    )


class InitsItsOwnGroups(SpectralFilterCase):
    """Calls ``thd.init`` itself, as torch-harmonics' docstring does (over the whole world),
    then asks the harness to check what it made."""

    def build(self, topo: Topology) -> torch.nn.Module:
        import torch_harmonics.distributed as thd

        if topo.spatial_group is not None:
            thd.init(*the_models_own_groups("docstring"))
        check_groups(topo)
        return SpectralFilter(topo)


def test_a_case_whose_model_inits_other_groups_fails_at_build_on_every_rank(spatial: Any) -> None:
    report = check_equivalence(
        InitsItsOwnGroups(), ranks=4, spatial_size=2, mesh=(2, 1), pool=spatial.pool(4)
    )
    assert {(m.quantity, m.phase) for m in report.mismatches} == {("error", "build")}
    assert {m.rank for m in report.mismatches} == {0, 1, 2, 3}  # nobody left waiting
    assert "GroupMismatch: torch-harmonics' polar group is not the topology's 2x1 grid" in str(
        report
    )


def bad_grid(h: int | None, w: int | None) -> str:
    topo = Topology.create(spatial_size=4)
    try:
        adopt_groups(topo, h, w)
    except ConfigError as exc:
        return str(exc)
    finally:
        undo()
    return "adopted"


def test_a_grid_that_is_not_the_spatial_group_is_refused_before_any_group_is_made(
    spatial: Any,
) -> None:
    assert (
        spatial.run(bad_grid, 3, None)
        == [
            "a h=3 process grid does not divide the spatial group of 4 ranks; give h and w with "
            "h * w == 4"
        ]
        * 4
    )
    assert (
        spatial.run(bad_grid, 2, 3)
        == [
            "torch-harmonics' process grid 2x3 has 6 ranks but the spatial group has 4; give h "
            "and w with h * w == 4 (or pass mesh= to the check)"
        ]
        * 4
    )
    assert spatial.run(bad_grid, None, 2) == ["adopted"] * 4  # w = 2: h = 4 / 2


def test_without_torch_harmonics_the_error_is_a_config_and_import_error_with_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch_harmonics.distributed", None)  # import fails
    with pytest.raises(TorchHarmonicsNotInstalled, match=r"pip install .*\[sfno\]") as info:
        adopt_groups(Topology.single())
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ImportError)
