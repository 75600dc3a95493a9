"""Production precision: a check run under ``torch.autocast`` (bf16 mixed precision), judged
by the ratio rule.

Under bf16 autocast the partitioned run and the serial run both sit ~1e-3..1e-2 away from
the high-precision run, each in its own direction: no fixed tolerance separates the
partitioned run's rounding from a bug. lightning-thunder's rule does: the partitioned bf16
run may be no further from the case's high-precision run than ``RATIO`` times the serial
bf16 run is. Three runs: the high-precision reference (``H``, the case as it is), the
serial reference under autocast (``S``) and every rank under autocast (``P``). For each
step and each loss, gradient, field and parameter: ``|P - H| <= RATIO * |S - H| + floor``,
distances as the L2 norm of the whole (reassembled) tensor, ``floor`` the high-precision
dtype's own tolerance (so where autocast changed nothing, ``P`` must match ``H`` as in a
plain check). What only the layout can break (coverage, shard shapes, copies in sync,
buffers, NaN) is judged as in a plain check, against ``S``.

Guard: a check whose training moved no parameter, or whose loss is zero, would pass the
rule by comparing nothing; it fails as ``vacuous``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from harness._judges.fields import assemble_whole, flat_like
from harness._rank.predict import autocast_context
from harness._records.run import FieldRecord, RunRecord
from harness.compare import NUMERIC, Mismatch, Quantity, Tolerance
from harness.errors import ConfigError

if TYPE_CHECKING:
    from harness.case import SpatialCase
    from harness.report import EquivalenceReport

#: ``|P - H| <= RATIO * max(|S - H|, u * |H|) + floor`` (``u``: the autocast dtype's unit
#: roundoff, see ``judge_autocast``). Measured (bf16 autocast, float32 cases, 4 ranks, 2
#: steps, seeds 0 and 1): the partitioned run's distance from the float32 run was at most
#: 1.0x (MLP), 1.5x (SFNO 2x2, 4x1, with noise) and 1.3x (HEALPix even and uneven) the
#: serial bf16 run's, over every loss, gradient, field and parameter: one more draw of the
#: same rounding. 4 leaves a margin of 2.7x over the worst seen; the logic bugs measured
#: under autocast (gradients not synced, a wrong shard index, a mean of means, a global sum
#: with identity backward) sit at 90x-470x.
RATIO = 4.0

AUTOCASTABLE = (torch.bfloat16, torch.float16)


def check_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` if autocast can run at it on the CPU, else one clear error."""
    if dtype not in AUTOCASTABLE:
        raise ConfigError(
            f"autocast={dtype!r}: give torch.bfloat16 (what production mixed precision uses on "
            "the CPU's autocast) or torch.float16, or None for no autocast"
        )
    return dtype  # type: ignore[no-any-return]


def _autocast_entry(dtype: torch.dtype, *args: Any, **kwargs: Any) -> RunRecord:
    """A rank's run under autocast (module level: the pool pickles it)."""
    from harness._rank.run import rank_entry

    with autocast_context(dtype):
        return rank_entry(*args, **kwargs)


