"""The mutant catalogue and its verdicts, on hand-made call sites."""

from __future__ import annotations

import pytest

from harness._mutation.catalogue import (
    Mutant,
    MutantKind,
    Outcome,
    Site,
    SiteStats,
    cannot_matter,
    merge_sites,
    mutants_for,
    quantity_of,
    score_line,
    table_rows,
)

WHERE = "/repo/model.py:41 in halo"


def site(method: str = "allreduce", **kw: object) -> Site:
    fields: dict[str, object] = dict(
        site=WHERE,
        op="all_reduce",
        method=method,
        group_size=4,
        whole_world=False,
        reduce="sum",
        backward=False,
        calls=2,
        same_data=False,
    )
    fields.update(kw)
    return Site(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("s", "kinds"),
    [
        (site(), ["skip", "avg", "max", "world"]),
        (site(backward=True), ["skip", "avg", "max", "world", "double"]),
        (site(reduce="max"), ["skip", "world"]),  # AVG/MAX of a MAX: not the bug to look for
        (site("broadcast", op="broadcast"), ["skip", "wrong-source"]),
        (site("_allgather_base", op="all_gather_into_tensor"), ["skip", "rotate"]),
        (site("alltoall_base", op="all_to_all_single"), ["skip", "rotate", "swap-splits"]),
        (site("all_to_all_single", op="all_to_all_single"), ["skip", "rotate", "swap-splits"]),
        (site("alltoall", op="all_to_all"), ["skip", "rotate"]),
        (site("all_gather_single", op="all_gather_into_tensor"), ["skip", "rotate"]),
        (site("reduce_scatter_single", op="reduce_scatter_tensor"), ["skip", "avg"]),
        (site("reduce_scatter_single", reduce="max"), ["skip"]),
        (site("monitored_barrier", op="monitored_barrier"), ["skip"]),
        (site("send", op="isend"), ["skip"]),
        (site("recv", op="irecv"), ["zero", "stale"]),
        (site("ddp", op="DistributedDataParallel"), ["no-grad-allreduce"]),
        (site("case-build", op="Case.build", buffers=True), ["rng-per-rank", "buffers-broadcast"]),
        (site("case-build", op="Case.build"), ["rng-per-rank"]),
        (site("case-batch", op="Case.batch"), ["rng-per-rank"]),
    ],
    ids=[
        "all_reduce",
        "backward",
        "max-reduce",
        "broadcast",
        "gather",
        "all_to_all_single-2.12",
        "all_to_all_single-2.13",
        "all_to_all",
        "all_gather_into_tensor-2.13",
        "reduce_scatter_tensor-2.13",
        "reduce_scatter-max",
        "monitored_barrier",
        "send",
        "recv",
        "ddp",
        "build-buffers",
        "build",
        "batch",
    ],
)
def test_each_kind_of_call_gets_the_bugs_seen_there(s, kinds):
    assert [m.kind for m in mutants_for(s)] == kinds
    assert all(type(m.kind) is MutantKind for m in mutants_for(s))
    assert all(m.site == WHERE for m in mutants_for(s))


ZEROS = (
    "every rank passed zeros here in every run (a guard that only fires on an error?): "
    "summing, averaging or moving zeros changes nothing"
)


@pytest.mark.parametrize(
    ("kind", "s", "reason"),
    [
        ("skip", site(group_size=1), "one rank in the group: the operation is the identity here"),
        (
            "world",
            site(whole_world=True),
            "the group is the whole world on every layout the tests ran: test a layout with "
            "data groups (spatial_size < ranks)",
        ),
        (
            "rotate",
            site("allgather", same_data=True),
            "every rank passed the same data here: rotating or taking the max changes nothing",
        ),
        (
            "max",
            site(same_data=True),
            "every rank passed the same data here: rotating or taking the max changes nothing",
        ),
        (
            "stale",
            site("recv", calls=1),
            "called once per run: the previous call's data is the untouched buffer (the same "
            "mutant as zero, or as skip); run more steps",
        ),
        (
            "swap-splits",
            site("all_to_all_single"),
            "the input and output split sizes were the same in every call (even pieces): "
            "exchanging them changes nothing; test a layout that splits unevenly",
        ),
        *[
            (k, site(zeros=True), ZEROS)
            for k in ("skip", "avg", "max", "world", "rotate", "double")
        ],
    ],
    ids=[
        "one-rank",
        "world",
        "rotate-same",
        "max-same",
        "stale-once",
        "even-splits",
        "zeros-skip",
        "zeros-avg",
        "zeros-max",
        "zeros-world",
        "zeros-rotate",
        "zeros-double",
    ],
)
def test_a_mutant_that_cannot_change_anything_here_says_why(kind, s, reason):
    assert cannot_matter(Mutant(WHERE, MutantKind(kind)), s) == reason


