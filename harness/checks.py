"""How a partitioned run is judged against its reference: one function per quantity.

Each ``check_*`` function reads ``RunRecord``s (``harness.records``) and returns the
``Mismatch``es it found; ``compare_runs`` calls them in run order (parameters after build,
then per step: non-finite values, loss, gradients, fields with their coverage, parameters
with their co-rank sync, buffers). Nothing here runs on a rank or touches a process group,
so every rule can be tested on hand-made records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from harness._values import plain
from harness.compare import (
    NUMERIC,
    Difference,
    Mismatch,
    QuantityStats,
    Tolerance,
    bits_differ,
    bitwise_equal,
    compare_tensors,
    nonfinite_counts,
    nonfinite_text,
)
from harness.errors import exception_summary
from harness.hints import (
    boundary_hint,
    float32_evidence,
    likely_cause,
    precision_hint,
    scale_hint,
    shard_shape_hint,
)
from harness.partition import ownership
from harness.records import FieldRecord, ParamShard, RunRecord, StepRecord
from harness.report import FieldError

T = TypeVar("T")

SHARD_HINT = (
    "return this rank's part of a field as a Shard: Shard.grid(values, rows, cols, nlat, "
    "nlon) for a lat x lon block, Shard(values, index, dim) otherwise; a plain tensor means "
    "the whole field"
)


@dataclass(frozen=True)
class Layout:
    """``ranks`` ranks in spatial groups of ``spatial_size`` consecutive ranks."""

    ranks: int
    spatial_size: int

    @property
    def data_size(self) -> int:
        return self.ranks // self.spatial_size

    def lead(self, rank: int) -> int:
        """The first rank (spatial rank 0) of ``rank``'s spatial group."""
        return (rank // self.spatial_size) * self.spatial_size


@dataclass
class Comparison:
    """What ``compare_runs`` found: the mismatches, the worst errors seen, the error maps."""

    mismatches: list[Mismatch] = field(default_factory=list)
    stats: dict[str, QuantityStats] = field(
        default_factory=lambda: {q: QuantityStats() for q in NUMERIC}
    )
    field_errors: list[FieldError] = field(default_factory=list)
    likely: str = ""  # the one line most likely to name the bug (hints.likely_cause)
    #: what a hint could not do (``Not located: ... (TypeError: ...)``): the finding stands
    diagnoses: list[str] = field(default_factory=list)


class Judge:
    """Compares one pair of tensors under its quantity's bound and keeps the statistics.

    Non-finite values are reported once each, by ``check_nonfinite``; here they only count
    where the two runs disagree (a NaN against a number), so matching NaNs are not reported
    twice.
    """

    def __init__(
        self,
        tolerance: Tolerance,
        layout: Layout,
        stats: dict[str, QuantityStats],
        float32_seen: str = "",
        diagnoses: list[str] | None = None,
    ):
        self.tolerance, self.layout, self.stats = tolerance, layout, stats
        self.diagnoses = diagnoses if diagnoses is not None else []
        #: where a float32 value was seen on the path (``hints.float32_evidence``): without
        #: it, errors of float32's size are no evidence of float32 rounding
        self.float32_seen = float32_seen

    def numeric(
        self,
        quantity: str,
        name: str,
        step: int | None,
        rank: int | None,
        actual: torch.Tensor,
        expected: torch.Tensor,
        where: Callable[[int], str] | None = None,
    ) -> Mismatch | None:
        d = compare_tensors(actual, expected, self.tolerance.bound(quantity), allow_nonfinite=True)
        if not d.problem:
            self.stats[quantity].add(d)
        if d.ok:
            return None
        if d.problem:
            loc = d.problem
        elif expected.dim() == 0:  # a scalar has no position: say what the two values are
            loc = two_values(actual, expected)
        elif where is not None and d.worst is not None:
            loc = where(d.worst)
        else:
            loc = index_text(expected.shape, d.worst)
        hint = ""
        bound = self.tolerance.bound(quantity)
        what = f"a hint for {quantity} '{name}'"
        if quantity in ("grad", "loss"):
            hint = self.diagnose(
                what, "", scale_hint, actual, expected, self.layout.spatial_size, bound.rtol
            )
        # not a parameter after a step: its error is the gradient's scaled by lr and diluted
        # by the parameter's size, small for any bug; the gradient speaks for it
        if not hint and not d.problem and quantity != "param":
            hint = self.diagnose(
                what, "", precision_hint, actual, expected, bound.atol, self.float32_seen
            )
        return Mismatch(
            quantity, name, step, rank, d.max_abs, d.max_rel, loc, d.count, d.total, hint=hint
        )

    def diagnose(self, what: str, default: T, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a diagnosis: should it raise, ``default``, and a ``Not located``
        line saying what could not be said: a hint never takes a finding down."""
        return diagnose(self.diagnoses, what, default, fn, *args)


def diagnose(lines: list[str], what: str, default: T, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, or ``default`` with a ``Not located: <what> (<ExcType>: msg)`` line in
    ``lines`` when it raises."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any failure of a diagnosis is said, not raised
        lines.append(f"Not located: {what} ({exception_summary(exc)})")
        return default


def plain_record(record: RunRecord) -> RunRecord:
    """``record`` with every tensor a plain one (``harness._values.plain``): the ranks
    record plain values already; a record made by hand or by an older rank may not."""

    def values(d: dict[str, Any]) -> dict[str, Any]:
        return {k: plain(v) if isinstance(v, torch.Tensor) else v for k, v in d.items()}

    steps = [
        dataclasses.replace(
            st,
            loss=plain(st.loss),
            grads=values(st.grads),
            params=values(st.params),
            fields={
                n: dataclasses.replace(f, values=plain(f.values)) for n, f in st.fields.items()
            },
        )
        for st in record.steps
    ]
    return dataclasses.replace(record, init=values(record.init), steps=steps)


def compare_runs(
    reference: RunRecord,
    records: list[RunRecord],
    tolerance: Tolerance,
    *,
    spatial_size: int | None = None,
    allow_nonfinite: bool = False,
) -> Comparison:
    """Judge every rank's record against the reference's, quantity by quantity."""
    reference, records = plain_record(reference), [plain_record(r) for r in records]
    layout = Layout(len(records), spatial_size or records[0].spatial_size)
    out = Comparison()
    seen = diagnose(out.diagnoses, "the float32 evidence", "", float32_evidence, reference, records)
    judge = Judge(tolerance, layout, out.stats, seen, out.diagnoses)
    m = out.mismatches
    if not allow_nonfinite:
        m += check_nonfinite_init(reference, records)
    found_shards, shards = check_param_shards(reference, records, layout)
    m += found_shards
    m += check_init(reference, records, tolerance)
    m += check_sharded_init(reference, records, tolerance, shards)
    for step, ref_step in enumerate(reference.steps):
        steps = [r.steps[step] for r in records]
        if not allow_nonfinite:
            m += check_nonfinite_step(step, ref_step, steps)
        m += check_loss(judge, step, ref_step, steps)
        m += check_grads(judge, step, ref_step, steps, sharded=shards.names)
        m += check_sharded_grads(judge, step, ref_step, steps, shards)
        found, errors = check_fields(judge, step, ref_step, steps)
        m += found
        out.field_errors += errors
        m += check_params(judge, step, ref_step, steps, sharded=shards.names)
        m += check_sharded_params(judge, step, ref_step, steps, shards)
        m += check_buffers(step, ref_step, steps)
    out.likely = diagnose(out.diagnoses, "the likely cause", "", likely_cause, out.mismatches)
    return out


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


def _shard_position(f: FieldRecord) -> Callable[[int], str] | None:
    """Names the global position of a flat index into a shard's values."""
    if f.keys is not None:
        return _keyed_position(f)
    if not f.sharded or f.dim is None or f.values.dim() == 0:
        return None
    values, dim = f.values, f.dim % f.values.dim()

    def where(flat: int) -> str:
        coords = np.unravel_index(flat, tuple(values.shape))
        local = int(coords[dim])
        index = f.index
        pos: int | None = None
        if isinstance(index, torch.Tensor):
            pos = int(index[local])
        elif isinstance(index, slice) and (index.start or 0) >= 0 and (index.step or 1) > 0:
            pos = (index.start or 0) + local * (index.step or 1)  # no size needed
        others = [int(c) for i, c in enumerate(coords) if i != dim]
        lead = f"[{', '.join(map(str, others))}] " if others else ""
        if pos is None:
            return f"{lead}local {f.unit} {local}"
        return lead + position_text(pos, f.grid, f.unit)

    return where


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


# ---------------------------------------------------------------------- fields


def check_fields(
    judge: Judge, step: int, ref: StepRecord, steps: list[StepRecord]
) -> tuple[list[Mismatch], list[FieldError]]:
    """Every field: full tensors rank by rank, shards reassembled per data group."""
    layout = judge.layout
    found: list[Mismatch] = []
    errors: list[FieldError] = []
    for name, ref_field in ref.fields.items():
        recs = [st.fields.get(name) for st in steps]
        missing = [r for r, f in enumerate(recs) if f is None]
        found += [
            Mismatch("field", name, step, r, where="field missing on this rank") for r in missing
        ]
        if missing:
            continue
        shards = [f for f in recs if f is not None]
        if ref_field.keyed or any(f.keyed for f in shards):
            more, more_errors = check_keyed_field(judge, name, step, ref_field, shards)
            found += more
            errors += more_errors
            continue
        trap = _batch_trap(name, step, ref_field.values, shards, layout)
        if trap is not None:
            found.append(trap)
            continue
        if not any(f.sharded for f in shards):
            found += _replicated_field(judge, name, step, ref_field.values, shards)
            continue
        for g in range(layout.data_size):
            first = g * layout.spatial_size
            more, error = assemble_field(
                judge,
                name,
                step,
                data_part(ref_field.values, g, layout.data_size),
                shards[first : first + layout.spatial_size],
                first,
            )
            found += more
            errors += [error] if error else []
    return found, errors


BATCH_HINT = (
    "size the global batch without topo.data_size (the reference has data_size 1, so it "
    "sees another batch) and split it with data_share(n, topo)"
)


def _batch_trap(
    name: str, step: int, ref: torch.Tensor, fields: list[FieldRecord], layout: Layout
) -> Mismatch | None:
    """With data groups, the reference must see exactly the samples (dim 0) that the groups
    see together; otherwise every comparison after it reads like a model bug."""
    if layout.data_size == 1 or ref.dim() == 0:
        return None
    groups = [fields[g * layout.spatial_size].values for g in range(layout.data_size)]
    if any(v.dim() == 0 for v in groups):
        return None
    together = sum(int(v.shape[0]) for v in groups)
    if together == ref.shape[0]:
        return None
    return Mismatch(
        "batch",
        name,
        step,
        None,
        where=f"the reference saw {ref.shape[0]} samples, the {layout.data_size} data groups "
        f"{together} together ({', '.join(str(int(v.shape[0])) for v in groups)})",
        hint=BATCH_HINT,
    )


def _replicated_field(
    judge: Judge, name: str, step: int, ref: torch.Tensor, fields: list[FieldRecord]
) -> list[Mismatch]:
    """Every rank returned a full tensor: each must equal its data group's part."""
    layout = judge.layout
    found = []
    for rank, f in enumerate(fields):
        expected = data_part(ref, rank // layout.spatial_size, layout.data_size)
        m = judge.numeric("field", name, step, rank, f.values, expected)
        if m and m.where.startswith("shape") and layout.spatial_size > 1:
            m.where = (
                f"a plain tensor of shape {tuple(f.values.shape)} where the reference's "
                f"field is {tuple(expected.shape)}"
            )
            # a part of the field is what a rank's block looks like; a tensor with more
            # dims, or larger somewhere, is another bug and gets no Shard hint
            if _part_shape(f.values.shape, expected.shape):
                m.hint = SHARD_HINT
        found += [m] if m else []
    return found


def _part_shape(part: torch.Size, whole: torch.Size) -> bool:
    """``part`` could be a block of a tensor of shape ``whole``: as many dims, none larger,
    one smaller.

    >>> _part_shape(torch.Size([2, 4, 6]), torch.Size([2, 8, 12]))
    True
    >>> _part_shape(torch.Size([1, 2, 8, 12]), torch.Size([2, 8, 12]))
    False
    """
    return (
        len(part) == len(whole)
        and all(p <= w for p, w in zip(part, whole))
        and any(p < w for p, w in zip(part, whole))
    )


@dataclass
class _Assembly:
    """One data group's shards, checked and ready to be placed: the field's layout, the
    positions each rank claims, and the (rank, positions, values) that can be placed."""

    name: str
    step: int
    ref: torch.Tensor
    dim: int
    size: int
    grid: tuple[int, int] | None
    unit: str
    found: list[Mismatch] = field(default_factory=list)
    claims: list[np.ndarray] = field(default_factory=list)
    placed: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def refuse(self, quantity: str, rank: int | None, where: str, hint: str = "") -> None:
        self.found.append(Mismatch(quantity, self.name, self.step, rank, where=where, hint=hint))

    def position(self, pos: int) -> str:
        return position_text(pos, self.grid, self.unit)


def assemble_field(
    judge: Judge,
    name: str,
    step: int,
    ref: torch.Tensor,
    shards: list[FieldRecord],
    first: int,
) -> tuple[list[Mismatch], FieldError | None]:
    """Reassemble one data group's shards and compare with the reference's part.

    Coverage first: every global position must be owned by exactly one rank; then each
    shard's shape; then the values of the reassembled field.
    """
    grid = next((f.grid for f in shards if f.grid), None)
    if grid is not None and tuple(ref.shape[-2:]) == tuple(grid):
        ref = ref.reshape(*ref.shape[:-2], -1)
    dims = {(f.dim or 0) % max(ref.dim(), 1) for f in shards if f.sharded}
    dim = next(iter(dims), 0)
    job = _Assembly(name, step, ref, dim, ref.shape[dim] if ref.dim() else 1, grid, shards[0].unit)
    if len(dims) > 1:
        job.refuse(
            "field",
            None,
            f"ranks shard along different dims {sorted(dims)}; every rank must shard the same dim",
        )
        return job.found, None
    for k, f in enumerate(shards):
        _claim(job, first + k, f)
    own = ownership(job.claims, job.size)
    if not own.complete:
        job.found.append(
            Mismatch(
                "coverage",
                name,
                step,
                None,
                count=len(own.missing) + len(own.doubled),
                total=job.size,
                where=own.describe(job.position),
            )
        )
    if job.found:
        return job.found, None
    return _compare_assembled(judge, job, first)


def _claim(job: _Assembly, rank: int, f: FieldRecord) -> None:
    """Check one rank's shard: a Shard, positions in range, values of the right shape."""
    nothing = np.zeros(0, dtype=np.int64)
    if not f.sharded:
        job.refuse(
            "field",
            rank,
            f"a plain tensor of shape {tuple(f.values.shape)} where other ranks return a Shard",
            SHARD_HINT,
        )
        job.claims.append(nothing)
        return
    idx = f.positions(job.size)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= job.size):
        job.refuse(
            "coverage",
            rank,
            f"index out of range [0, {job.size}): {int(idx.min())}..{int(idx.max())}",
        )
        job.claims.append(nothing)
        return
    job.claims.append(idx.numpy())
    expected = list(job.ref.shape)
    if job.ref.dim():
        expected[job.dim] = idx.numel()
    if list(f.values.shape) != expected or f.values.dtype != job.ref.dtype:
        job.refuse(
            "field",
            rank,
            f"shard {f.values.dtype} {tuple(f.values.shape)} where the reference gives "
            f"{job.ref.dtype} {tuple(expected)} for its {idx.numel()} positions",
            # Shard.grid flattens into the last dim: a block is only wanted where that is
            # the sharded one
            shard_shape_hint(f.values.shape, idx.numel(), job.ref.dim(), expected, job.grid)
            if job.dim == job.ref.dim() - 1
            else "",
        )
        return
    job.placed.append((rank, idx, f.values))


def _compare_assembled(
    judge: Judge, job: _Assembly, first: int
) -> tuple[list[Mismatch], FieldError | None]:
    """Place every shard in one tensor and compare it with the reference's part."""
    ref, dim, size = job.ref, job.dim, job.size
    out = torch.zeros_like(ref)
    owners = torch.full((size,), -1, dtype=torch.long)
    for rank, idx, values in job.placed:
        if ref.dim():
            out.index_copy_(dim, idx, values)
        elif idx.numel():  # a scalar: only its owner's value counts, not an empty rank's
            out.copy_(values.reshape(()))
        owners[idx] = rank

    def where(flat: int) -> str:
        coords = np.unravel_index(flat, tuple(ref.shape))
        pos = int(coords[dim])
        others = [int(c) for i, c in enumerate(coords) if i != dim]
        lead = f"[{', '.join(map(str, others))}] " if others else ""
        return f"{lead}{job.position(pos)} on rank {int(owners[pos])}"

    m = judge.numeric("field", job.name, job.step, None, out, ref, where if ref.dim() else None)
    if m is None:
        return [], None
    # the largest error (and reference magnitude) at each position, over the other dims; a
    # scalar is one position
    err = (out - ref).abs().to(torch.float64).movedim(dim, -1).reshape(-1, size).amax(0)
    mag = ref.abs().to(torch.float64).movedim(dim, -1).reshape(-1, size).amax(0)
    bound = judge.tolerance.field
    where_hint = judge.diagnose(
        f"a boundary hint for field '{job.name}'",
        "",
        boundary_hint,
        err,
        owners,
        bound.atol + bound.rtol * mag,
        job.grid,
        job.unit,
    )
    if where_hint:
        m.hint = where_hint
    group = first // judge.layout.spatial_size
    return [m], FieldError(job.name, job.step, group, err, owners, job.grid, job.unit)


# ---------------------------------------------------------------------- keyed fields

KEYED_HINT = (
    "return a keyed field as Shard.keyed(values, keys) on every rank and in the reference "
    "(there the whole field, in any packing order): items are matched by key"
)
KEY_WIDTH_HINT = (
    "name every item by the same key columns on every rank and in the reference, "
    "e.g. (sample, cell, token)"
)
GLOBAL_SAMPLE_HINT = (
    "with data groups, keys are matched across all groups (the reference holds every "
    "sample): key each sample by its global index, data_share(n, topo).start + the local one"
)


def check_keyed_field(
    judge: Judge, name: str, step: int, ref: FieldRecord, fields: list[FieldRecord]
) -> tuple[list[Mismatch], list[FieldError]]:
    """A keyed field (``Shard.keyed``): every rank's items matched with the reference's by key.

    Coverage first: each reference key must be held by exactly one rank of the whole run,
    all data groups together (the reference holds every sample and each group its share,
    so keys must name samples globally); a key held by no rank, by several ranks, twice by
    one rank, or not in the reference is a ``coverage`` finding naming the key and the rank.
    A key missing from a rank that holds the rest of its (all columns but the last) prefix,
    say the other tokens of its (sample, cell), is charged to that rank. Then every item
    held exactly once is compared with the reference's item of the same key (the ``field``
    finding names the key, and its cell with a ``cell_column``); error maps are per cell.
    """
    found: list[Mismatch] = []
    ref_keys = _reference_keys(name, step, ref, fields, found)
    if ref_keys is None:
        return found, []
    column = (
        ref.cell_column
        if ref.keyed
        else next((f.cell_column for f in fields if f.cell_column is not None), None)
    )
    job = _KeyedJob(name, step, judge.layout, ref_keys, column, ref.keyed)
    held: list[np.ndarray | None] = [job.accept(rank, f) for rank, f in enumerate(fields)]
    ids = job.match(held)
    coverage = job.coverage(ids)
    mismatch, placed = _compare_items(judge, job, ids, held, fields, ref)
    found += job.found + coverage  # refused ranks (keys, then values), then coverage
    if mismatch is None:
        return found, []
    errors = [] if coverage or column is None else _cell_errors(judge, job, placed, mismatch)
    return [*found, mismatch], errors


def _reference_keys(
    name: str, step: int, ref: FieldRecord, fields: list[FieldRecord], found: list[Mismatch]
) -> np.ndarray | None:
    """The reference's keys, ``(items, width)``. A plain tensor in the reference is the
    whole field with its rows as items ``0..n-1``: a match for 1-D keys (a row index), and
    a ``field`` finding of the reference where the ranks' keys have several columns."""
    if ref.keys is not None:
        return np.asarray(ref.keys.numpy(), dtype=np.int64)
    widths = sorted({int(f.keys.shape[1]) for f in fields if f.keys is not None})
    if widths == [1] and ref.values.dim() >= 1:
        return np.arange(ref.values.shape[0], dtype=np.int64)[:, None]
    found.append(
        Mismatch(
            "field",
            name,
            step,
            None,
            where=f"a plain tensor of shape {tuple(ref.values.shape)} where the ranks return "
            f"keyed items (keys of {_width_text(widths)})",
            hint=KEYED_HINT,
            run="reference",
        )
    )
    return None


def _width_text(widths: list[int]) -> str:
    return " or ".join(map(str, widths)) + " column" + ("" if widths == [1] else "s")


@dataclass
class _KeyedJob:
    """One keyed field of one step: the reference's keys and every key's number (``match``)."""

    name: str
    step: int
    layout: Layout
    ref_keys: np.ndarray
    column: int | None
    ref_keyed: bool = True  # False: the reference's plain tensor, its rows keyed 0..n-1
    found: list[Mismatch] = field(default_factory=list)
    unique: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.int64))

    def refuse(self, rank: int, where: str, hint: str = "") -> None:
        self.found.append(Mismatch("field", self.name, self.step, rank, where=where, hint=hint))

    def accept(self, rank: int, f: FieldRecord) -> np.ndarray | None:
        """A rank's keys if they can be matched (a keyed field, the reference's key width);
        its values are judged in ``_compare_items``."""
        width = self.ref_keys.shape[1]
        if f.keys is None:
            whose = "the reference's field is" if self.ref_keyed else "other ranks return"
            self.refuse(
                rank,
                f"a plain tensor of shape {tuple(f.values.shape)} where {whose} keyed items",
                KEYED_HINT,
            )
            return None
        if f.keys.shape[1] != width:
            self.refuse(
                rank,
                f"keys of {_width_text([int(f.keys.shape[1])])} where the reference's have "
                f"{_width_text([width])}",
                KEY_WIDTH_HINT,
            )
            return None
        return np.asarray(f.keys.numpy(), dtype=np.int64)

    def match(self, held: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """Number every distinct key; the reference's numbers first, then each rank's."""
        parts = [self.ref_keys, *(h for h in held if h is not None)]
        self.unique, inverse = _number_rows(np.concatenate(parts))
        ends = np.cumsum([len(p) for p in parts])
        pieces = iter(np.split(inverse, ends[:-1]))
        ref_ids = next(pieces)
        return [ref_ids, *(None if h is None else next(pieces) for h in held)]

    def key_text(self, k: int) -> str:
        """``key (0, 5, 2) in cell 5`` for the distinct key numbered ``k``."""
        return key_text([int(v) for v in self.unique[k]], self.column)

    def keys_text(self, ks: np.ndarray) -> str:
        """``key (0, 5, 2)`` for one, ``3 keys (first: key (0, 5, 2))`` for several."""
        first = self.key_text(int(ks[0]))
        return first if len(ks) == 1 else f"{len(ks)} keys (first: {first})"

    def coverage(self, ids: list[np.ndarray | None]) -> list[Mismatch]:
        """Keys held twice in the reference, by no rank, by several, twice by one rank, or
        not in the reference: one ``coverage`` finding per kind and rank."""
        ref_ids, rank_ids = ids[0], ids[1:]
        assert ref_ids is not None
        n_keys, n_ref = len(self.unique), len(self.ref_keys)
        ref_count = np.bincount(ref_ids, minlength=n_keys)
        counts = np.zeros((len(rank_ids), n_keys), dtype=np.int64)
        for rank, r_ids in enumerate(rank_ids):
            if r_ids is not None:
                counts[rank] = np.bincount(r_ids, minlength=n_keys)
        in_ref = ref_count > 0
        out: list[Mismatch] = []

        def finding(
            ks: np.ndarray, rank: int | None, where: str, hint: str = "", run: str = ""
        ) -> None:
            out.append(
                Mismatch(
                    "coverage",
                    self.name,
                    self.step,
                    rank,
                    count=len(ks),
                    total=n_ref,
                    where=where,
                    hint=hint,
                    run=run,
                )
            )

        twice = np.flatnonzero(ref_count > 1)
        if len(twice):
            finding(
                twice,
                None,
                f"{self.keys_text(twice)} held more than once in the reference",
                run="reference",
                hint="the reference must name each item once",
            )
        missing = np.flatnonzero(in_ref & (counts.sum(0) == 0))
        for charged, holds, ks in self._charged(missing, counts):
            if charged is None:
                finding(ks, None, f"{self.keys_text(ks)} of the reference held by no rank")
            else:
                finding(ks, charged, f"{self.keys_text(ks)} of the reference missing: {holds}")
        holders = (counts > 0).sum(0)
        several = np.flatnonzero(in_ref & (holders > 1))
        if len(several):
            ranks = np.flatnonzero(counts[:, several[0]])
            spatial = self.layout.spatial_size
            finding(
                several,
                None,
                f"{self.keys_text(several)} held by several ranks (first by ranks "
                f"{', '.join(map(str, ranks.tolist()))})",
                hint=GLOBAL_SAMPLE_HINT if len({int(r) // spatial for r in ranks}) > 1 else "",
            )
        for rank in range(len(rank_ids)):
            doubled = np.flatnonzero(in_ref & (counts[rank] > 1))
            if len(doubled):
                times = int(counts[rank, doubled[0]])
                finding(doubled, rank, f"{self.keys_text(doubled)} held {times} times here")
            extra = np.flatnonzero(~in_ref & (counts[rank] > 0))
            if len(extra):
                finding(extra, rank, f"{self.keys_text(extra)} not in the reference")
        return out

    def _charged(
        self, missing: np.ndarray, counts: np.ndarray
    ) -> list[tuple[int | None, str, np.ndarray]]:
        """The missing keys grouped by the one rank that holds the rest of their prefix
        (all key columns but the last: the other tokens of a (sample, cell)), else, with a
        cell column, the one rank that holds the other items of their cell; ``None`` where
        no rank or several do. Each group comes with what that rank holds, for the report."""
        if not len(missing):
            return []
        charged = np.full(len(missing), -1, dtype=np.int64)  # -1: no rank, or several
        why = np.zeros(len(missing), dtype=np.int64)  # 0: the prefix's rest, 1: the cell's
        ways = []
        if self.unique.shape[1] > 1:
            ways.append(_number_rows(self.unique[:, :-1])[1])
        if self.column is not None:
            ways.append(_number_rows(self.unique[:, self.column : self.column + 1])[1])
        for way, group in enumerate(ways):
            open_ = charged < 0
            # how many items of each group each rank holds: (ranks, groups)
            per_rank = np.stack(
                [np.bincount(group, weights=c, minlength=int(group.max()) + 1) for c in counts]
            )
            holders = per_rank[:, group[missing]] > 0  # (ranks, missing)
            one = open_ & (holders.sum(0) == 1)
            charged = np.where(one, holders.argmax(0), charged)
            why = np.where(one, way if self.unique.shape[1] > 1 else 1, why)
        out: list[tuple[int | None, str, np.ndarray]] = []
        for r, w in sorted({(int(r), int(w)) for r, w in zip(charged, why)}):
            ks = missing[(charged == r) & (why == w)]
            if r < 0:
                out.append((None, "", ks))
            elif w == 0:
                rest = ", ".join(map(str, self.unique[ks[0]][:-1].tolist()))
                out.append((r, f"this rank holds the rest of ({rest}, *)", ks))
            else:
                cell = int(self.unique[ks[0], self.column])
                out.append((r, f"this rank holds the other items of cell {cell}", ks))
        return out


def _number_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of an ``(n, width)`` integer array in lexicographic order, and each
    row's number among them: ``np.unique(rows, axis=0, return_inverse=True)``, whose sort of
    rows as structured values takes ~20x as long for 10**6 keys.

    >>> unique, number = _number_rows(np.array([[1, 2], [0, 5], [1, 2]]))
    >>> unique.tolist(), number.tolist()
    ([[0, 5], [1, 2]], [1, 0, 1])
    """
    order = np.lexsort(rows.T[::-1])  # by the first column, then the second, ...
    ordered = rows[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    number = np.empty(len(rows), dtype=np.int64)
    number[order] = np.cumsum(new) - 1
    return ordered[new], number


@dataclass
class _Placed:
    """The items compared: each rank's item held once, in the reference's order."""

    actual: torch.Tensor
    expected: torch.Tensor
    keys: np.ndarray  # the distinct-key number of each item
    owners: np.ndarray  # the rank holding each item


def _compare_items(
    judge: Judge,
    job: _KeyedJob,
    ids: list[np.ndarray | None],
    held: list[np.ndarray | None],
    fields: list[FieldRecord],
    ref: FieldRecord,
) -> tuple[Mismatch | None, _Placed]:
    """Compare every item held exactly once with the reference's item of the same key."""
    ref_ids = ids[0]
    assert ref_ids is not None
    n_keys = len(job.unique)
    first_row = np.full(n_keys, -1, dtype=np.int64)  # the reference's (first) row of each key
    present, first = np.unique(ref_ids, return_index=True)
    first_row[present] = first
    total = np.zeros(n_keys, dtype=np.int64)
    for r_ids in ids[1:]:
        if r_ids is not None:
            total += np.bincount(r_ids, minlength=n_keys)
    rows, ref_rows, owners, parts = [], [], [], []
    for rank, (f, r_ids) in enumerate(zip(fields, ids[1:])):
        if r_ids is None or held[rank] is None:
            continue
        if tuple(f.values.shape[1:]) != tuple(ref.values.shape[1:]) or (
            f.values.dtype != ref.values.dtype
        ):
            job.refuse(
                rank,
                f"items {f.values.dtype} {tuple(f.values.shape[1:])} where the reference's "
                f"are {ref.values.dtype} {tuple(ref.values.shape[1:])} (items run along dim 0)",
            )
            continue
        once = (total[r_ids] == 1) & (first_row[r_ids] >= 0)
        mine = np.flatnonzero(once)
        rows.append(r_ids[mine])
        ref_rows.append(first_row[r_ids[mine]])
        owners.append(np.full(len(mine), rank, dtype=np.int64))
        parts.append(f.values[torch.from_numpy(mine)])
    empty = np.zeros(0, dtype=np.int64)
    order_by = np.concatenate(ref_rows) if ref_rows else empty
    order = np.argsort(order_by, kind="stable")  # the reference's order, whatever the packing
    inner = tuple(ref.values.shape[1:])
    actual = torch.cat(parts) if parts else ref.values.new_zeros((0, *inner))
    placed = _Placed(
        actual[torch.from_numpy(order)],
        ref.values[torch.from_numpy(order_by[order])],
        (np.concatenate(rows) if rows else empty)[order],
        (np.concatenate(owners) if owners else empty)[order],
    )

    def where(flat: int) -> str:
        coords = np.unravel_index(flat, tuple(placed.actual.shape))
        item = int(coords[0])
        others = [int(c) for c in coords[1:]]
        lead = f"[{', '.join(map(str, others))}] " if others else ""
        return f"{lead}{job.key_text(int(placed.keys[item]))} on rank {int(placed.owners[item])}"

    m = judge.numeric("field", job.name, job.step, None, placed.actual, placed.expected, where)
    return m, placed


def _cell_errors(judge: Judge, job: _KeyedJob, placed: _Placed, m: Mismatch) -> list[FieldError]:
    """Per data group, the largest error of the items in each HEALPix cell (what error
    maps draw), and the boundary hint on ``m``. A cell no item of the group lies in is
    drawn as owned by the rank of the cell before it (nested ranges are contiguous)."""
    column = job.column
    assert column is not None
    n = len(placed.keys)
    if n == 0 or placed.actual[0].numel() == 0:
        return []
    cells = torch.from_numpy(job.unique[placed.keys, column])
    npix = _healpix_cells(int(job.ref_keys[:, column].max(initial=0)) if len(job.ref_keys) else 0)
    diff = (placed.actual - placed.expected).abs().to(torch.float64).reshape(n, -1).amax(1)
    mag = placed.expected.abs().to(torch.float64).reshape(n, -1).amax(1)
    bound = judge.tolerance.field
    over = ~(diff <= bound.atol + bound.rtol * mag)  # NaN counts as over
    groups = torch.from_numpy(placed.owners // job.layout.spatial_size)
    errors: list[FieldError] = []
    for g in range(job.layout.data_size):
        mine = groups == g
        if not bool((over & mine).any()):
            continue
        err_np, most_np = np.zeros(npix), np.zeros(npix)
        with np.errstate(invalid="ignore"):  # a NaN item makes its cell's error NaN: wanted
            np.maximum.at(err_np, cells[mine].numpy(), diff[mine].numpy())
            np.maximum.at(most_np, cells[mine].numpy(), mag[mine].numpy())
        err, most = torch.from_numpy(err_np), torch.from_numpy(most_np)
        owners = np.full(npix, -1, dtype=np.int64)
        owners[cells[mine].numpy()] = placed.owners[mine.numpy()]
        owners = _fill_owners(owners, g * job.layout.spatial_size)
        owned = torch.from_numpy(owners)
        if not errors:
            hint = boundary_hint(err, owned, bound.atol + bound.rtol * most, None, "cell")
            m.hint = hint or m.hint
        errors.append(FieldError(job.name, job.step, g, err, owned, None, "cell"))
    return errors


def _fill_owners(owners: np.ndarray, default: int) -> np.ndarray:
    """Cells without an owner take the owner of the cell before them (the one after, at
    the start; ``default`` if none has one)."""
    known = np.flatnonzero(owners >= 0)
    if not len(known):
        return np.full_like(owners, default)
    before = np.maximum.accumulate(np.where(owners >= 0, np.arange(len(owners)), -1))
    filled = np.where(before >= 0, owners[np.maximum(before, 0)], owners[known[0]])
    return filled


def _healpix_cells(largest: int) -> int:
    """The cells of the smallest HEALPix sphere (``12 * nside**2``, nside a power of two)
    holding cell ``largest``.

    >>> _healpix_cells(0), _healpix_cells(12), _healpix_cells(47), _healpix_cells(48)
    (12, 48, 48, 192)
    """
    nside = 1
    while 12 * nside * nside <= largest:
        nside *= 2
    return 12 * nside * nside


def _keyed_position(f: FieldRecord) -> Callable[[int], str]:
    """Names the item (by key, and cell) of a flat index into a keyed field's values."""
    keys, values, column = f.keys, f.values, f.cell_column
    assert keys is not None

    def where(flat: int) -> str:
        coords = np.unravel_index(flat, tuple(values.shape))
        others = [int(c) for c in coords[1:]]
        lead = f"[{', '.join(map(str, others))}] " if others else ""
        return lead + key_text([int(v) for v in keys[int(coords[0])]], column)

    return where


def key_text(key: list[int], cell_column: int | None = None) -> str:
    """An item's name in reports: ``key 7``, ``key (0, 5, 2)``, ``key (0, 5, 2) in cell 5``.

    >>> key_text([0, 5, 2], cell_column=1)
    'key (0, 5, 2) in cell 5'
    """
    text = f"key {key[0]}" if len(key) == 1 else f"key ({', '.join(map(str, key))})"
    if cell_column is not None:
        text += " in " + position_text(key[cell_column], None, "cell")
    return text


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


# ---------------------------------------------------------------------- sharded parameters

PARAM_SHARD_HINT = (
    "name it in SpatialCase.parameter_shards as Shard(param, index, dim): the global "
    "positions along dim of the reference's parameter that this rank's values hold"
)
SHARD_INIT_HINT = (
    "this rank's shard differs from the reference's parameter at the positions it names, "
    "right after build: take it from the reference's initial value at those positions (the "
    "same seeded full-size draw, sliced at the index given in parameter_shards); if each "
    "rank initialises its shard on its own, set load_reference_shards = True on the case"
)


@dataclass
class ParamShards:
    """A run's sharded parameters: every name some rank shards (``names``, which the
    whole-parameter checks leave alone), and the shards that fit the reference's parameter
    (``fit``: name -> rank -> shard), which the value checks compare."""

    names: frozenset[str] = frozenset()
    fit: dict[str, dict[int, ParamShard]] = field(default_factory=dict)


def check_param_shards(
    reference: RunRecord, records: list[RunRecord], layout: Layout
) -> tuple[list[Mismatch], ParamShards]:
    """Sharded parameters right after build: does each rank's shard fit the reference's
    parameter, and do the shards of each spatial group cover every position once?

    Ranks holding exactly the same positions hold copies of one shard (a weight sharded over
    the polar group is copied over the azimuth group): they count as one owner. Positions
    no rank holds, or that ranks holding different shards both hold, are ``coverage``
    findings; so is a whole parameter on a rank where others hold shards of it. A shard that
    does not fit (a dim the reference's parameter lacks, other dims of another size) is a
    ``param`` finding; its values are then not compared.
    """
    names = frozenset(n for rec in records for n in rec.param_shards)
    found: list[Mismatch] = []
    fit: dict[str, dict[int, ParamShard]] = {}
    for name in sorted(names):
        ref = reference.init.get(name)
        if ref is None:
            continue  # check_init names it: not in the reference model
        held: dict[int, ParamShard] = {}
        for rank, rec in enumerate(records):
            if name not in rec.init:
                continue  # check_init names it: missing on this rank
            shard = rec.param_shards.get(name)
            problem = (
                _whole_among_shards(name, rank, rec.init[name], records)
                if shard is None
                else _shard_misfit(name, rank, rec.init[name], shard, ref)
            )
            if problem is None and shard is not None:
                held[rank] = shard
            found += [problem] if problem else []
        dims = sorted({s.dim for s in held.values()})
        if len(dims) > 1:
            where = f"ranks shard it along different dims {dims}; shard every copy along one"
            found.append(Mismatch("param", name, None, None, where=where, hint=PARAM_SHARD_HINT))
            continue
        for g in range(layout.data_size):
            group = range(g * layout.spatial_size, (g + 1) * layout.spatial_size)
            if all(r in held for r in group):
                found += _shard_coverage(name, ref, {r: held[r] for r in group})
        fit[name] = held
    return found, ParamShards(names, fit)


def _whole_among_shards(
    name: str, rank: int, value: torch.Tensor, records: list[RunRecord]
) -> Mismatch:
    others = [r for r, rec in enumerate(records) if name in rec.param_shards]
    return Mismatch(
        "coverage",
        name,
        None,
        rank,
        where=f"the whole parameter {tuple(value.shape)} on this rank, where rank "
        f"{', '.join(map(str, others))} hold(s) shards of it",
        hint="shard it on every rank: " + PARAM_SHARD_HINT,
    )


def _shard_misfit(
    name: str, rank: int, value: torch.Tensor, shard: ParamShard, ref: torch.Tensor
) -> Mismatch | None:
    """Why ``shard`` cannot be a part of the reference's parameter ``ref``, or ``None``."""
    shape = tuple(ref.shape)
    if shard.dim >= ref.dim():
        where = f"sharded along dim {shard.dim}, but the reference's parameter {shape} has "
        where += f"{ref.dim()} dimension(s)"
        return Mismatch("param", name, None, rank, where=where, hint=PARAM_SHARD_HINT)
    size = int(ref.shape[shard.dim])
    if shard.index.numel() and int(shard.index.max()) >= size:
        where = f"{shard.text()}, outside [0, {size}) of the reference's parameter {shape}"
        return Mismatch(
            "coverage",
            name,
            None,
            rank,
            where=where,
            hint="positions are global positions in the reference's parameter: " + PARAM_SHARD_HINT,
        )
    expected = list(ref.shape)
    expected[shard.dim] = shard.index.numel()
    if list(value.shape) != expected or value.dtype != ref.dtype:
        where = (
            f"a shard {value.dtype} {tuple(value.shape)} for {shard.text()}, where the "
            f"reference's parameter {ref.dtype} {shape} gives {tuple(expected)}"
        )
        return Mismatch(
            "param",
            name,
            None,
            rank,
            where=where,
            hint="a shard has the reference's dtype and sizes except along its dim, where it "
            "has one value per position: " + PARAM_SHARD_HINT,
        )
    return None


def _shard_coverage(name: str, ref: torch.Tensor, held: dict[int, ParamShard]) -> list[Mismatch]:
    """One spatial group's shards of one parameter: every position held by one shard.

    A hole is named with the rank whose shard borders it (below, else above); a position
    held twice with the two ranks holding it."""
    dim = next(iter(held.values())).dim
    size = int(ref.shape[dim])
    copies: dict[tuple[int, ...], list[int]] = {}
    for rank, shard in sorted(held.items()):
        copies.setdefault(tuple(sorted(shard.index.tolist())), []).append(rank)
    distinct = list(copies.items())
    own = ownership([np.asarray(k, dtype=np.int64) for k, _ in distinct], size)
    if own.complete:
        return []
    owner = np.full(size, -1)
    for positions, holding in reversed(distinct):  # the lowest rank holding a position names it
        owner[list(positions)] = holding[0]
    ranks = sorted(held)
    group = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
    found = []
    if len(own.missing):
        pos = int(own.missing[0])
        below = [p for p in range(pos - 1, -1, -1) if owner[p] >= 0][:1]
        above = [p for p in range(pos + 1, size) if owner[p] >= 0][:1]
        near = int(owner[(below or above)[0]]) if below or above else None
        beside = "" if near is None else f", next to rank {near}'s {held[near].text()}"
        found.append(
            Mismatch(
                "coverage",
                name,
                None,
                near,
                count=len(own.missing),
                total=size,
                where=f"{len(own.missing)} position(s) along dim {dim} held by no rank of "
                f"{group} (first: {pos}{beside})",
                hint=PARAM_SHARD_HINT,
            )
        )
    if len(own.doubled):
        pos = int(own.doubled[0])
        holders = [holding[0] for k, holding in distinct if pos in k]
        if len(holders) == 1:  # one shard repeats a position (the rank refuses that)
            holders *= 2
        a, b = holders[0], holders[1]
        found.append(
            Mismatch(
                "coverage",
                name,
                None,
                b,
                count=len(own.doubled),
                total=size,
                where=f"{len(own.doubled)} position(s) along dim {dim} held by ranks of {group} "
                f"holding different shards (first: {pos}, by rank {a}'s {held[a].text()} and "
                f"rank {b}'s {held[b].text()})",
                hint="ranks holding copies of a shard must hold exactly the same positions: "
                + PARAM_SHARD_HINT,
            )
        )
    return found


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


# ---------------------------------------------------------------------- text


def data_part(ref: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    """Data group ``group``'s contiguous share of the samples (dim 0) of ``ref``; a scalar
    has no samples to share: every group's is compared with the whole of it."""
    if groups == 1 or ref.dim() == 0:
        return ref
    k = ref.shape[0] // groups
    return ref[group * k : (group + 1) * k]


def position_text(pos: int, grid: tuple[int, int] | None, unit: str = "position") -> str:
    """``"(lat 3, lon 7)"`` on a grid (named by its own axes where ``unit`` holds two
    names), ``"cell 12"`` otherwise.

    >>> position_text(19, (4, 8)), position_text(19, (4, 8), "l,m"), position_text(5, None, "cell")
    ('(lat 2, lon 3)', '(l 2, m 3)', 'cell 5')
    """
    if grid is None:
        return f"{unit} {pos}"
    row, col = divmod(pos, grid[1])
    first, second = unit.split(",") if "," in unit else ("lat", "lon")
    return f"({first} {row}, {second} {col})"


def index_text(shape: torch.Size, flat: int | None) -> str:
    """The tensor index of a flat position, ``"(2, 1)"``; empty for a scalar."""
    if flat is None or not len(shape):
        return ""
    return str(tuple(int(i) for i in np.unravel_index(flat, tuple(shape))))


def two_values(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Two scalars with just enough digits to see where they differ.

    >>> f64 = torch.float64
    >>> two_values(torch.tensor(2.28740001, dtype=f64), torch.tensor(2.2874, dtype=f64))
    '2.28740001 vs reference 2.2874'
    """
    a, e = actual.item(), expected.item()
    for digits in range(6, 18):
        ta, te = f"{a:.{digits}g}", f"{e:.{digits}g}"
        if ta != te:
            return f"{ta} vs reference {te}"
    return f"{a!r} vs reference {e!r}"
