"""The mutation campaign's one loop and the mode it runs each rerun in, on hand-made sites."""

from __future__ import annotations

from harness._mutation.campaign import Killed, Reached, campaign
from harness._mutation.catalogue import Mutant, MutantKind, Outcome, SiteStats
from harness._mutation.mode import OFF, MutantMode, current, running
from harness.report import EquivalenceReport

WHERE = "/repo/model.py:41 in halo"
OUTSIDE = "/site-packages/lib.py:7 in helper"
LOCATION = "model.py:41"


def _allreduce(*, whole_world: bool) -> SiteStats:
    return SiteStats("all_reduce", "allreduce", group_size=4, whole_world=whole_world,
                     reduce="sum", calls=2)  # fmt: skip


def _reached(*, whole_world: bool = True) -> Reached[str]:
    reached: Reached[str] = Reached(lambda where: where.startswith("/repo/"))
    # two ranks each; the slow check ran first and also reached a site outside the code
    reached.add("slow", 2.0, [{WHERE: _allreduce(whole_world=whole_world), OUTSIDE:
                _allreduce(whole_world=whole_world)}] * 2)  # fmt: skip
    reached.add("fast", 0.5, [{WHERE: _allreduce(whole_world=whole_world)}] * 2)
    return reached


def test_each_mutant_reruns_the_checks_of_its_site_fastest_first_until_one_fails():
    runs: list[tuple[str, str, MutantMode]] = []
    kills = {("fast", "skip"), ("slow", "avg")}

    def rerun(check: str, mode: MutantMode) -> Killed | None:
        assert mode.mutant is not None
        runs.append((check, mode.mutant.kind, current()))
        return Killed(check, "grad") if (check, mode.mutant.kind) in kills else None

    outcomes = campaign(_reached(), rerun, timeout=lambda seconds: 10 * seconds)
    assert [(c, k) for c, k, _ in runs] == [
        ("fast", "skip"),  # killed at once: the slow check never reruns it
        ("fast", "avg"),
        ("slow", "avg"),
        ("fast", "max"),
        ("slow", "max"),
    ]  # "world" never reruns: the group was the whole world (cannot_matter)
    # each rerun ran in its mutant's mode, with its check's limit, and only then
    assert [m for _, _, m in runs] == [
        MutantMode(mutant=Mutant(WHERE, MutantKind(kind), "all_reduce"), timeout=10 * seconds)
        for kind, seconds in [("skip", 0.5), ("avg", 0.5), ("avg", 2.0), ("max", 0.5), ("max", 2.0)]
    ]
    assert current() == OFF
    by_kind = {o.mutant.kind: o for o in outcomes}
    assert by_kind["skip"] == Outcome(
        Mutant(WHERE, MutantKind.SKIP, "all_reduce"), LOCATION, "fast", "grad"
    )
    assert by_kind["avg"].killed_by == "slow"
    assert not by_kind["max"].killed and not by_kind["max"].reason
    assert by_kind["world"].reason.startswith("the group is the whole world")
    assert {o.mutant.site for o in outcomes} == {WHERE}  # the site outside: not mutated


def test_a_site_no_check_reached_inside_the_code_has_no_mutants():
    reached: Reached[str] = Reached(lambda where: where.startswith("/repo/"))
    reached.add("only", 1.0, [{OUTSIDE: _allreduce(whole_world=False)}])
    assert campaign(reached, lambda check, mode: Killed(check, "grad")) == []


def test_the_mode_is_back_after_a_rerun_that_raised():
    def rerun(check: str, mode: MutantMode) -> Killed | None:
        raise KeyboardInterrupt

    try:
        campaign(_reached(whole_world=False), rerun)
    except KeyboardInterrupt:
        pass
    assert current() == OFF


def _failed_report() -> EquivalenceReport:
    from harness.compare import Mismatch

    report = EquivalenceReport("case", 4, 4, "x", 1, "float64", None)
    report.mismatches.append(Mismatch("grad", "w", 0, None))
    return report


def test_a_mutants_rerun_locates_nothing_even_when_asked():
    from harness.equivalence import _should_locate

    report = _failed_report()
    assert _should_locate(None, report) and _should_locate(True, report)
    with running(MutantMode(mutant=Mutant(WHERE, MutantKind.SKIP))):
        assert not _should_locate(None, report)
        assert not _should_locate(True, report)
    with running(MutantMode(record=True)):  # the recording run is a check like any other
        assert _should_locate(None, report)


def test_only_sites_in_the_projects_own_code_are_mutated_not_a_venv_inside_it(tmp_path):
    from harness.plugin.mutants import _inside

    root = tmp_path.resolve()
    venv = root / ".venv" / "lib" / "python3.12" / "site-packages" / "torch_harmonics"
    assert _inside(f"{root / 'model.py'}:41 in halo", root)
    assert _inside(f"{root / 'pkg' / 'layers.py'}:3 in f", root)
    assert not _inside(f"{venv / 'sht.py'}:12 in forward", root)  # installed, under rootdir
    assert not _inside(f"{tmp_path.parent / 'other' / 'model.py'}:41 in halo", root)
