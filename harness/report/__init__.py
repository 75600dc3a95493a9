"""What a check found, as a person reads it: ``EquivalenceReport``, its tables, the remedies.

The comparison itself (``Tolerance``, ``Bound``, ``Mismatch``, ``compare_tensors``) is in
``harness.compare``; the hints that name a likely cause are in ``harness.report.hints``. This module
renders: a report's text, the mismatch table, the session's equivalence table, and what to do
about each ``Quantity`` (``REMEDIES``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from harness._records.run import FieldError  # its home before records.py: still importable here
from harness.compare import NUMERIC, Mismatch, Quantity, QuantityStats, Tolerance
from harness.errors import EquivalenceFailure

if TYPE_CHECKING:
    from harness._records.rollout import RolloutRecord
    from harness.divergence import Divergence, Location


class SummaryRow(TypedDict, total=False):
    """One check's line of the equivalence table (``EquivalenceReport.summary_row``): a
    plain dict, so it travels from an xdist worker to the controller; ``test`` and
    ``golden`` are added by whoever ran the check."""

    case: str
    ranks: int
    spatial: int
    partition: str
    dtype: str
    worst: dict[str, float | None]  # quantity -> worst relative error (None: not compared)
    ok: bool
    problems: list[str]
    seconds: float
    #: what ran, so rows of one case and partition tell apart: ``steps 2``, ``rollout 150``,
    #: ``layouts 13 of 13`` (a sweep), ``examples 20`` (a Hypothesis test's checks)
    label: str
    test: str
    golden: str
    calibration: list[str]  # --spatial-calibrate: the measured noise per quantity
    #: a failing check's lines in the user's code (``harness.report.sites.Site``, plain dicts)
    sites: list[dict[str, Any]]
    call_site: list[object]  # [file, line] of the test's line that ran the check


#: What to do about each quantity; keyed on ``Quantity`` (so plain text finds it too).
REMEDIES: dict[str, str] = {
    Quantity.LOSS: (
        "The loss differs: a global loss is the sum over the spatial group of each rank's "
        "weighted sum and of its weight sum (not a mean of per-rank means), averaged over "
        "data groups only, with any weights or mask taken for the rank's own part."
    ),
    Quantity.GRAD: (
        "Gradients differ: every collective in the forward needs its matching backward (a "
        "sum's sums, a gather's reduce-scatters, a transpose's transposes back), and a "
        "replicated parameter's gradient is summed once over the spatial group."
    ),
    Quantity.FIELD: (
        "Outputs differ: check how the domain is split and put back together (split rule, "
        "order of the parts, sample-major with data groups), indices that must be global, "
        "and anything random drawn for the whole domain."
    ),
    Quantity.COVERAGE: (
        "Some positions are owned by no rank or by several: each global position must "
        "appear in exactly one rank's Shard index (for Shard.keyed: each of the reference's "
        "keys held by exactly one rank, samples keyed by their global index)."
    ),
    Quantity.PARAM: (
        "Parameters after an optimizer step differ from the reference: follow the first "
        "gradient mismatch, or check initialisation is seeded identically on every rank (a "
        "parameter a rank holds only part of: name it in parameter_shards, its values taken "
        "from the reference's positions)."
    ),
    Quantity.SYNC: (
        "Ranks of one spatial group hold different parameters after a step: their "
        "gradients were not synchronised (sum over the spatial group before stepping)."
    ),
    Quantity.BUFFER: (
        "A buffer was modified in place during a step while the reference's was not: "
        "DDP-style broadcast_buffers copies into buffers between forwards."
    ),
    Quantity.NONFINITE: (
        "A NaN or inf: no comparison can vouch for a value that is not finite. If "
        "the reference is not finite, make the case finite (inputs, initialisation, lr); if only "
        "ranks are, look for a division by a per-rank count that is zero on an empty rank, or an "
        "uninitialised halo or padding. If the model is meant to produce them, set "
        "expect_nonfinite = True on the case: then they must match position for position."
    ),
    Quantity.CRASH: ("A rank process died: its exit code or signal and last output are above."),
    Quantity.ERROR: (
        "A rank raised: its traceback is above (listed first: the rank that failed "
        "first; ranks that lost a peer in a collective follow)."
    ),
    Quantity.TIMEOUT: (
        "A rank did not finish in time, and nothing proved a deadlock: it computes or "
        "waits on something the harness cannot see (a spin loop, a lock, a file), or the work is "
        "slower than the timeout. Every rank's stack is above."
    ),
    Quantity.DEADLOCK: (
        "The run can never finish: each waiting rank says what it waits in (operation, "
        "group, number, size, line) and which rank never did its part, by skipping a collective, "
        "a send or a receive, or by calling a different one (an empty domain that skips a "
        "reduction or a gather?). Every waiting rank's stack is above."
    ),
    Quantity.BATCH: (
        "The reference's batch is not the data groups' batches together: size the "
        "global batch without topo.data_size (the reference always has data_size 1) and give "
        "each data group its share with data_share(n, topo)."
    ),
    Quantity.PENDING: (
        "A rank returned with an operation that can never complete: a collective "
        "some member never entered, or an isend nobody receives. Match every collective on every "
        "member and every send with a receive before returning."
    ),
    Quantity.ROLLOUT: (
        "An inference rollout left the rounding spread at the step named: look for what "
        "only inference does (eval mode, no_grad, state kept across steps): a halo or buffer "
        "received once and reused, a statistic taken over the rank's part in eval mode, "
        "noise drawn per rank, a step counter kept per rank."
    ),
    Quantity.VACUOUS: (
        "The check proves nothing about the parallel code: give each rank only its part "
        "of the domain, return its part of each field as a Shard, and communicate what the model "
        "needs from the others; if the case is meant to be replicated, say why with vacuous_ok = "
        '"reason" on the case.'
    ),
}


@dataclass(repr=False)
class EquivalenceReport:
    """What ``check_equivalence`` found. ``ok`` is true when nothing mismatched.

    ``str(report)`` is a table: problem, evidence, remedy.
    """

    case: str
    ranks: int
    spatial_size: int
    partition: str
    steps: int
    dtype: str
    tolerance: Tolerance | None
    mismatches: list[Mismatch] = field(default_factory=list)
    stats: dict[str, QuantityStats] = field(default_factory=dict)
    reference: dict[str, torch.Tensor] = field(default_factory=dict)
    field_errors: list[FieldError] = field(default_factory=list)
    seconds: float = 0.0
    likely: str = ""  # the one line most likely to name the bug, if the evidence says
    latitudes: list[float] | None = None  # the case's, for error maps (SpatialCase.latitudes)
    #: what the run did that a reader must know to trust the verdict, one line each (e.g.
    #: shards loaded from the reference); shown under the report's first line
    notes: list[str] = field(default_factory=list)
    #: where the partitioned run first departs from the reference
    #: (``harness.equivalence._locating``):
    #: ``None`` when nothing was located, or locating did not run
    first_divergence: Divergence | None = None
    location: Location | None = None  # what locating found (and could not compare)
    #: what a diagnosis (locating, a hint) could not do, one line each, shown as written
    #: (``Not located: ... (TypeError: ...)``): it failed, the verdict stands
    diagnoses: list[str] = field(default_factory=list)
    #: the inference rollout's per-step error curve (``check_equivalence(..., rollout=N)``)
    rollout: RolloutRecord | None = None
    #: the steps of the rollout asked for (0: none); set also where it failed and ``rollout``
    #: is ``None``, so the header says both runs' steps
    rollout_steps: int = 0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def quantities(self) -> set[str]:
        """The quantities that mismatched, as plain text (they travel to xdist's controller,
        which carries built-in types only)."""
        return {m.quantity.value for m in self.mismatches}

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        # ``assert report.ok, report`` shows the repr: make it the table, not the fields
        return str(self)

    def raise_if_failed(self) -> None:
        """Raise ``EquivalenceFailure`` (an ``AssertionError``) with the whole report as its
        message if anything mismatched.

        ``assert report.ok, report`` works too, but pytest renders an assertion's message
        object through ``saferepr``, which can cut it to one line of 240 characters
        (depending on its version and verbosity; inside a Hypothesis test, the falsifying
        example's report is then lost); a raised message is shown whole.
        """
        __tracebackhide__ = True  # pytest: the failure is the report's, not this line's
        if not self.ok:
            raise EquivalenceFailure(str(self), self)

    def worst(self, quantity: str) -> float | None:
        s = self.stats.get(quantity)
        return s.max_rel if s and s.compared else None

    def spread_multiple(self, quantity: Quantity | str) -> float | None:
        """The largest error of a calibrated check's ``quantity`` as a multiple of its
        entry's rounding spread (``None``: not judged by rounding)."""
        s = self.stats.get(Quantity(quantity))
        if s is None or math.isnan(s.spread_multiple):
            return None
        return s.spread_multiple

    def spread_text(self) -> str:
        """``"loss 0.9x, grad 3.8x, ..."``: each calibrated quantity's worst multiple of its
        rounding spread; empty where the check was judged by a tolerance."""
        parts = []
        for q in NUMERIC:
            multiple = self.spread_multiple(q)
            if multiple is not None:
                parts.append(f"{q} {multiple:.2g}x")
        return ", ".join(parts)

    def summary_row(self) -> SummaryRow:
        """A picklable summary for terminal tables (one row per check)."""
        return {
            "case": self.case,
            "ranks": self.ranks,
            "spatial": self.spatial_size,
            "partition": self.partition,
            "dtype": self.dtype,
            "worst": {str(q): self.worst(q) for q in NUMERIC},  # plain text keys: rows travel
            "ok": self.ok,
            "problems": sorted(self.quantities),
            "seconds": round(self.seconds, 2),
            "label": (
                f"rollout {self.rollout_steps}" if self.rollout_steps else f"steps {self.steps}"
            ),
        }

    def __str__(self) -> str:
        layout = f"spatial {self.spatial_size}"
        if self.partition and self.partition != layout:
            layout += f", {self.partition}"
        steps = f"{self.steps} step" + ("" if self.steps == 1 else "s")
        if self.rollout_steps:  # "2 steps" alone reads as the rollout's when it failed
            steps = f"{self.steps} training step" + ("" if self.steps == 1 else "s")
            steps += f" and a rollout of {self.rollout_steps}"
        head = f"{self.case} on {self.ranks} ranks ({layout}), {steps}, {self.dtype}: "
        if self.ok:
            worst = ", ".join(
                f"{q} {self.worst(q):.1e}" for q in NUMERIC if self.worst(q) is not None
            )
            verdict = head + f"equivalent to the reference (worst relative error: {worst}"
            spread = self.spread_text()
            verdict += f"; worst multiple of the rounding spread: {spread})" if spread else ")"
            located = self._located()
            rolled = self.rollout.lines() if self.rollout is not None else []
            return "\n".join([verdict, *(f"Note: {n}" for n in self.notes), *rolled, *located])
        lines = [
            head + f"{len(self.mismatches)} mismatch(es) with the reference",
            *(f"Note: {n}" for n in self.notes),
            f"First: {self.mismatches[0].headline()}",
            *(self.rollout.lines() if self.rollout is not None else []),
            *self._located(),
            *([f"Likely cause: {self.likely}"] if self.likely else []),
            "",
        ]
        table = mismatch_table(self.mismatches)
        lines += table[:42]
        if len(table) > 42:
            lines.append(f"... and {len(table) - 42} more rows")
        details = [m for m in self.mismatches if m.detail or m.hint][:6]
        for m in details:
            lines += ["", m.headline()]
            if m.hint:
                lines.append(f"  -> {m.hint}")
            if m.detail:
                lines += ["  " + line for line in m.detail.rstrip().splitlines()[-40:]]
        lines.append("")
        if self.tolerance is not None:
            judged = " (where not judged by rounding)" if self.spread_text() else ""
            lines.append(f"Tolerance{judged}: {_tol_text(self.tolerance)}")
        lines.append("What to do:")
        if self.first_divergence is not None:
            lines.append(
                f"  {self.first_divergence.located}: {located_remedy(self.first_divergence)}"
            )
        seen: list[str] = []
        for m in self.mismatches:
            if m.quantity not in seen:
                seen.append(m.quantity)
                lines.append(f"  {m.quantity}: {REMEDIES[m.quantity]}")
        return "\n".join(lines)

    def _located(self) -> list[str]:
        """Locating's lines, then what a diagnosis could not do; a location that cannot be
        written is one line more, never a report that cannot be read."""
        lines: list[str] = []
        if self.location is not None:
            try:
                lines = self.location.lines()
            except Exception as exc:  # noqa: BLE001 - a diagnosis never hides the verdict
                lines = [f"Not located: the first divergence could not be written ({exc!r})"]
        return lines + list(self.diagnoses)


def located_remedy(found: Divergence) -> str:
    """What to do about a first divergence, in the words of what it names (the module, the
    parameter, the loss, a field), never of a particular model."""
    if found.cause == "synchronisation":
        return (
            f"the ranks' gradients of {found.name!r} add up to the reference's before its "
            "synchronisation and depart after it: look where it is synchronised (summed over "
            "the spatial group once: not averaged, not twice, not over other groups; a sharded "
            "parameter's gradient is its own shard's, never summed with the others')."
        )
    if found.cause in ("backward", "undecided"):
        where = f" ({', '.join(found.function)}'s backward)" if found.function else ""
        sync = "" if found.cause == "backward" else "where it is synchronised, and "
        return (
            f"the gradient of {found.name!r} departs: look {sync}at the backward of "
            f"{found.module!r}{where}: every part of the gradient each rank owes the parameter "
            "(a hop of a ring, a block sent back to the rank that owns it) summed in once."
        )
    if found.cause == "misplaced":
        return (
            f"rank {found.rank} holds the reference's values of {found.belongs} and says "
            f"they are at {found.said}: look at the positions its Shard names (index, order, "
            "rows and columns)."
        )
    if found.cause == "absent":
        return (
            f"rank {found.rank} never calls it while the reference does: every rank must "
            "make the same calls (a rank with an empty part too)."
        )
    if found.direction == "field":
        return (
            "every module matches but this field does not: look at the positions its "
            "Shard says the rank holds (index, order, grid)."
        )
    if found.module is None:
        return _outside_remedy(found)
    own = "its own code (outside its submodules)" if found.quantity != "output" else "it"
    if found.direction == "forward":
        return (
            f"what it consumed matches and its result does not: look in {own}, at its "
            "communication (which parts, in which order, over which group) and at what it "
            "computes from the rank's part."
        )
    return (
        f"the gradient it received matches and the one it sends on does not: look in {own} "
        "for a collective whose backward is missing or wrong (detached, in place, or an "
        "identity where the gradient must be reduced or sent back)."
    )


def _outside_remedy(found: Divergence) -> str:
    """What to do about a first divergence outside every module: predict's code, the
    batch, the loss."""
    if found.name.startswith(
        "predict's code"
    ):  # harness.equivalence._locating_rollout.PREDICT_CODE
        return (
            "the module calls before it match and this input does not: look at what "
            "predict (or a model method it calls outside a module) does between the "
            "modules: what it feeds back, adds, draws or keeps across steps."
        )
    if "batch" in found.name:
        return "the model's input differs: look at which part of the batch a rank reads."
    if found.direction == "forward":
        return (
            "the model's outputs match and the loss does not: look at how the ranks' "
            "parts of the loss are combined into the global loss."
        )
    return (
        "the gradient leaving the loss departs: look at the backward of the loss's "
        "reduction (each rank's loss is the global one: its backward passes the "
        "gradient on once)."
    )


def _tol_text(t: Tolerance) -> str:
    return "; ".join(f"{q} rtol {t.bound(q).rtol:g} atol {t.bound(q).atol:g}" for q in NUMERIC)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def _rank_text(ranks: list[int | None]) -> str:
    if any(r is None for r in ranks):
        return "all"
    rs = sorted(set(r for r in ranks if r is not None))
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def _collapse(mismatches: Sequence[Mismatch]) -> list[tuple[Mismatch, list[int | None]]]:
    """One row per (quantity, run, name, step): the worst rank's numbers, every rank listed."""
    rows: dict[tuple[object, ...], tuple[Mismatch, list[int | None]]] = {}
    for m in mismatches:
        key = (m.quantity, m.run, m.of, m.name, m.step)
        if key not in rows:
            rows[key] = (m, [m.rank])
            continue
        worst, ranks = rows[key]
        ranks.append(m.rank)
        if not math.isnan(m.max_abs) and not (m.max_abs <= worst.max_abs):
            rows[key] = (m, ranks)
    return list(rows.values())


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, free_last: bool = False
) -> list[str]:
    """Left-aligned columns two spaces apart, a dashed rule under the header.

    ``free_last``: the last column is free-form text, so it sets no width.

    >>> format_table(("a", "bb"), [("xyz", "1")])
    ['a    bb', '---  --', 'xyz  1']
    """
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    if free_last:
        widths[-1] = len(header[-1])

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def step_cell(m: Mismatch) -> str:
    """The table's step: the training step; else where the failure was (``build``,
    ``teardown``; a rollout's ``rollout``, ``rollout 2`` where its step is known).

    >>> step_cell(Mismatch("error", "c", None, 1, phase="rollout step 2 predict"))
    'rollout 2'
    >>> step_cell(Mismatch("error", "c", None, 1, phase="rollout predict (3 model calls so far)"))
    'rollout'
    """
    if m.step is not None:
        return str(m.step)
    words = m.phase.split()
    if not words or words[0] == "build":
        return "build"
    if words[0] == "rollout":
        at = words[2] if len(words) > 2 and words[1] == "step" else ""
        return f"rollout {at}".strip()
    return words[0].rstrip(",:")


