"""Plain values, one function per quantity: non-finite values, parameters after build,
loss, gradients, parameters after a step (with their co-rank ``sync``) and buffers; a
sharded parameter's shard is compared with the reference at its positions."""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import torch

from harness.checks.fields import _shard_position
from harness.checks.judge import Judge, index_text
from harness.checks.shards import PARAM_SHARD_HINT, SHARD_INIT_HINT, ParamShards
from harness.compare import (
    Difference,
    Mismatch,
    Tolerance,
    bits_differ,
    bitwise_equal,
    compare_tensors,
    nonfinite_counts,
    nonfinite_text,
)
from harness.records import ParamShard, RunRecord, StepRecord

# ---------------------------------------------------------------------- non-finite values


def _nonfinite(
    of: str,
    name: str,
    step: int | None,
    values: torch.Tensor,
    rank: int | None,
    where: Callable[[int], str] | None = None,
) -> Mismatch | None:
    nan, inf, first = nonfinite_counts(values)
    if first is None:
        return None
    pos = where(first) if where else index_text(values.shape, first)
    return Mismatch(
        "nonfinite",
        name,
        step,
        rank,
        where=(pos + " " if pos else "") + f"({nonfinite_text(nan, inf)})",
        count=nan + inf,
        total=values.numel(),
        run="reference" if rank is None else "",
        of=of,
    )


def check_nonfinite_init(reference: RunRecord, records: list[RunRecord]) -> list[Mismatch]:
    """A NaN or inf in the parameters right after build, in the reference or on a rank."""
    found = []
    for rank, rec in [(None, reference), *enumerate(records)]:
        for name, p in rec.init.items():
            m = _nonfinite("param", name, None, p, rank)
            if m:
                found.append(m)
    return found


def check_nonfinite_step(step: int, ref: StepRecord, steps: list[StepRecord]) -> list[Mismatch]:
    """A NaN or inf anywhere in one step: the reference's first, then each rank's.

    A comparison cannot vouch for a value that is not finite, so each one is a finding of
    its own (``nonfinite``), named by run, quantity, name, step and position.
    """
    found = []
    for rank, st in [(None, ref), *enumerate(steps)]:
        candidates = [
            _nonfinite("loss", "loss", step, st.loss, rank),
            *(_nonfinite("grad", n, step, g, rank) for n, g in st.grads.items() if g is not None),
            *(
                _nonfinite("field", n, step, f.values, rank, _shard_position(f))
                for n, f in st.fields.items()
            ),
            *(_nonfinite("param", n, step, p, rank) for n, p in st.params.items()),
        ]
        found += [m for m in candidates if m is not None]
    return found


# ---------------------------------------------------------------------- parameters after build


def _init_mismatch(name: str, rank: int, d: Difference, where: str, hint: str) -> Mismatch:
    """A parameter that differs right after build (no step yet): ``where`` unless the
    comparison named a problem of its own (a shape, a dtype)."""
    return Mismatch(
        "param",
        name,
        None,
        rank,
        d.max_abs,
        d.max_rel,
        d.problem or where,
        d.count,
        d.total,
        hint=hint,
    )


def check_init(
    reference: RunRecord, records: list[RunRecord], tolerance: Tolerance
) -> list[Mismatch]:
    """Parameters right after build: unseeded initialisation shows here first. Sharded
    parameters (``RunRecord.param_shards``) are left to ``check_sharded_init``."""
    found = []
    ref = reference.init
    sharded = {n for rec in records for n in rec.param_shards}
    for rank, rec in enumerate(records):
        for name, p in rec.init.items():
            if name in sharded and name in ref:
                continue
            if name not in ref:
                found.append(
                    Mismatch(
                        "param", name, None, rank, where="parameter not in the reference model"
                    )
                )
                continue
            d = compare_tensors(p, ref[name], tolerance.param, allow_nonfinite=True)
            if not d.ok:
                found.append(
                    _init_mismatch(name, rank, d, "initial value", _init_hint(p, ref[name]))
                )
        for name in sorted(ref.keys() - rec.init.keys()):
            found.append(
                Mismatch(
                    "param", name, None, rank, where="reference parameter missing on this rank"
                )
            )
    return found


SEED_HINT = (
    "differs from the reference right after build: seed the initialisation identically on "
    "every rank (the harness seeds torch, numpy and random before build; a generator of your "
    "own is not)."
)


