"""Fields: full tensors rank by rank, or shards reassembled per data group and compared
with the reference's part; keyed fields are left to ``keyed``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from harness._judges.judge import Judge, Layout, data_part, group_part, position_text
from harness._judges.keyed import _keyed_position, check_keyed_field
from harness._records.run import FieldError, FieldRecord, StepRecord
from harness.compare import Mismatch, Quantity
from harness.partition import ownership
from harness.report.hints import boundary_hint, shard_shape_hint

SHARD_HINT = (
    "return this rank's part of a field as a Shard: Shard.grid(values, rows, cols, nlat, "
    "nlon) for a lat x lon block, Shard(values, index, dim) otherwise; a plain tensor means "
    "the whole field"
)


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
            Mismatch(Quantity.FIELD, name, step, r, where="field missing on this rank")
            for r in missing
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
                judge.spread(Quantity.FIELD, step, name, group_part(g, layout.data_size)),
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
        Quantity.BATCH,
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
        group = rank // layout.spatial_size
        expected = data_part(ref, group, layout.data_size)
        spread = judge.spread(Quantity.FIELD, step, name, group_part(group, layout.data_size))
        m = judge.numeric(Quantity.FIELD, name, step, rank, f.values, expected, None, spread)
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
    spread: torch.Tensor | None = None  # each entry's rounding spread, where calibrated
    placed: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def refuse(self, quantity: Quantity, rank: int | None, where: str, hint: str = "") -> None:
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
    spread: torch.Tensor | None = None,
) -> tuple[list[Mismatch], FieldError | None]:
    """Reassemble one data group's shards and compare with the reference's part (within
    ``spread``'s multiple, where the check is calibrated: ``Judge.numeric``).

    Coverage first: every global position must be owned by exactly one rank; then each
    shard's shape; then the values of the reassembled field.
    """
    grid = next((f.grid for f in shards if f.grid), None)
    if grid is not None and tuple(ref.shape[-2:]) == tuple(grid):
        ref = ref.reshape(*ref.shape[:-2], -1)
        if spread is not None and tuple(spread.shape[-2:]) == tuple(grid):
            spread = spread.reshape(*spread.shape[:-2], -1)
    dims = {(f.dim or 0) % max(ref.dim(), 1) for f in shards if f.sharded}
    dim = next(iter(dims), 0)
    job = _Assembly(name, step, ref, dim, ref.shape[dim] if ref.dim() else 1, grid, shards[0].unit)
    job.spread = spread
    if len(dims) > 1:
        job.refuse(
            Quantity.FIELD,
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
                Quantity.COVERAGE,
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
            Quantity.FIELD,
            rank,
            f"a plain tensor of shape {tuple(f.values.shape)} where other ranks return a Shard",
            SHARD_HINT,
        )
        job.claims.append(nothing)
        return
    idx = f.positions(job.size)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= job.size):
        job.refuse(
            Quantity.COVERAGE,
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
            Quantity.FIELD,
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

    m = judge.numeric(
        Quantity.FIELD, job.name, job.step, None, out, ref, where if ref.dim() else None, job.spread
    )
    if m is None:
        return [], None
    # the largest error (and reference magnitude) at each position, over the other dims; a
    # scalar is one position
    diff = (out - ref).abs().to(torch.float64)
    err = diff.movedim(dim, -1).reshape(-1, size).amax(0)
    if m.calibrated and job.spread is not None:  # over its own bound, entry by entry
        from harness._judges.spread import allowance

        share = diff / allowance(job.spread, ref, m.spread_factor).reshape(diff.shape)
        over = share.movedim(dim, -1).reshape(-1, size).amax(0)
        allowed: float | torch.Tensor = 1.0
    else:
        mag = ref.abs().to(torch.float64).movedim(dim, -1).reshape(-1, size).amax(0)
        bound = judge.tolerance.field
        over, allowed = err, bound.atol + bound.rtol * mag
    where_hint = judge.diagnose(
        f"a boundary hint for field '{job.name}'",
        "",
        boundary_hint,
        over,
        owners,
        allowed,
        job.grid,
        job.unit,
    )
    if where_hint:
        m.hint = where_hint
    group = first // judge.layout.spatial_size
    return [m], FieldError(job.name, job.step, group, err, owners, job.grid, job.unit)


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


# ---------------------------------------------------------------------- whole fields


def assemble_whole(
    name: str, ref: torch.Tensor, recs: list[FieldRecord], spatial_size: int
) -> torch.Tensor:
    """The partitioned field in the reference's layout (a grid shard's field flattened as
    ``Shard.grid`` does), each data group's spatial ranks placed in that group's samples.
    Structure (coverage, shapes) was checked by ``check_fields`` before this."""
    groups = len(recs) // spatial_size
    parts = []
    grid = next((f.grid for f in recs if f.grid), None)
    if grid is not None and tuple(ref.shape[-2:]) == tuple(grid):
        ref = ref.reshape(*ref.shape[:-2], -1)
    for g in range(groups):
        shards = recs[g * spatial_size : (g + 1) * spatial_size]
        if not any(f.sharded for f in shards):
            parts.append(shards[0].values)
            continue
        dim = (shards[0].dim or 0) % max(ref.dim(), 1)
        n = ref.shape[dim] if ref.dim() else 1
        out = torch.zeros_like(data_part(ref, g, groups))
        for f in shards:
            idx = f.positions(n)
            if ref.dim():
                out.index_copy_(dim, idx, f.values.to(out.dtype))
            elif idx.numel():
                out.copy_(f.values.reshape(()))
        parts.append(out)
    return parts[0] if groups == 1 else torch.cat(parts, dim=0)


def flat_like(whole: FieldRecord, recs: list[FieldRecord]) -> torch.Tensor:
    """A whole field (the reference's, a member's) in the layout ``assemble_whole`` gives the
    ranks' shards ``recs``: flattened lat x lon where they are ``Shard.grid`` blocks."""
    v = whole.values
    grid = next((f.grid for f in recs if f.grid), None)
    if grid is not None and tuple(v.shape[-2:]) == tuple(grid):
        v = v.reshape(*v.shape[:-2], -1)
    return v
