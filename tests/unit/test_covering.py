"""The covering set of a sweep (``harness.layouts._covering``) and ``check_layouts`` walking it,
without ranks: which layouts it keeps, that each level keeps its smallest layout, that a
refused layout leaves its levels wanted, and the bad ``max_ranks`` values."""

from __future__ import annotations

import itertools

import pytest

from harness import ConfigError, EquivalenceReport, Mismatch, SpatialCase
from harness import layouts as layouts_module
from harness.layouts import BLOCKS, Layout, check_layouts, layouts
from harness.layouts import _run as layouts_run
from harness.layouts._covering import Covering, covering, features
from harness.steppers import catalogue
from tests.unit.test_layouts import report_of

SHAPES = [(m, d, b) for m in (2, 4, 6, 8) for d in (1, 2) for b in (("even",), BLOCKS)]


def short(x: Layout) -> str:
    return x.row + (f" d{x.data_size}" if x.data_size > 1 else "")


def levels(x: Layout) -> set[tuple[str, str]]:
    return set(features(x).items())


@pytest.mark.parametrize(("max_ranks", "dims", "blocks"), SHAPES)
def test_each_level_keeps_its_smallest_layout_and_nothing_else(max_ranks, dims, blocks):
    every = layouts(max_ranks, dims, blocks=blocks)
    kept = covering(every)
    wanted = set().union(*(levels(x) for x in every))
    firsts = {item: min((x for x in every if item in levels(x)), key=lambda x: x.order)
              for item in wanted}  # fmt: skip
    assert set(firsts.values()) == set(kept)  # each level's smallest, and only those
    assert kept == sorted(kept, key=lambda x: x.order) and len(set(kept)) == len(kept)


def test_data_groups_beside_a_split_domain_are_a_level_of_their_own():
    # rank // spatial_size and rank % data_size agree on 1 x 1 with 2 data groups and on
    # 2 x 1 alone; only 2 x 1 with 2 data groups tells them apart
    def data_index(rank, spatial, data, mixed):
        return rank % data if mixed else rank // spatial

    differ = [
        short(x)
        for x in layouts(4, 2)
        if any(
            data_index(r, x.spatial_size, x.data_size, True)
            != data_index(r, x.spatial_size, x.data_size, False)
            for r in range(x.world_size)
        )
    ]
    assert differ == ["2x1 d2", "1x2 d2"]
    assert {features(Layout(4, 2, 2, m))["data groups"] for m in ((2, 1), (1, 2))} == {
        "beside a split"
    }
    assert features(Layout(2, 1, 2, (1, 1)))["data groups"] == "replicas"
    assert Layout(4, 2, 2, (2, 1)) in covering(layouts(4, 2))


def test_the_covering_sets_of_lat_lon_and_cell_sweeps():
    two_d = covering(layouts(4, 2))
    assert [short(x) for x in two_d] == [
        "1x1", "1x1 d2", "2x1", "1x2", "3x1", "1x3", "2x1 d2", "4x1", "1x4", "2x2"
    ]  # fmt: skip
    # beyond 4 ranks no level is new: a split of more than 3 is first met at 4
    assert covering(layouts(8, 2)) == two_d and len(layouts(8, 2)) == 38
    cells = covering(layouts(4, 1, blocks=BLOCKS))
    assert [short(x) for x in cells] == [
        "1", "1 d2", "2", "2 uneven", "2 empty-rank", "3", "2 d2", "4"
    ]  # fmt: skip
    assert covering(layouts(8, 1, blocks=BLOCKS)) == cells


@pytest.mark.parametrize("key", sorted(catalogue.SMALLEST_LAYOUT), ids=lambda k: ":".join(k))
def test_every_catalogue_faults_smallest_layout_is_in_the_covering_set(key):
    world, mesh, blocks = catalogue.SMALLEST_LAYOUT[key]
    every = layouts(4, len(mesh), blocks=BLOCKS if key[0] == "healpix" else ("even",))
    kept = {(x.world_size, x.mesh, x.blocks) for x in covering(every)}
    assert (world, mesh, blocks) in kept


def test_a_refused_layout_leaves_its_levels_wanted_for_the_next_that_has_them():
    walk = Covering()
    order = layouts(4, 1)
    ran = []
    for x in order:
        if walk.wants(x):
            ran.append(short(x))
            if x.data_size != 2:  # a batch of 3: 2 data groups refused, 3 fine
                walk.ran(x)
    # 3 data groups then stand for replicas; 2 data groups of 2 ranks are tried (refused
    # too): no other layout has data groups beside a split
    assert ran == ["1", "1 d2", "2", "1 d3", "3", "2 d2", "4"]
    assert [short(x) for x in covering(order)] == ["1", "1 d2", "2", "3", "2 d2", "4"]


def test_covering_features_name_the_split_of_each_axis_and_both_split():
    assert features(Layout(8, 8, 1, (2, 4))) == {
        "ranks": "even",
        "data groups": "1",
        "spatial ranks": ">3",
        "blocks": "even",
        "axis 0": "2",
        "axis 1": ">3",
        "both axes split": "yes",
    }
    assert features(Layout(3, 3, 1, (3,), "uneven")) == {
        "ranks": "odd",
        "data groups": "1",
        "spatial ranks": "3",
        "blocks": "uneven",
    }


# ---------------------------------------------------------------------- check_layouts


class Cells(SpatialCase):
    """Splits along one axis; every grid offers uneven and empty blocks (no ranks run:
    ``_check`` is replaced)."""

    mesh_dims = 1

    def block_variants(self, mesh):
        return {"uneven": self, "empty-rank": self}


