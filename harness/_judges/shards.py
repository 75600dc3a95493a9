"""Sharded parameters right after build: does each rank's shard fit the reference's
parameter, and do the shards of each spatial group cover every position once? The shards
that fit (``ParamShards``) are then compared by ``values``, each with the reference's values
at its positions (``part``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from harness._judges.judge import Layout
from harness._records.run import ParamShard, RunRecord
from harness.compare import Mismatch, Quantity
from harness.partition import ownership

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


@dataclass(frozen=True)
class ParamShards:
    """A run's sharded parameters: every name some rank shards (``names``), and the shards
    that fit the reference's parameter (``fit``: name -> rank -> shard). The value checks
    compare a whole parameter with the reference's and a shard with the reference's values
    at its positions (``part``)."""

    names: frozenset[str] = frozenset()
    fit: dict[str, dict[int, ParamShard]] = field(default_factory=dict)

    def held(self, name: str, rank: int) -> ParamShard | None:
        """The shard of ``name`` that ``rank`` holds, if it fits the reference's parameter."""
        return self.fit.get(name, {}).get(rank)

    def compared(self, name: str, rank: int) -> bool:
        """Whether ``rank``'s value of ``name`` is compared: a parameter no rank shards, or
        a shard that fits (what does not fit, ``check_param_shards`` names instead)."""
        return name not in self.names or self.held(name, rank) is not None


#: a run without sharded parameters
NO_SHARDS = ParamShards()


def part(
    ref: torch.Tensor, shard: ParamShard | None, shape: torch.Size
) -> tuple[torch.Tensor, Callable[[int], str] | None]:
    """What a rank's value (of ``shape``) is compared with: the reference's whole ``ref``,
    or its values at ``shard``'s positions with a namer of a flat index into the shard by
    its index in the reference's parameter."""
    if shard is None:
        return ref, None

    def where(flat: int) -> str:
        coords = [int(c) for c in np.unravel_index(flat, tuple(shape))]
        coords[shard.dim] = int(shard.index[coords[shard.dim]])
        return str(tuple(coords))

    return ref.index_select(shard.dim, shard.index), where


def shard_part(
    shard: ParamShard | None, shape: torch.Size
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``part``'s values as a function of the tensor: how a spread is cut as its reference
    is (``Judge.spread``)."""
    return lambda t: part(t, shard, shape)[0]


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
            found.append(
                Mismatch(Quantity.PARAM, name, None, None, where=where, hint=PARAM_SHARD_HINT)
            )
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
        Quantity.COVERAGE,
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
        return Mismatch(Quantity.PARAM, name, None, rank, where=where, hint=PARAM_SHARD_HINT)
    size = int(ref.shape[shard.dim])
    if shard.index.numel() and int(shard.index.max()) >= size:
        where = f"{shard.text()}, outside [0, {size}) of the reference's parameter {shape}"
        return Mismatch(
            Quantity.COVERAGE,
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
            Quantity.PARAM,
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
        near = _nearest_holder(owner, pos)
        beside = "" if near is None else f", next to rank {near}'s {held[near].text()}"
        where = f"{len(own.missing)} position(s) along dim {dim} held by no rank of {group} "
        where += f"(first: {pos}{beside})"
        found.append(_coverage(name, near, len(own.missing), size, where, PARAM_SHARD_HINT))
    if len(own.doubled):
        pos = int(own.doubled[0])
        holders = [holding[0] for k, holding in distinct if pos in k]
        if len(holders) == 1:  # one shard repeats a position (the rank refuses that)
            holders *= 2
        a, b = holders[0], holders[1]
        where = (
            f"{len(own.doubled)} position(s) along dim {dim} held by ranks of {group} holding "
            f"different shards (first: {pos}, by rank {a}'s {held[a].text()} and rank {b}'s "
            f"{held[b].text()})"
        )
        hint = "ranks holding copies of a shard must hold exactly the same positions: "
        found.append(_coverage(name, b, len(own.doubled), size, where, hint + PARAM_SHARD_HINT))
    return found


def _nearest_holder(owner: np.ndarray, pos: int) -> int | None:
    """The rank holding the nearest held position below ``pos`` (else above), if any.

    >>> _nearest_holder(np.array([-1, 3, -1, -1, 5]), 3), _nearest_holder(np.array([-1, 7]), 0)
    (3, 7)
    """
    below = [p for p in range(pos - 1, -1, -1) if owner[p] >= 0][:1]
    above = [p for p in range(pos + 1, len(owner)) if owner[p] >= 0][:1]
    return int(owner[(below or above)[0]]) if below or above else None


def _coverage(
    name: str, rank: int | None, count: int, size: int, where: str, hint: str
) -> Mismatch:
    """A ``coverage`` finding of parameter ``name`` at build: ``count`` of ``size`` positions."""
    return Mismatch(
        Quantity.COVERAGE, name, None, rank, count=count, total=size, where=where, hint=hint
    )