def mismatch_table(mismatches: Sequence[Mismatch]) -> list[str]:
    """The report's table: one row per quantity, name and step; ranks collapsed."""
    header = ("quantity", "name", "step", "rank", "max abs", "max rel", "over tol", "worst at")
    rows = []
    for m, ranks in _collapse(mismatches):
        owner = (
            f" (rank {m.rank})"
            if len(set(ranks)) > 1 and m.rank is not None and "rank" not in m.where
            else ""
        )
        rows.append(
            (
                m.quantity,
                m.label,
                step_cell(m),
                m.run or _rank_text(ranks),
                _fmt(m.max_abs),
                _fmt(m.max_rel),
                f"{m.count}/{m.total}" if m.total else "-",
                (m.where or "-") + owner,
            )
        )
    return format_table(header, rows, free_last=True)


def equivalence_table(
    rows: list[SummaryRow], width: int | None = None, *, show_ranks: bool = True
) -> list[str]:
    """The terminal table of every equivalence checked: one line per check, sweep or
    Hypothesis test, labelled with what ran (``SummaryRow.label``).

    With ``width``, the partition column is shortened (ending in "...") until each line
    fits, down to 12 characters, then the test's name (shown only where rows are alike but
    for their test) likewise. ``show_ranks=False`` leaves out the ranks column (when every
    row has the same).
    """
    header: tuple[str, ...] = (
        "case",
        "check",
        "ranks",
        "partition",
        "dtype",
        *NUMERIC,
        "golden",
        "verdict",
    )
    body: list[tuple[str, ...]] = []
    for r in rows:
        w = r["worst"]
        body.append(
            (
                r["case"],
                r.get("label", "-"),
                f"{r['ranks']}",
                r["partition"],
                r["dtype"],
                *("-" if w.get(q) is None else f"{w[q]:.1e}" for q in NUMERIC),
                r.get("golden", "-"),
                "equivalent" if r["ok"] else "MISMATCH: " + ",".join(r["problems"]),
            )
        )
    if not show_ranks:
        header = (*header[:2], *header[3:])
        body = [(*b[:2], *b[3:]) for b in body]
    if _alike(rows):  # rows alike but for their test (the plugin's rows know it): named
        header = ("test", *header)
        body = [(_test_name(r.get("test", "")), *b) for r, b in zip(rows, body, strict=True)]
    # the partition gives way first, then the test's name, each to no less than 12
    for p in [header.index(c) for c in ("partition", "test") if c in header]:
        if width is not None and body:
            longest = max(len(line) for line in format_table(header, body))
            room = max(12, max(len(b[p]) for b in body) - max(0, longest - width))
            body = [(*b[:p], _shorten(b[p], room), *b[p + 1 :]) for b in body]
    return [
        "worst relative error per quantity, partitioned vs reference:",
        *format_table(header, body),
    ]


def _alike(rows: list[SummaryRow]) -> bool:
    """Two rows of the same case, check, ranks and partition, whose tests are known: only
    their tests tell them apart (a column the table otherwise spares: 100 columns)."""
    seen = {(r["case"], r.get("label"), r["ranks"], r["partition"]) for r in rows}
    return len(seen) < len(rows) and any(r.get("test") for r in rows)


def _test_name(nodeid: str) -> str:
    """A test's name without its file (the table is sorted by node id, so files group).

    >>> _test_name("tests/test_a.py::TestX::test_b[2x2]")
    'TestX::test_b[2x2]'
    """
    return nodeid.split("::", 1)[-1] or "-"


def _shorten(text: str, room: int) -> str:
    return text if len(text) <= room else text[: room - 3] + "..."
