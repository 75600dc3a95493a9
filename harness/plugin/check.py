"""``spatial.check``: ``check_equivalence`` on the test's pool, its summary row, its golden,
and one failure that says both the report's and the golden's, so neither hides the other."""

from __future__ import annotations

from typing import Any

import pytest

from harness._records.observe import quiet
from harness.case import SpatialCase
from harness.equivalence import check_equivalence
from harness.plugin._keys import _EQUIV_PROP, _settings_key
from harness.plugin.github import check_places, junit_properties
from harness.plugin.golden_fixture import GoldenFixture, GoldenVerdict
from harness.plugin.lease import PoolLease
from harness.plugin.pictures import check_failure
from harness.plugin.rank_output import RankOutput
from harness.plugin.summary import rollout_progress
from harness.report import EquivalenceReport, SummaryRow

#: what a check without ``golden=`` learnt of its golden: nothing
NO_GOLDEN = GoldenVerdict(None, "")


class EquivalenceCheck:
    """One test's ``spatial.check``: runs on ``lease``'s pools, heard by ``output``, its
    reference checked against ``golden``'s file where asked."""

    def __init__(
        self, node: pytest.Item, lease: PoolLease, output: RankOutput, golden: GoldenFixture
    ) -> None:
        self._node = node
        self._lease = lease
        self._output = output
        self._golden = golden

    def __call__(
        self,
        case: SpatialCase,
        *,
        golden: bool | str,
        ranks: int | None,
        timeout: float | None,
        locate: bool | None,
        **kwargs: Any,
    ) -> EquivalenceReport:
        """``check_equivalence`` on the pool of ``ranks``, locating on failure (or always,
        with ``--spatial-locate`` or ``--spatial-calibrate``); the test fails with its table,
        and the golden's failure, if either fails."""
        __tracebackhide__ = True
        settings = self._node.config.stash[_settings_key]
        ranks = ranks or self._lease.ranks
        pool = self._lease.pool(ranks)
        if locate is None and (settings.calibrate or settings.locate):
            locate = True
        steps = int(kwargs.get("rollout") or 0)  # a long rollout says where it is
        with (
            self._output.heard([pool]),
            quiet(),  # its row is made here, with the golden's status
            rollout_progress(self._node.config, pool, case.label, steps),
        ):
            report = check_equivalence(
                case,
                ranks=ranks,
                pool=pool,
                timeout=self._lease.seconds(timeout),
                locate=locate,
                **kwargs,
            )
        row = self._row(report, case)
        verdict = NO_GOLDEN
        if golden:
            verdict = self._golden.verdict(
                report,
                golden if isinstance(golden, str) else None,
                allow_nonfinite=kwargs.get("allow_nonfinite") or case.expect_nonfinite,
                seed=kwargs.get("seed", 0),
            )
        if verdict.status is not None:
            row["golden"] = verdict.status
        self._node.user_properties.append((_EQUIV_PROP, row))
        failure = self._failure(report, verdict)
        if failure:
            pytest.fail(failure, pytrace=False)
        return report

    def _failure(self, report: EquivalenceReport, verdict: GoldenVerdict) -> str:
        """The check's failure text: the report's (with its pictures' paths), then the
        golden's, each said so that neither hides the other; ``""`` when both passed."""
        failures = [] if report.ok else [check_failure(self._node, report)]
        if verdict.failure:
            lead = "The golden check failed too:\n" if failures else ""
            failures.append(lead + verdict.failure)
        return "\n\n".join(failures)

    def _row(self, report: EquivalenceReport, case: SpatialCase) -> SummaryRow:
        """The check's summary row (its calibration under ``--spatial-calibrate``, the
        lines its failure points at, the test's line); its ``spatial.*`` properties
        recorded on the test."""
        settings = self._node.config.stash[_settings_key]
        row = report.summary_row()
        row["test"] = self._node.nodeid
        if settings.calibrate and report.location is not None and report.tolerance is not None:
            rtols = {q: report.tolerance.bound(q).rtol for q in ("loss", "grad", "field")}
            row["calibration"] = report.location.calibration_lines(rtols)
        row.update(check_places(self._node, report, case))
        self._node.user_properties.extend(junit_properties(report, row))  # for JUnit viewers
        return row
