"""How a partitioned run is judged against its reference: one function per quantity.

Each ``check_*`` function reads ``RunRecord``s (``harness.records``) and returns the
``Mismatch``es it found; ``compare_runs`` calls them in run order (parameters after build,
then per step: non-finite values, loss, gradients, fields with their coverage, parameters
with their co-rank sync, buffers). Nothing here runs on a rank or touches a process group,
so every rule can be tested on hand-made records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from harness.compare import (
    NUMERIC,
    Mismatch,
    QuantityStats,
    Tolerance,
    bits_differ,
    bitwise_equal,
    compare_tensors,
    nonfinite_counts,
    nonfinite_text,
)
from harness.hints import (
    boundary_hint,
    likely_cause,
    precision_hint,
    scale_hint,
    shard_shape_hint,
)
from harness.partition import ownership
from harness.records import FieldRecord, RunRecord, StepRecord
from harness.report import FieldError

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


class Judge:
    """Compares one pair of tensors under its quantity's bound and keeps the statistics.

    Non-finite values are reported once each, by ``check_nonfinite``; here they only count
    where the two runs disagree (a NaN against a number), so matching NaNs are not reported
    twice.
    """

    def __init__(self, tolerance: Tolerance, layout: Layout, stats: dict[str, QuantityStats]):
        self.tolerance, self.layout, self.stats = tolerance, layout, stats

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
        if quantity in ("grad", "loss"):
            hint = scale_hint(actual, expected, self.layout.spatial_size)
        if not hint and not d.problem:
            hint = precision_hint(actual, expected, self.tolerance.bound(quantity).atol)
        return Mismatch(
            quantity, name, step, rank, d.max_abs, d.max_rel, loc, d.count, d.total, hint=hint
        )


def compare_runs(
    reference: RunRecord,
    records: list[RunRecord],
    tolerance: Tolerance,
    *,
    spatial_size: int | None = None,
    allow_nonfinite: bool = False,
) -> Comparison:
    """Judge every rank's record against the reference's, quantity by quantity."""
    layout = Layout(len(records), spatial_size or records[0].spatial_size)
    out = Comparison()
    judge = Judge(tolerance, layout, out.stats)
    m = out.mismatches
    if not allow_nonfinite:
        m += check_nonfinite_init(reference, records)
    m += check_init(reference, records, tolerance)
    for step, ref_step in enumerate(reference.steps):
        steps = [r.steps[step] for r in records]
        if not allow_nonfinite:
            m += check_nonfinite_step(step, ref_step, steps)
        m += check_loss(judge, step, ref_step, steps)
        m += check_grads(judge, step, ref_step, steps)
        found, errors = check_fields(judge, step, ref_step, steps)
        m += found
        out.field_errors += errors
        m += check_params(judge, step, ref_step, steps)
        m += check_buffers(step, ref_step, steps)
    out.likely = likely_cause(out.mismatches)
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


def check_init(
    reference: RunRecord, records: list[RunRecord], tolerance: Tolerance
) -> list[Mismatch]:
    """Parameters right after build: unseeded initialisation shows here first."""
    found = []
    ref = reference.init
    for rank, rec in enumerate(records):
        for name, p in rec.init.items():
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
                    Mismatch(
                        "param",
                        name,
                        None,
                        rank,
                        d.max_abs,
                        d.max_rel,
                        d.problem or "initial value",
                        d.count,
                        d.total,
                        hint="differs from the reference right after build: seed the "
                        "initialisation identically on every rank (the harness seeds torch, "
                        "numpy and random before build; a generator of your own is not).",
                    )
                )
        for name in sorted(ref.keys() - rec.init.keys()):
            found.append(
                Mismatch(
                    "param", name, None, rank, where="reference parameter missing on this rank"
                )
            )
    return found


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
    judge: Judge, step: int, ref: StepRecord, steps: list[StepRecord]
) -> list[Mismatch]:
    """Every named gradient on every rank against the reference's (None only where the
    reference has None too)."""
    found = []
    for rank, st in enumerate(steps):
        for name, g in st.grads.items():
            if name not in ref.grads:
                continue  # reported once, as a parameter missing from the reference
            r = ref.grads[name]
            if g is None and r is None:
                continue
            if g is None or r is None:
                found.append(
                    Mismatch(
                        "grad",
                        name,
                        step,
                        rank,
                        where="no gradient (None) on this rank; the reference has one"
                        if g is None
                        else "a gradient where the reference has None",
                        hint="a rank whose domain is empty must still run every module, giving "
                        "zeros, not None"
                        if g is None
                        else "",
                    )
                )
                continue
            m = judge.numeric("grad", name, step, rank, g, r)
            found += [m] if m else []
    return found


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
            m.hint = SHARD_HINT
        found += [m] if m else []
    return found


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
            shard_shape_hint(f.values.shape, idx.numel(), job.ref.dim()),
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
    where_hint = boundary_hint(err, owners, bound.atol + bound.rtol * mag, job.grid, job.unit)
    if where_hint:
        m.hint = where_hint
    group = first // judge.layout.spatial_size
    return [m], FieldError(job.name, job.step, group, err, owners, job.grid, job.unit)


# ---------------------------------------------------------------------- parameters, buffers


def check_params(
    judge: Judge, step: int, ref: StepRecord, steps: list[StepRecord]
) -> list[Mismatch]:
    """Parameters after the step: bitwise equal across a spatial group (``sync``: no
    tolerance, one ulp is a difference), and close to the reference (``param``)."""
    layout = judge.layout
    found = []
    for rank, st in enumerate(steps):
        lead_rank = layout.lead(rank)
        lead = steps[lead_rank].params
        for name, p in st.params.items():
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


# ---------------------------------------------------------------------- text


def data_part(ref: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    """Data group ``group``'s contiguous share of the samples (dim 0) of ``ref``; a scalar
    has no samples to share: every group's is compared with the whole of it."""
    if groups == 1 or ref.dim() == 0:
        return ref
    k = ref.shape[0] // groups
    return ref[group * k : (group + 1) * k]


def position_text(pos: int, grid: tuple[int, int] | None, unit: str = "position") -> str:
    """``"(lat 3, lon 7)"`` on a grid, ``"cell 12"`` otherwise."""
    if grid is None:
        return f"{unit} {pos}"
    lat, lon = divmod(pos, grid[1])
    return f"(lat {lat}, lon {lon})"


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
