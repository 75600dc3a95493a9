"""What one run of a case records: the typed shape a rank sends and the comparison reads.

``run_case`` fills a ``RunRecord`` on every rank and once for the reference; ``checks``
compares them and leaves, per differing field, a ``FieldError`` (what error maps draw).
Everything here is plain CPU tensors, picklable across the pool's pipes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass, replace
from typing import TypeVar, cast

import torch


@dataclass
class FieldRecord:
    """One output field of one rank: its values and, for a shard, where they sit.

    ``index`` is ``None`` for a full (replicated, or the reference's) tensor; otherwise the
    global positions along ``dim`` (a LongTensor, or a slice of the global length).
    ``grid`` (rows, cols) says positions are flattened lat x lon; ``unit`` names a position.
    A keyed field (``Shard.keyed``) has no positions but ``keys``: a ``(items, width)``
    LongTensor, one row naming each item along dim 0 of ``values`` (1-D keys are stored as
    width 1); ``cell_column`` is the key column holding the item's HEALPix cell, if any.
    """

    values: torch.Tensor
    index: torch.Tensor | slice | None = None
    dim: int | None = None
    grid: tuple[int, int] | None = None
    unit: str = "position"
    keys: torch.Tensor | None = None
    cell_column: int | None = None

    @property
    def sharded(self) -> bool:
        return self.index is not None or self.keys is not None

    @property
    def keyed(self) -> bool:
        return self.keys is not None

    def positions(self, size: int) -> torch.Tensor:
        """The global positions as a LongTensor (a slice resolved against ``size``)."""
        if isinstance(self.index, slice):
            return torch.arange(size)[self.index]
        if self.index is None:
            return torch.arange(size)
        return self.index


@dataclass(frozen=True)
class ParamShard:
    """Where a sharded parameter's local values sit in the reference's parameter.

    ``index`` (a 1-D LongTensor, one global position per local value along ``dim``) and
    ``dim`` (non-negative) come from ``SpatialCase.parameter_shards``; the values themselves
    are the ones recorded under the parameter's name (``RunRecord.init``, ``StepRecord``).
    ``how``: what placed it there when the case did not say, a DTensor's placements
    (``"DTensor (Replicate(), Shard(dim=0)) on a 1x2 mesh"``); empty for a declared shard.
    """

    index: torch.Tensor
    dim: int
    how: str = ""

    def text(self) -> str:
        """``"positions 8..15 along dim 1"`` (first..last; ``"no positions"`` when empty)."""
        of = f" of a {self.how}" if self.how else ""
        if not self.index.numel():
            return f"no positions along dim {self.dim}{of}"
        lo, hi = int(self.index.min()), int(self.index.max())
        span = (
            f"positions {lo}..{hi}"
            if hi - lo + 1 == self.index.numel()
            else (f"{self.index.numel()} positions in {lo}..{hi}")
        )
        return f"{span} along dim {self.dim}{of}"


@dataclass
class StepRecord:
    """One training step: the loss, every named gradient (``None`` where the parameter got
    none), every field, the parameters after the SGD step, and the buffers the step changed
    in place."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    fields: dict[str, FieldRecord] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    mutated_buffers: list[str] = field(default_factory=list)


@dataclass
class RunRecord:
    """A whole run on one rank (or the reference): parameters after ``build``, then steps.

    The topology fields say where the rank sat (the reference: sizes 1, ranks 0).
    """

    init: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    spatial_rank: int = 0
    data_rank: int = 0
    spatial_size: int = 1
    data_size: int = 1
    describe: str = ""
    #: torch.distributed operations the rank issued during the run (``None``: not known,
    #: e.g. under torchrun, where the harness does not watch them)
    communicated: int | None = None
    #: sharded parameters (``SpatialCase.parameter_shards``): name -> where this rank's
    #: values sit in the reference's parameter; every other parameter is whole (replicated)
    param_shards: dict[str, ParamShard] = field(default_factory=dict)
    #: the parameters whose shards were overwritten with the reference's initial values
    #: before the first step (``SpatialCase.load_reference_shards``)
    loaded_shards: list[str] = field(default_factory=list)
    #: floating dtypes other than the run's default seen on the path: dtype -> where first
    #: ("an all_reduce at model.py:42 ran in float32", "the output of 'mixer' (Linear) was
    #: float32"); what a precision hint needs as evidence (``harness._rank.dtypes``)
    dtypes: dict[str, str] = field(default_factory=dict)

    def flat(self) -> dict[str, torch.Tensor]:
        """The run's results as one flat ``{name: tensor}`` map (what goldens store)."""
        flat: dict[str, torch.Tensor] = {}
        for i, st in enumerate(self.steps):
            flat[f"step{i}/loss"] = st.loss
            for n, g in st.grads.items():
                if g is not None:
                    flat[f"step{i}/grad/{n}"] = g
            for n, f in st.fields.items():
                flat[f"step{i}/field/{n}"] = f.values
                if f.keys is not None:  # which item is which: a golden pins the keys too
                    flat[f"step{i}/keys/{n}"] = f.keys
            for n, p in st.params.items():
                flat[f"step{i}/param/{n}"] = p
        return flat


def detached(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that shares nothing with the model's tensors."""
    return t.detach().to("cpu").clone()


T = TypeVar("T")


def map_tensors(obj: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """``obj`` with ``fn`` applied to each tensor of its tuples (named or not), lists, dicts
    and dataclasses; anything else as it is (a batch, a module's inputs)."""
    return cast(T, _map_tensors(obj, fn))  # the same structure, its tensors replaced


def _map_tensors(obj: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        make: Callable[..., object] = type(obj)  # fields by position
        return make(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        names = [f for f in obj.__dataclass_fields__ if obj.__dataclass_fields__[f].init]
        return replace(obj, **{n: _map_tensors(getattr(obj, n), fn) for n in names})
    return obj


@dataclass
class FieldError:
    """Where a reassembled field differs: the largest error at each global position.

    ``error`` and ``owners`` (the rank that owns each position) run along the sharded
    dimension; with ``grid`` (rows, cols) they are flattened lat x lon, and with
    ``unit == "cell"`` they are HEALPix cells in nested order. What error maps are drawn from.
    """

    name: str
    step: int
    data_group: int
    error: torch.Tensor
    owners: torch.Tensor
    grid: tuple[int, int] | None
    unit: str