@pytest.mark.parametrize(
    ("kind", "s"),
    [
        ("skip", site()),
        ("world", site()),
        ("avg", site(same_data=True)),  # AVG of equal values is not their SUM
        ("stale", site("recv", calls=2)),
        ("rng-per-rank", site("case-build", group_size=1)),
        ("rng-per-rank", site("case-batch", group_size=1)),
        ("no-grad-allreduce", site("ddp", group_size=1)),
        ("zero", site("recv", zeros=True)),  # a receive's own zeros say nothing
        ("max", site("recv", same_data=True)),
        ("swap-splits", site("all_to_all_single", uneven=True)),
    ],
    ids=[
        "skip",
        "world",
        "avg-same",
        "stale-twice",
        "build",
        "batch",
        "ddp",
        "recv-zeros",
        "recv-same",
        "uneven-splits",
    ],
)
def test_a_mutant_that_can_matter_is_run(kind, s):
    assert cannot_matter(Mutant(WHERE, MutantKind(kind)), s) == ""


def test_an_unknown_method_gets_the_skip_mutant():
    assert [(m.kind, m.op) for m in mutants_for(site("frobnicate", op="frob"))] == [
        ("skip", "frob")
    ]


def test_a_reduction_of_unknown_kind_still_gets_avg_and_max():
    assert [m.kind for m in mutants_for(site(reduce=""))] == ["skip", "avg", "max", "world"]


def test_merging_keeps_what_any_rank_saw():
    early = SiteStats("all_reduce", "allreduce", 2, True, "sum", calls=1, buffers=False)
    late = SiteStats(
        "all_reduce", "allreduce", 2, True, "sum", backward=True, calls=3, buffers=True
    )
    early.merge(late)
    assert (early.backward, early.buffers, early.calls) == (True, True, 3)
    late.merge(SiteStats("all_reduce", "allreduce", 2, True, "sum", calls=1))
    assert (late.backward, late.buffers, late.calls) == (True, True, 3)  # never forgotten
    (merged,) = merge_sites([{WHERE: late}]).values()
    assert (merged.calls, merged.buffers) == (3, True)


def test_sites_are_merged_over_ranks_and_layouts():
    a = SiteStats(
        "all_reduce", "allreduce", 2, False, "sum", calls=2, data=[1.0, 2.0], nonzero=True
    )
    b = SiteStats(
        "all_reduce", "allreduce", 4, True, "sum", backward=True, calls=3, data=[1.0, 2.0]
    )
    (merged,) = merge_sites([{WHERE: a}, {WHERE: b}]).values()
    assert merged == Site(WHERE, "all_reduce", "allreduce", 4, False, "sum", True, 3, True)
    other = SiteStats("all_reduce", "allreduce", 4, True, "sum", calls=2, data=[1.0, 3.0])
    assert not merge_sites([{WHERE: a}, {WHERE: other}])[WHERE].same_data
    alone = merge_sites([{WHERE: a}])[WHERE]
    assert not alone.same_data  # one rank's data proves nothing about the others'
    guard = SiteStats("all_reduce", "allreduce", 4, True, "sum", calls=1, data=[0.0])
    assert merge_sites([{WHERE: guard}, {WHERE: guard}])[WHERE].zeros
    some = SiteStats("all_reduce", "allreduce", 4, True, "sum", calls=1, data=[0.0], nonzero=True)
    assert not merge_sites([{WHERE: guard}, {WHERE: some}])[WHERE].zeros  # +1 - 1 sums to 0
    recv = SiteStats("irecv", "recv", 4, True, calls=1, data=[0.0])
    assert not merge_sites([{WHERE: recv}])[WHERE].zeros  # a receive sends nothing


def test_uneven_splits_seen_on_any_rank_are_kept():
    even = SiteStats("all_to_all_single", "all_to_all_single", 4, True, calls=1)
    uneven = SiteStats("all_to_all_single", "all_to_all_single", 4, True, calls=1, uneven=True)
    assert merge_sites([{WHERE: even}, {WHERE: uneven}])[WHERE].uneven
    even.merge(uneven)
    assert even.uneven
    assert not merge_sites([{WHERE: SiteStats("a", "all_to_all_single", 4, True)}])[WHERE].uneven


def test_same_data_needs_every_rank_to_agree():
    def stats(*data: float) -> SiteStats:
        return SiteStats("all_reduce", "allreduce", 4, True, "sum", calls=1, data=list(data))

    three = [{WHERE: stats(1.0)}, {WHERE: stats(1.0)}, {WHERE: stats(2.0)}]
    assert not merge_sites(three)[WHERE].same_data  # the third disagrees with the first two
    assert merge_sites(three[:2])[WHERE].same_data