def fake_report(layout: Layout, fails, refuses) -> EquivalenceReport:
    bad = []
    if refuses(layout):
        bad = [
            Mismatch(
                "error",
                "demo",
                None,
                0,
                where="ConfigError: 2 samples do not split",
                detail='Traceback (most recent call last):\n  File "case.py", line 1, in batch\n',
                phase="step 0 batch",
            )
        ]
    elif fails(layout):
        bad = [Mismatch("loss", "loss", 0, 0, max_abs=1.0, max_rel=1.0, count=1, total=1)]
    return report_of(layout, *bad)


@pytest.fixture
def fake_runs(monkeypatch):
    """``check_layouts`` with each layout's check replaced by ``fails`` / ``refuses``
    (predicates on the layout); the layouts checked are recorded in order."""
    ran: list[Layout] = []
    rules = {"fails": lambda x: False, "refuses": lambda x: False}

    def check(layout, case, pools, reference, given, locate, options):
        ran.append(layout)
        return fake_report(layout, rules["fails"], rules["refuses"])

    def check_one(layout, case, pools, reference, given, locate, options, at_once=0):
        return check(layout, case, pools, reference, given, locate, options)

    monkeypatch.setattr(layouts_run, "check_one", check_one)
    monkeypatch.setattr(layouts_run, "reference_run", lambda case, options, timeout: None)
    monkeypatch.setattr(layouts_module, "reference_run", lambda case, options, timeout: None)
    return ran, rules


def test_check_layouts_runs_the_covering_set_and_says_k_of_n(fake_runs):
    ran, _ = fake_runs
    report = check_layouts(Cells(), max_ranks=4, pools=lambda w: None, locate=False)
    assert ran == covering(layouts(4, 1, blocks=BLOCKS))
    assert report.ok and report.covering
    assert report.summary().startswith("Cells: layouts 8 of 16 (covering) up to 4 ranks, 8")
    assert sorted(report.left_out, key=lambda x: x.order) == [
        x for x in layouts(4, 1, blocks=BLOCKS) if x not in ran
    ]
    rows = {
        line.split()[0] + line.split()[1] * ("empty" in line or "uneven" in line): line
        for line in report.map().splitlines()
    }
    assert rows["1"].split()[1:] == ["pass", "pass", "-", "-"]  # 3 and 4 data groups left out
    assert "'-': left out by the covering sweep" in str(report)


def test_the_exhaustive_sweep_runs_every_layout(fake_runs):
    ran, _ = fake_runs
    report = check_layouts(Cells(), max_ranks=4, pools=lambda w: None, exhaustive=True)
    assert ran == layouts(4, 1, blocks=BLOCKS) and not report.left_out
    assert report.summary().startswith("Cells: 16 layout(s) up to 4 ranks, 16 passed")
    assert "'-'" not in str(report)


def test_a_layout_the_case_refuses_leaves_its_levels_to_the_next_layout(fake_runs):
    ran, rules = fake_runs
    rules["refuses"] = lambda x: x.data_size == 2  # a batch that splits over 3, not 2
    rules["fails"] = lambda x: x.data_size == 3 and x.spatial_size > 1
    report = check_layouts(
        Cells(), max_ranks=6, pools=lambda w: None, locate=False, oversubscribe=True
    )
    assert Layout(3, 1, 3, (1,)) in ran  # replicas: 3 data groups run, 2 were refused
    # beside a split: 2 data groups of 2 ranks refused (each block kind), so 3 groups of 2
    assert [x for x in ran if x.data_size > 1 and x.spatial_size > 1] == [
        Layout(4, 2, 2, (2,), b) for b in BLOCKS
    ] + [Layout(6, 2, 3, (2,))]
    assert report.smallest_failing == Layout(6, 2, 3, (2,))
    assert len(report.refused) == 4 and not report.ok


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"^max_ranks must be an integer >= 1, got 0; e\.g\. max_ranks=4"),
        ("3", r"^max_ranks must be an integer >= 1, got '3'; e\.g\. max_ranks=4"),
        (True, r"^max_ranks must be an integer >= 1, got True"),
        (
            100_000,
            r"^100000 rank processes .* Use fewer ranks, or pass oversubscribe=True to insist",
        ),
    ],
)
def test_a_bad_max_ranks_is_one_config_error_line(fake_runs, value, message):
    ran, _ = fake_runs
    with pytest.raises(ConfigError, match=message) as raised:
        check_layouts(Cells(), max_ranks=value, pools=lambda w: None)
    assert "\n" not in str(raised.value) and not ran


def test_oversubscribe_lets_a_sweep_of_many_ranks_run(fake_runs):
    ran, _ = fake_runs
    report = check_layouts(
        Cells(), max_ranks=100, world_sizes=[100], pools=lambda w: None, oversubscribe=True
    )
    assert {x.world_size for x in ran} == {100} and report.ok


def test_covering_is_smaller_than_exhaustive_everywhere_but_the_smallest_sweeps():
    for m, d, b in SHAPES:
        every = layouts(m, d, blocks=b)
        kept = covering(every)
        assert set(kept) <= set(every)
        if m >= 4:
            assert len(kept) < len(every), (m, d, b)
    assert list(itertools.islice(covering(layouts(2, 2)), 9)) == layouts(2, 2)


def test_a_sweep_of_no_world_size_runs_nothing_and_says_so(fake_runs):
    ran, _ = fake_runs
    report = check_layouts(Cells(), max_ranks=4, world_sizes=[], pools=lambda w: None)
    assert not ran and not report.results and not report.ok
    assert "no layout ran, so nothing was checked" in report.summary()
