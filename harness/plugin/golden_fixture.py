"""The ``golden`` fixture's object: a test's tensors, or its check's reference, against the
test's own golden file, by the one golden policy of ``harness.goldens``; what it found
recorded on the test for the session's summary."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

if TYPE_CHECKING:
    import torch

from harness.compare import Bound, Tolerance
from harness.errors import ConfigError, GoldenError
from harness.goldens import GoldenResult, GoldenStore, check_report
from harness.plugin._keys import _GOLDEN_PROP, GoldenRecord
from harness.report import EquivalenceReport


class GoldenVerdict(NamedTuple):
    """What ``spatial.check(golden=...)`` learnt of its golden: the status for its summary
    row (``None`` where the golden could not be read) and the failure's text (``""`` when it
    passed)."""

    status: str | None
    failure: str


class GoldenFixture:
    """What a test sees as ``golden``: ``golden.check(tensors, name=None, tolerance=None)``."""

    def __init__(self, store: GoldenStore, node: pytest.Item) -> None:
        self._store = store
        self._node = node

    def check(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        name: str | None = None,
        tolerance: Bound | tuple[float, float] | None = None,
        allow_nonfinite: bool = False,
    ) -> GoldenResult:
        """Compare ``tensors`` ({name: tensor}) with this test's golden; fail if they differ.

        ``tolerance`` is a ``Bound`` or ``(rtol, atol)``; the default is the field tolerance
        of the tensors' dtype (``Tolerance.for_dtype``). A NaN or inf on either side fails
        (and is never written) unless ``allow_nonfinite``.
        """
        __tracebackhide__ = True
        if not tensors:
            raise ConfigError("golden.check needs at least one tensor")
        if tolerance is None:
            bound = Tolerance.for_dtype(next(iter(tensors.values())).dtype).field
        else:
            bound = tolerance if isinstance(tolerance, Bound) else Bound(*tolerance)
        result = self.check_tensors(
            tensors, name=name, bound=bound, allow_nonfinite=allow_nonfinite
        )
        if not result.ok:
            pytest.fail(str(result), pytrace=False)
        return result

    def check_tensors(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        name: str | None,
        bound: Bound,
        provenance: dict[str, object] | None = None,
        refuse_update: str | None = None,
        allow_nonfinite: bool = False,
    ) -> GoldenResult:
        """``check``'s comparison, returned rather than failed on: ``tensors`` against the
        golden ``name`` within ``bound``; under ``--update-goldens`` written (with
        ``provenance``), or kept as it is when ``refuse_update`` says why."""
        __tracebackhide__ = True
        path = self._path(name)
        if refuse_update and self._store.update:
            result = self._store.not_updated(path, refuse_update)
        else:
            try:
                result = self._store.check(
                    path,
                    tensors,
                    bound=bound,
                    provenance=provenance,
                    allow_nonfinite=allow_nonfinite,
                )
            except GoldenError as exc:  # corrupt, foreign, a directory, a full disk
                pytest.fail(str(exc), pytrace=False)
        self._record(path, result)
        return result

    def check_report(
        self,
        report: EquivalenceReport,
        *,
        name: str | None,
        allow_nonfinite: bool,
        provenance: dict[str, object],
    ) -> GoldenResult:
        """``report``'s reference against this test's golden, by the one golden policy
        (``harness.goldens.check_report``)."""
        __tracebackhide__ = True
        path = self._path(name)
        try:
            result = check_report(
                self._store, path, report, provenance=provenance, allow_nonfinite=allow_nonfinite
            )
        except GoldenError as exc:  # corrupt, foreign, a directory, a full disk
            pytest.fail(str(exc), pytrace=False)
        self._record(path, result)
        return result

    def verdict(
        self, report: EquivalenceReport, name: str | None, *, allow_nonfinite: bool, seed: object
    ) -> GoldenVerdict:
        """``report``'s reference against this test's golden (``check_report``), as
        ``spatial.check`` says it beside the report's own failure, so neither hides the
        other: a corrupt or foreign golden is a failure text here, not a raise."""
        __tracebackhide__ = True
        try:
            result = self.check_report(
                report, name=name, allow_nonfinite=allow_nonfinite, provenance={"seed": seed}
            )
        except pytest.fail.Exception as exc:  # a corrupt or foreign golden
            return GoldenVerdict(None, str(exc.msg))
        # plain text: rows travel to the controller
        return GoldenVerdict(str(result.status), "" if result.ok else str(result))

    def _path(self, name: str | None) -> Path:
        """This test's golden path, claimed for it: another test mapping to the same file
        fails here, naming both, before it reads or writes it."""
        __tracebackhide__ = True
        path = self._store.path_for(self._node.nodeid, name)
        try:
            self._store.claim(path, self._node.nodeid)
        except GoldenError as exc:
            pytest.fail(str(exc), pytrace=False)
        return path

    def _record(self, path: Path, result: GoldenResult) -> None:
        # plain text: user properties travel to xdist's controller
        # (what a write changed rides along, for the review summary)
        change = None if result.change is None else result.change.plain()
        record: GoldenRecord = (str(path), str(result.status), change)
        self._node.user_properties.append((_GOLDEN_PROP, record))