def test_the_table_names_killers_and_survivors_and_ends_with_the_score():
    outcomes = [
        Outcome(
            Mutant(WHERE, MutantKind.ZERO, "irecv"), "model.py:41", "test_a.py::test_x", "field"
        ),
        Outcome(Mutant(WHERE, MutantKind.WORLD, "all_reduce"), "model.py:41", reason="one group"),
        Outcome(
            Mutant(WHERE, MutantKind.SKIP, "isend"), "model.py:40", "test_a.py::test_y", "deadlock"
        ),
    ]
    assert table_rows(outcomes) == [
        ("skip isend", "model.py:40", "killed by test_a.py::test_y (deadlock)"),
        ("world all_reduce", "model.py:41", "SURVIVED: one group"),
        ("zero irecv", "model.py:41", "killed by test_a.py::test_x (field)"),
    ]
    assert score_line(outcomes) == "spatial mutation score: 2/3 killed"
    more = [
        Outcome(Mutant(WHERE, MutantKind.SKIP), "m.py:1", "t::a", "field, grad, loss"),
        Outcome(Mutant(WHERE, MutantKind.AVG), "m.py:1", "t::b", ""),
        Outcome(Mutant(WHERE, MutantKind.MAX), "m.py:1"),
    ]
    assert [row[2] for row in table_rows(more)] == [
        "killed by t::b",
        "SURVIVED",
        "killed by t::a (field +2)",
    ]
    assert site().location == "model.py:41"


@pytest.mark.parametrize(
    ("text", "quantity"),
    [
        ("harness.errors.RankDeadlock: run deadlocked on rank 0/4", "deadlock"),
        ("RankTimeout: run timed out after 30s", "timeout"),
        ("harness.errors.RankError: rank 1/4 raised ValueError", "error"),
        ("harness.errors.RankCrash: rank 2/4 died", "crash"),
        ("harness.errors.RankPending: rank 0/4 returned with", "pending"),
        ("AssertionError: assert [1.0] == [4.0]", "assert"),
        ("Failed: something else", "failed"),
    ],
)
def test_how_a_killing_test_failed_is_named(text, quantity):
    assert quantity_of(text) == quantity


# ---------------------------------------------------------------- the xdist campaign


class _Config:
    """What ``MutantSession`` reads of pytest's config on the xdist controller."""

    option = type("Option", (), {"numprocesses": 2})()


class _Worker:
    def __init__(self, outcomes: list[Outcome]) -> None:
        from harness.plugin.mutants import _OUTPUT, _plain

        self.workeroutput = {_OUTPUT: {"not_run": "", "outcomes": [_plain(o) for o in outcomes]}}


@pytest.mark.parametrize("order", ["survivor-first", "killer-first"])
def test_a_mutant_killed_by_any_worker_is_killed_whichever_worker_reports_first(order):
    from harness.plugin.mutants import MutantSession

    mutant = Mutant(WHERE, MutantKind.ROTATE, "all_to_all_single")
    survived = Outcome(mutant, "model.py:41")
    killed = Outcome(mutant, "model.py:41", "test_b.py::test_y", "field")
    other = Outcome(Mutant(WHERE, MutantKind.SKIP, "all_to_all_single"), "model.py:41")
    reports = [[survived, other], [killed]]
    if order == "killer-first":
        reports.reverse()
    session = MutantSession(_Config(), None)  # type: ignore[arg-type]
    for outcomes in reports:
        session.pytest_testnodedown(_Worker(outcomes), None)
    assert sorted(session.outcomes, key=lambda o: o.mutant) == [killed, other]
    assert score_line(session.outcomes) == "spatial mutation score: 1/2 killed"


def test_an_outcome_a_worker_reports_crosses_as_plain_text_and_comes_back_with_its_kind():
    """xdist's controller carries built-in types only (execnet refuses an enum): the kind
    crosses as its text and is a ``MutantKind`` again on the controller, equal and hashing
    alike (the controller merges the workers' outcomes by mutant)."""
    import execnet

    from harness.plugin.mutants import _outcome, _plain

    mutant = Mutant(WHERE, MutantKind.SWAP_SPLITS, "all_to_all_single")
    outcome = Outcome(mutant, "model.py:41", "test_a.py::test_x", "field")
    raw = _plain(outcome)
    assert type(raw["mutant"]["kind"]) is str and raw["mutant"]["kind"] == "swap-splits"
    back = _outcome(execnet.loads(execnet.dumps(raw)))  # as the controller receives it
    assert back == outcome and {back.mutant: 1}.get(mutant) == 1
    assert type(back.mutant.kind) is MutantKind
    assert table_rows([back]) == table_rows([outcome])