def _l2(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    d = a.to(torch.float64) - b.to(torch.float64)
    return float(torch.linalg.vector_norm(d.nan_to_num(nan=math.inf)))


def _pairs(
    high: RunRecord, serial: RunRecord, ranks: list[RunRecord], spatial_size: int
) -> Iterator[tuple[Quantity, str, int, int | None, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every compared tensor: (quantity, name, step, rank, H, S, P) in the reference's
    layout; whole quantities once per rank, fields reassembled over the ranks."""
    sharded = {n for r in ranks for n in r.param_shards}
    for k, (h, s) in enumerate(zip(high.steps, serial.steps)):
        steps = [r.steps[k] for r in ranks]
        for rank, st in enumerate(steps):
            yield Quantity.LOSS, "loss", k, rank, h.loss, s.loss, st.loss
            for n, g in h.grads.items():
                if g is not None and n not in sharded and st.grads.get(n) is not None:
                    sg = s.grads.get(n)
                    if sg is not None:
                        yield Quantity.GRAD, n, k, rank, g, sg, st.grads[n]  # type: ignore[misc]
        for n, f in h.fields.items():
            got: list[FieldRecord] = [st.fields[n] for st in steps]
            if f.keyed or any(x.keyed for x in got) or n not in s.fields:
                continue
            p = assemble_whole(n, f.values, got, spatial_size)
            yield Quantity.FIELD, n, k, None, flat_like(f, got), flat_like(s.fields[n], got), p
        for rank, st in enumerate(steps):
            for n, v in h.params.items():
                if n not in sharded and n in st.params and n in s.params:
                    yield Quantity.PARAM, n, k, rank, v, s.params[n], st.params[n]


def judge_autocast(
    high: RunRecord,
    serial: RunRecord,
    ranks: list[RunRecord],
    high_tolerance: Tolerance,
    *,
    spatial_size: int,
    dtype: str = "bfloat16",
    ratio: float = RATIO,
) -> tuple[list[Mismatch], float]:
    """The ratio rule over every compared tensor; the mismatches (one per quantity, name
    and step, its worst rank) and the largest ratio seen."""
    worst: dict[tuple[str, str, int], Mismatch] = {}
    largest = 0.0
    # one rounding of the quantity at the autocast dtype (its unit roundoff): the serial run
    # is one draw of the rounding, and for a scalar (the loss) it can land arbitrarily close
    # to the high-precision value by chance; the partitioned run may always be RATIO such
    # roundings away. Measured without it: a correct SFNO (noise=1) failed at 4.02x on its
    # loss, the serial bf16 loss 8e-4 from the float32 one.
    unit = float(torch.finfo(getattr(torch, dtype)).eps) / 2
    for quantity, name, step, rank, h, s, p in _pairs(high, serial, ranks, spatial_size):
        bound = high_tolerance.bound(quantity)
        d_p, d_s = _l2(p, h), _l2(s, h)
        size = _l2(h, torch.zeros_like(h))
        floor = bound.atol * math.sqrt(max(h.numel(), 1)) + bound.rtol * size
        if d_s > 0:  # autocast reached this quantity: its rounding is at least one unit
            d_s = max(d_s, unit * size)
        r = d_p / d_s if d_s > 0 else (0.0 if d_p == 0 else math.inf)
        if d_s > 0 and not math.isinf(r):
            largest = max(largest, r)
        # a non-finite distance never passes: inf <= RATIO * inf would (a NaN in the
        # high-precision run and in the partitioned one alike)
        if math.isfinite(d_p) and d_p <= ratio * d_s + floor:
            continue
        key = (quantity, name, step)
        if key in worst and not (r > worst[key].max_rel):
            continue
        rtext = "inf" if math.isinf(r) else f"{r:.3g}"
        worst[key] = Mismatch(
            quantity,
            name,
            step,
            rank,
            max_abs=d_p,
            max_rel=r,
            where=f"{rtext}x the serial {dtype} run's distance from the high-precision run "
            f"(L2 {d_p:.3g} vs {d_s:.3g}; bound {ratio:g}x)",
        )
    order = {q: i for i, q in enumerate(NUMERIC)}
    found = sorted(worst.values(), key=lambda m: (m.step or 0, order[m.quantity]))
    return found, largest


def guard(high: RunRecord, label: str) -> list[Mismatch]:
    """The ratio rule compares distances: with no parameter moved or a zero loss there is
    nothing to compare, so the check would pass vacuously."""
    moved = any(
        not torch.equal(st.params[n], high.init[n])
        for st in high.steps[-1:]
        for n in st.params
        if n in high.init
    )
    loss_zero = all(float(st.loss.abs()) == 0.0 for st in high.steps)
    if moved and not loss_zero:
        return []
    why = "the loss is zero at every step" if loss_zero else "no parameter moved in training"
    return [
        Mismatch(
            Quantity.VACUOUS,
            label,
            None,
            None,
            where=f"autocast check: {why}, so the ratio rule compares nothing; give the case "
            "a loss that depends on its parameters and a learning rate that moves them",
        )
    ]


def serial_run(
    case: SpatialCase, dtype: torch.dtype, steps: int, lr: float, seed: int
) -> tuple[RunRecord, Tolerance, tuple[Any, ...]]:
    """The serial run under autocast (what the ranks' layout is checked against), the
    tolerance for that check (unbounded: with it a loss, gradient, field or parameter
    mismatches only on its shape, dtype or a NaN; values are the ratio rule's), and the
    ranks' entry."""
    from harness._rank.run import run_case
    from harness.topology import Topology

    with autocast_context(dtype):
        serial = run_case(case, Topology.single(), steps, lr, seed)
    return serial, Tolerance.uniform(math.inf, math.inf), (_autocast_entry, dtype)


def ratio_rule(
    case: SpatialCase,
    report: EquivalenceReport,
    high: RunRecord,
    serial: RunRecord,
    records: list[RunRecord],
    dtype: torch.dtype,
) -> None:
    """Add the ratio rule's mismatches, and the guard's, to ``report``; say so in a note."""
    name = str(dtype).replace("torch.", "")
    report.dtype = f"{report.dtype}, {name} autocast"
    values, largest = judge_autocast(
        high,
        serial,
        records,
        report.tolerance or Tolerance.for_dtype(high.steps[0].loss.dtype),
        spatial_size=report.spatial_size,
        dtype=name,
    )
    report.mismatches[:0] = guard(high, case.label)
    report.mismatches += values
    changed = any(
        _l2(s, h) > 0 for _, _, _, _, h, s, _ in _pairs(high, serial, records, report.spatial_size)
    )
    if not changed:
        report.notes.append(
            f"autocast {name} changed nothing: the serial run under it is the high-precision "
            "run bit for bit (CPU autocast leaves float64 alone; run the case in float32 to "
            "test mixed precision)"
        )
    report.notes.append(
        f"autocast {name}: each loss, gradient, field and parameter is judged by its distance "
        f"from the high-precision run, at most {RATIO:g}x the serial {name} run's (largest "
        f"seen {largest:.2g}x); layout against the serial {name} run"
    )