def _init_hint(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """A parameter's shape differs when a rank holds part of it, which no seed can cause;
    its values, when the initialisation is not seeded the same."""
    if actual.shape != expected.shape:
        return (
            "a parameter of another shape than the reference's: if this rank holds only part "
            f"of it, {PARAM_SHARD_HINT}"
        )
    return SEED_HINT


# ---------------------------------------------------------------------- loss


def check_loss(judge: Judge, step: int, ref: StepRecord, steps: list[StepRecord]) -> list[Mismatch]:
    """The global loss: the same on every rank of a spatial group, and the reference's.

    With data groups, the mean of the groups' losses is compared (each group saw its share).
    """
    layout = judge.layout
    found = []
    for rank, st in enumerate(steps):
        lead = layout.lead(rank)
        if rank != lead and not bitwise_equal(st.loss, steps[lead].loss):
            m = judge.numeric(
                "loss", "loss (vs spatial rank 0)", step, rank, st.loss, steps[lead].loss
            )
            found += [m] if m else []
    if layout.data_size == 1:
        for rank, st in enumerate(steps):
            m = judge.numeric("loss", "loss", step, rank, st.loss, ref.loss)
            found += [m] if m else []
        return found
    losses = [steps[g * layout.spatial_size].loss for g in range(layout.data_size)]
    if len({loss.shape for loss in losses}) > 1:
        found.append(
            Mismatch("loss", "loss", step, None, where="the data groups' losses differ in shape")
        )
        return found
    mean = torch.stack(losses).mean(0)
    m = judge.numeric("loss", "loss (mean over data groups)", step, None, mean, ref.loss)
    return found + ([m] if m else [])


# ---------------------------------------------------------------------- gradients


def check_grads(
    judge: Judge,
    step: int,
    ref: StepRecord,
    steps: list[StepRecord],
    *,
    sharded: Collection[str] = (),
) -> list[Mismatch]:
    """Every named gradient on every rank against the reference's (None only where the
    reference has None too). ``sharded`` parameters are left to ``check_sharded_grads``."""
    found = []
    for rank, st in enumerate(steps):
        for name, g in st.grads.items():
            if name not in ref.grads or name in sharded:
                continue  # reported once, as a parameter missing from the reference
            r = ref.grads[name]
            if g is None or r is None:
                found += _grad_presence(name, step, rank, g, r)
                continue
            m = judge.numeric("grad", name, step, rank, g, r)
            found += [m] if m else []
    return found


def _grad_presence(
    name: str, step: int, rank: int, g: torch.Tensor | None, r: torch.Tensor | None
) -> list[Mismatch]:
    """A gradient present on one side only (None on both is no finding)."""
    if g is None and r is None:
        return []
    return [
        Mismatch(
            "grad",
            name,
            step,
            rank,
            where="no gradient (None) on this rank; the reference has one"
            if g is None
            else "a gradient where the reference has None",
            hint="a rank whose domain is empty must still run every module, giving zeros, not None"
            if g is None
            else "",
        )
    ]


# ---------------------------------------------------------------------- parameters, buffers


def check_params(
    judge: Judge,
    step: int,
    ref: StepRecord,
    steps: list[StepRecord],
    *,
    sharded: Collection[str] = (),
) -> list[Mismatch]:
    """Parameters after the step: bitwise equal across a spatial group (``sync``: no
    tolerance, one ulp is a difference), and close to the reference (``param``).
    ``sharded`` parameters are left to ``check_sharded_params``."""
    layout = judge.layout
    found = []
    for rank, st in enumerate(steps):
        lead_rank = layout.lead(rank)
        lead = steps[lead_rank].params
        for name, p in st.params.items():
            if name in sharded:
                continue
            if rank != lead_rank and name in lead and not bitwise_equal(p, lead[name]):
                same_shape = p.shape == lead[name].shape and p.dtype == lead[name].dtype
                d = compare_tensors(p, lead[name], judge.tolerance.param, allow_nonfinite=True)
                found.append(
                    Mismatch(
                        "sync",
                        name,
                        step,
                        rank,
                        d.max_abs,
                        d.max_rel,
                        d.problem or f"differs from spatial rank 0 (rank {lead_rank})",
                        bits_differ(p, lead[name]) if same_shape else 0,
                        p.numel(),
                    )
                )
            if name in ref.params:
                m = judge.numeric("param", name, step, rank, p, ref.params[name])
                found += [m] if m else []
    return found


def check_buffers(step: int, ref: StepRecord, steps: list[StepRecord]) -> list[Mismatch]:
    """Buffers modified in place during a step, where the reference's were not."""
    expected = set(ref.mutated_buffers)
    return [
        Mismatch(
            "buffer",
            name,
            step,
            rank,
            where="modified in place during the step; the reference's was not",
        )
        for rank, st in enumerate(steps)
        for name in sorted(set(st.mutated_buffers) - expected)
    ]


# ---------------------------------------------------------------------- sharded parameters' values


def _global_where(shard: ParamShard, shape: torch.Size) -> Callable[[int], str]:
    """Names a flat index into a shard by its index in the reference's parameter."""

    def where(flat: int) -> str:
        coords = [int(c) for c in np.unravel_index(flat, tuple(shape))]
        coords[shard.dim] = int(shard.index[coords[shard.dim]])
        return str(tuple(coords))

    return where


def _selected(ref: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """The reference's values at the shard's positions."""
    return ref.index_select(shard.dim, shard.index)


def check_sharded_init(
    reference: RunRecord, records: list[RunRecord], tolerance: Tolerance, shards: ParamShards
) -> list[Mismatch]:
    """Each rank's shard right after build against the reference's parameter at its
    positions: the reassembled parameter, checked position by position on every copy."""
    found = []
    for rank, rec in enumerate(records):
        for name, shard in sorted(
            (n, held[rank]) for n, held in shards.fit.items() if rank in held
        ):
            p, expected = rec.init[name], _selected(reference.init[name], shard)
            d = compare_tensors(p, expected, tolerance.param, allow_nonfinite=True)
            if d.ok:
                continue
            at = "" if d.worst is None else " at " + _global_where(shard, p.shape)(d.worst)
            where = f"initial value{at} ({shard.text()})"
            found.append(_init_mismatch(name, rank, d, where, SHARD_INIT_HINT))
    return found


def check_sharded_grads(
    judge: Judge, step: int, ref: StepRecord, steps: list[StepRecord], shards: ParamShards
) -> list[Mismatch]:
    """Each rank's gradient of each of its shards against the reference's gradient at the
    shard's positions (every copy: a copy left unsummed is wrong on its own)."""
    found = []
    for rank, st in enumerate(steps):
        for name, shard in sorted(
            (n, held[rank]) for n, held in shards.fit.items() if rank in held
        ):
            if name not in ref.grads or name not in st.grads:
                continue
            g, r = st.grads[name], ref.grads[name]
            if g is None or r is None:
                found += _grad_presence(name, step, rank, g, r)
                continue
            where = _global_where(shard, g.shape)
            m = judge.numeric("grad", name, step, rank, g, _selected(r, shard), where)
            found += [m] if m else []
    return found


def check_sharded_params(
    judge: Judge, step: int, ref: StepRecord, steps: list[StepRecord], shards: ParamShards
) -> list[Mismatch]:
    """Each shard after the step: bitwise equal on every rank that holds a copy of it (the
    same positions, in any spatial or data group: ``sync``), and close to the reference's
    parameter at its positions (``param``)."""
    found = []
    first: dict[tuple[str, int, tuple[int, ...]], int] = {}  # one shard -> its first holder
    for rank, st in enumerate(steps):
        for name, shard in sorted(
            (n, held[rank]) for n, held in shards.fit.items() if rank in held
        ):
            if name not in st.params:
                continue
            p = st.params[name]
            lead = first.setdefault((name, shard.dim, tuple(shard.index.tolist())), rank)
            q = steps[lead].params[name]
            if lead != rank and not bitwise_equal(p, q):
                d = compare_tensors(p, q, judge.tolerance.param, allow_nonfinite=True)
                found.append(
                    Mismatch(
                        "sync",
                        name,
                        step,
                        rank,
                        d.max_abs,
                        d.max_rel,
                        d.problem
                        or f"differs from rank {lead}, which holds the same shard ({shard.text()})",
                        bits_differ(p, q),
                        p.numel(),
                    )
                )
            if name in ref.params:
                where = _global_where(shard, p.shape)
                m = judge.numeric(
                    "param", name, step, rank, p, _selected(ref.params[name], shard), where
                )
                found += [m] if m else []
    return found
