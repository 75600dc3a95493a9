"""Plain values, one function per quantity: non-finite values, parameters after build,
loss, gradients, parameters after a step (with their co-rank ``sync``) and buffers; a
sharded parameter's shard is compared with the reference at its positions."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from harness._judges.fields import _shard_position
from harness._judges.judge import Judge, Numeric, index_text
from harness._judges.shards import (
    NO_SHARDS,
    PARAM_SHARD_HINT,
    SHARD_INIT_HINT,
    ParamShards,
    part,
    shard_part,
)
from harness._records.run import RunRecord, StepRecord
from harness.compare import (
    Difference,
    Mismatch,
    Quantity,
    Tolerance,
    all_finite,
    bits_differ,
    bitwise_equal,
    compare_tensors,
    nonfinite_counts,
    nonfinite_text,
)

# ---------------------------------------------------------------------- non-finite values


def _nonfinite(
    of: Quantity,
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
        Quantity.NONFINITE,
        name,
        step,
        rank,
        where=(pos + " " if pos else "") + f"({nonfinite_text(nan, inf)})",
        count=nan + inf,
        total=values.numel(),
        run="reference" if rank is None else "",
        of=str(of),  # plain text, as Mismatch keeps its quantity: it travels
    )


def check_nonfinite_init(reference: RunRecord, records: list[RunRecord]) -> list[Mismatch]:
    """A NaN or inf in the parameters right after build, in the reference or on a rank."""
    found = []
    for rank, rec in [(None, reference), *enumerate(records)]:
        if all_finite(rec.init.values()):
            continue
        for name, p in rec.init.items():
            m = _nonfinite(Quantity.PARAM, name, None, p, rank)
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
        if all_finite(_values_of(st)):
            continue  # one pass over the step's values; each on its own only to say where
        candidates = [
            _nonfinite(Quantity.LOSS, "loss", step, st.loss, rank),
            *(
                _nonfinite(Quantity.GRAD, n, step, g, rank)
                for n, g in st.grads.items()
                if g is not None
            ),
            *(
                _nonfinite(Quantity.FIELD, n, step, f.values, rank, _shard_position(f))
                for n, f in st.fields.items()
            ),
            *(_nonfinite(Quantity.PARAM, n, step, p, rank) for n, p in st.params.items()),
        ]
        found += [m for m in candidates if m is not None]
    return found


def _values_of(st: StepRecord) -> Iterator[torch.Tensor | None]:
    """Every value one step recorded: its loss, gradients, output fields and parameters."""
    yield st.loss
    yield from st.grads.values()
    yield from (f.values for f in st.fields.values())
    yield from st.params.values()


# ---------------------------------------------------------------------- parameters after build


def _init_mismatch(name: str, rank: int, d: Difference, where: str, hint: str) -> Mismatch:
    """A parameter that differs right after build (no step yet): ``where`` unless the
    comparison named a problem of its own (a shape, a dtype)."""
    return Mismatch(
        Quantity.PARAM,
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
    reference: RunRecord,
    records: list[RunRecord],
    tolerance: Tolerance,
    shards: ParamShards = NO_SHARDS,
) -> list[Mismatch]:
    """Parameters right after build: unseeded initialisation shows here first. A sharded
    parameter's shard is checked position by position on every copy against the reference's
    values at its positions (``shards``: ``check_param_shards``)."""
    found = []
    ref = reference.init
    for rank, rec in enumerate(records):
        for name, p in rec.init.items():
            if name not in ref:
                found.append(
                    Mismatch(
                        Quantity.PARAM,
                        name,
                        None,
                        rank,
                        where="parameter not in the reference model",
                    )
                )
                continue
            if not shards.compared(name, rank):
                continue
            shard = shards.held(name, rank)
            expected, at = part(ref[name], shard, p.shape)
            d = compare_tensors(p, expected, tolerance.param, allow_nonfinite=True)
            if d.ok:
                continue
            if shard is None:
                found.append(
                    _init_mismatch(name, rank, d, "initial value", _init_hint(p, ref[name]))
                )
                continue
            pos = "" if d.worst is None or at is None else " at " + at(d.worst)
            where = f"initial value{pos} ({shard.text()})"
            found.append(_init_mismatch(name, rank, d, where, SHARD_INIT_HINT))
        for name in sorted(ref.keys() - rec.init.keys()):
            found.append(
                Mismatch(
                    Quantity.PARAM,
                    name,
                    None,
                    rank,
                    where="reference parameter missing on this rank",
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
                Quantity.LOSS, "loss (vs spatial rank 0)", step, rank, st.loss, steps[lead].loss
            )
            found += [m] if m else []
    spread = judge.spread(Quantity.LOSS, step, "loss")
    if layout.data_size == 1:
        calls = [Numeric(Quantity.LOSS, "loss", step, r, st.loss, ref.loss, None, spread)
                 for r, st in enumerate(steps)]  # fmt: skip
        return found + judge.numeric_all(calls)
    losses = [steps[g * layout.spatial_size].loss for g in range(layout.data_size)]
    if len({loss.shape for loss in losses}) > 1:
        found.append(
            Mismatch(
                Quantity.LOSS, "loss", step, None, where="the data groups' losses differ in shape"
            )
        )
        return found
    mean = torch.stack(losses).mean(0)
    m = judge.numeric(
        Quantity.LOSS, "loss (mean over data groups)", step, None, mean, ref.loss, None, spread
    )
    return found + ([m] if m else [])


# ---------------------------------------------------------------------- gradients


def check_grads(
    judge: Judge,
    step: int,
    ref: StepRecord,
    steps: list[StepRecord],
    shards: ParamShards = NO_SHARDS,
) -> list[Mismatch]:
    """Every named gradient on every rank against the reference's (None only where the
    reference has None too); a shard's gradient against the reference's at the shard's
    positions, on every copy (a copy left unsummed is wrong on its own)."""
    calls: list[Mismatch | Numeric] = []
    for rank, st in enumerate(steps):
        for name, g in st.grads.items():
            if name not in ref.grads:
                continue  # reported once, as a parameter missing from the reference
            if not shards.compared(name, rank):
                continue
            r = ref.grads[name]
            if g is None or r is None:
                calls += _grad_presence(name, step, rank, g, r)
                continue
            held = shards.held(name, rank)
            expected, where = part(r, held, g.shape)
            spread = judge.spread(Quantity.GRAD, step, name, shard_part(held, g.shape))
            calls.append(Numeric(Quantity.GRAD, name, step, rank, g, expected, where, spread))
    return judge.numeric_all(calls)


def _grad_presence(
    name: str, step: int, rank: int, g: torch.Tensor | None, r: torch.Tensor | None
) -> list[Mismatch]:
    """A gradient present on one side only (None on both is no finding)."""
    if g is None and r is None:
        return []
    return [
        Mismatch(
            Quantity.GRAD,
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
    shards: ParamShards = NO_SHARDS,
) -> list[Mismatch]:
    """Parameters after the step: bitwise equal on every rank holding a copy (``sync``: no
    tolerance, one ulp is a difference), and close to the reference (``param``). A whole
    parameter's copies are its spatial group's; a shard's, every rank that holds the same
    positions, in any spatial or data group, compared with the reference's values there."""
    layout = judge.layout
    found: list[Mismatch | Numeric] = []
    first: dict[tuple[str, int, tuple[int, ...]], int] = {}  # one shard -> its first holder
    for rank, st in enumerate(steps):
        for name, p in st.params.items():
            if not shards.compared(name, rank):
                continue
            shard = shards.held(name, rank)
            if shard is None:
                copy = layout.lead(rank)
                said = f"differs from spatial rank 0 (rank {copy})"
            else:
                copy = first.setdefault((name, shard.dim, tuple(shard.index.tolist())), rank)
                said = f"differs from rank {copy}, which holds the same shard ({shard.text()})"
            q = steps[copy].params.get(name)
            if copy != rank and q is not None and not bitwise_equal(p, q):
                found.append(_sync_mismatch(judge, name, step, rank, p, q, said))
            if name in ref.params:
                expected, where = part(ref.params[name], shard, p.shape)
                spread = judge.spread(Quantity.PARAM, step, name, shard_part(shard, p.shape))
                found.append(Numeric(Quantity.PARAM, name, step, rank, p, expected, where, spread))
    return judge.numeric_all(found)


def _sync_mismatch(
    judge: Judge, name: str, step: int, rank: int, p: torch.Tensor, q: torch.Tensor, said: str
) -> Mismatch:
    """``p`` differs from its copy ``q``, which should hold the very same bits."""
    same_shape = p.shape == q.shape and p.dtype == q.dtype
    d = compare_tensors(p, q, judge.tolerance.param, allow_nonfinite=True)
    return Mismatch(
        Quantity.SYNC,
        name,
        step,
        rank,
        d.max_abs,
        d.max_rel,
        d.problem or said,
        bits_differ(p, q) if same_shape else 0,
        p.numel(),
    )


def check_buffers(step: int, ref: StepRecord, steps: list[StepRecord]) -> list[Mismatch]:
    """Buffers modified in place during a step, where the reference's were not."""
    expected = set(ref.mutated_buffers)
    return [
        Mismatch(
            Quantity.BUFFER,
            name,
            step,
            rank,
            where="modified in place during the step; the reference's was not",
        )
        for rank, st in enumerate(steps)
        for name in sorted(set(st.mutated_buffers) - expected)
    ]
