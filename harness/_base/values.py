"""What a recorded value is, whatever tensor type the model used: the one place that turns a
DTensor, a physicsnemo ``ShardTensor`` or any other tensor subclass into plain values.

Every comparison computes on plain ``torch.Tensor``s: a DTensor meeting a plain tensor in an
operation raises (``aten.sub.Tensor got mixed torch.Tensor and DTensor``), so a verdict would
be lost to the arithmetic. Two functions:

- ``plain(t)``: the values this process holds, as a plain tensor, with no communication (a
  DTensor's local shard, ``to_local()``; any other subclass viewed as a plain tensor).
- ``placed(t)``: where those values sit in the global tensor, as the value's placements say
  (``Replicate`` on every mesh dim: the whole; ``Shard(d)``: a block of positions along
  ``d``). What the placements cannot say as one block (``Partial`` sums, two sharded dims, a
  subclass without placements) is gathered whole with ``full_tensor()``, a collective every
  rank reaches in the same order, since every rank records the same values.

Duck-typed on purpose (``to_local``, ``full_tensor``, ``placements``, ``device_mesh``,
``Placement.is_shard()``...): DTensor's public interface, which physicsnemo's ``ShardTensor``
(a DTensor subclass whose spec knows every shard's shape, ``_spec.offsets()``) shares;
nothing here imports ``torch.distributed.tensor``. Written against torch 2.13's DTensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def is_distributed(t: object) -> bool:
    """A tensor that holds part of a global value and can say so: it has ``to_local``."""
    return isinstance(t, torch.Tensor) and callable(getattr(t, "to_local", None))


def plain(t: torch.Tensor) -> torch.Tensor:
    """The values this process holds, as a plain ``torch.Tensor`` (no communication).

    A plain tensor (or ``nn.Parameter``) is returned as is; a DTensor-like one gives its
    local shard; any other subclass is viewed as a plain tensor.
    """
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    if is_distributed(t):
        local = t.to_local()  # type: ignore[attr-defined]
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor: its values, complete
        if callable(wait) and type(local) is not torch.Tensor:
            local = wait()
        return local if type(local) in (torch.Tensor, torch.nn.Parameter) else _as_plain(local)
    return _as_plain(t)


def _as_plain(t: torch.Tensor) -> torch.Tensor:
    """A subclass's own storage seen as a plain tensor (``as_subclass``); one that has none
    of its own (a wrapper subclass) is refused with what it is."""
    try:
        out = torch.Tensor.as_subclass(t, torch.Tensor)
        out.numel()  # a wrapper without storage fails here, not later in a comparison
        return out
    except Exception as exc:  # noqa: BLE001 - any failure: the value cannot be read plainly
        raise TypeError(
            f"a {type(t).__name__} value cannot be read as a plain tensor ({exc}); give it a "
            "to_local() (its local values) or convert it before returning it"
        ) from None


@dataclass(frozen=True)
class Placed:
    """A value as recorded: ``values`` (plain), and where they sit in the global tensor.

    ``dim is None``: the whole value. Otherwise ``values`` is this rank's block of the
    ``size`` global positions from ``start`` along ``dim``, as the placements say (values of
    another length along ``dim`` are a finding of the comparison, not of this module).
    ``how`` describes the value's placements for reports (``"DTensor (Replicate(),
    Shard(dim=0)) on a 1x2 mesh"``), empty for a plain tensor; ``gathered``: the values were
    gathered whole (``full_tensor()``).
    """

    values: torch.Tensor
    dim: int | None = None
    start: int = 0
    size: int = 0
    how: str = ""
    gathered: bool = False

    @property
    def index(self) -> torch.Tensor | None:
        """The global positions along ``dim`` (``None`` for the whole value)."""
        if self.dim is None:
            return None
        return torch.arange(self.start, self.start + self.size)


def describe(t: torch.Tensor) -> str:
    """``"DTensor (Replicate(), Shard(dim=0)) on a 1x2 mesh ('data', 'spatial')"``: the
    value's type and placements, for reports; the type alone where it has none."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return type(t).__name__
    text = f"{type(t).__name__} ({', '.join(map(repr, placements))})"
    mesh = getattr(t, "device_mesh", None)
    shape = getattr(mesh, "shape", None)
    if shape is not None:
        text += f" on a {'x'.join(map(str, shape))} mesh"
        names = getattr(mesh, "mesh_dim_names", None)
        if names:
            text += f" {tuple(names)}"
    return text


def block(t: torch.Tensor) -> tuple[int | None, int, int] | None:
    """Where this rank's values of ``t`` sit, by its placements, with no communication:
    ``(None, 0, 0)`` the whole value, ``(dim, start, size)`` the ``size`` positions from
    ``start`` along ``dim`` (what the placements give this rank, whatever it holds);
    ``None`` when they do not say (``Partial`` sums, two sharded dims, a strided shard, a
    subclass without placements): then only a gather (``full_tensor()``) gives the value."""
    if not is_distributed(t):
        return None, 0, 0
    placements = getattr(t, "placements", None)
    if placements is None or any(_is(p, "is_partial") for p in placements):
        return None
    shards = [p for p in placements if _is(p, "is_shard")]
    if not shards:
        return None, 0, 0  # replicated: every rank holds the whole
    dims = {int(p.dim) % max(t.dim(), 1) for p in shards}
    if len(dims) > 1 or any(type(p).__name__ != "Shard" for p in shards):
        return None
    dim = next(iter(dims))
    span = _span(t, placements, dim)
    return None if span is None else (dim, *span)


def placed(t: torch.Tensor) -> Placed:
    """``t`` as recorded: its local block where its placements say where that sits, else
    its whole value (gathered with ``full_tensor()`` when no rank holds it whole)."""
    if not is_distributed(t):
        return Placed(plain(t))
    how = describe(t)
    at = block(t)
    if at is not None:
        return Placed(plain(t), at[0], at[1], at[2], how)
    full = getattr(t, "full_tensor", None)
    if not callable(full):
        return Placed(plain(t), how=how)  # nothing says where it sits: its values as held
    return Placed(plain(full()), how=how, gathered=True)


def _is(placement: object, test: str) -> bool:
    method = getattr(placement, test, None)
    return bool(method()) if callable(method) else False


def _span(t: torch.Tensor, placements: Any, dim: int) -> tuple[int, int] | None:
    """This rank's block along ``dim``, ``(start, size)``: from the spec's own offsets where
    it keeps every shard's shape (physicsnemo's uneven shards; the size is then the local
    one), else by DTensor's rule (``torch.chunk``'s split, mesh dim after mesh dim);
    ``None`` for a rank outside the mesh."""
    mesh = getattr(t, "device_mesh", None)
    coordinate = mesh.get_coordinate() if mesh is not None else None
    if mesh is None or coordinate is None:
        return None
    spec = getattr(t, "_spec", None)
    offsets = getattr(spec, "offsets", None)
    if callable(offsets) and getattr(spec, "_sharding_shapes", None) is not None:
        start = sum(
            int(offsets(m))
            for m, p in enumerate(placements)
            if _is(p, "is_shard") and int(p.dim) % t.dim() == dim
        )
        return start, int(plain(t).shape[dim])
    start, size = 0, int(t.shape[dim])
    for m, p in enumerate(placements):
        if not (_is(p, "is_shard") and int(p.dim) % t.dim() == dim):
            continue
        chunk = math.ceil(size / mesh.size(m)) if size else 0
        lo = min(chunk * int(coordinate[m]), size)
        hi = min(lo + chunk, size)
        start, size = start + lo, hi - lo
    return start, size
