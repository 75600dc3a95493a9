"""The checks of what a case returns and declares, each one clear ``ConfigError``: its fields
(``field_record``: a ``Shard`` by positions, ``Shard.keyed``, a whole tensor), its partition
and activation shards (``check_partition``, ``check_activation_shard``, ``ActivationCheck``),
its model, batch and loss (``check_model``, ``check_batch``, ``check_returned_loss``).

The contract they check is ``harness.case`` (which imports nothing of this module); the
checks of a case's parameter shards are there, beside the public ``parameter_shards``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from harness._base.values import placed, plain
from harness._records.run import FieldRecord, detached
from harness.case import KEYED_FORM, Outputs, Shard, SpatialCase, _integer_index, _whose
from harness.errors import ConfigError
from harness.topology import Topology

# ---------------------------------------------------------------------- fields


def field_record(case: SpatialCase, name: str, value: object, origin: str = "") -> FieldRecord:
    """Field ``name`` as a record. ``origin``: who returned it, for the errors
    (``"ring.predict step 2"``); ``forward``'s ``Outputs`` by default."""
    if isinstance(value, Shard) and isinstance(value.values, torch.Tensor):
        # the case placed a DTensor's values itself: the ones this rank holds
        value = dataclasses.replace(value, values=plain(value.values))
    if isinstance(value, Shard) and (value.keys is not None or value.index is None):
        return _keyed_record(case, name, value, origin)
    if isinstance(value, Shard):
        index = value.index
        if not isinstance(index, slice):
            index = detached(shard_index(case, name, value, origin))
        return FieldRecord(detached(value.values), index, value.dim, value.grid_shape, value.unit)
    if isinstance(value, torch.Tensor):
        at = placed(value)  # a DTensor: as its placements place it (a plain tensor: whole)
        if at.dim is None:
            return FieldRecord(detached(at.values))
        return FieldRecord(detached(at.values), at.index, at.dim)
    what = f"field {name!r}" if origin else f"Outputs.fields[{name!r}]"
    raise ConfigError(
        f"{origin or case.label + '.forward'}: {what} is a {type(value).__name__}; give a "
        "torch.Tensor (the whole field) or a harness.Shard (this rank's part of it)"
    )


def _keyed_record(case: SpatialCase, name: str, shard: Shard, origin: str = "") -> FieldRecord:
    """A keyed shard's record, its keys as an ``(items, width)`` LongTensor; anything else is
    one clear error naming the field (the rank is named by the failure that carries it)."""
    origin = origin or f"{case.label}.forward"
    if shard.keys is None:
        raise ConfigError(
            f"{origin}: Shard of field {name!r} has no index (None); give "
            f"Shard(values, index, dim) for positions, or {KEYED_FORM}"
        )
    where = f"{origin}: Shard.keyed of field {name!r}"
    values = shard.values
    if not isinstance(values, torch.Tensor) or values.dim() == 0:
        got = "a 0-d tensor" if isinstance(values, torch.Tensor) else type(values).__name__
        raise ConfigError(f"{where} has values that are {got}; give {KEYED_FORM}")
    try:
        keys = torch.as_tensor(shard.keys)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"{where} has keys of type {type(shard.keys).__name__}; give {KEYED_FORM}"
        ) from None
    if keys.dtype == torch.bool or keys.is_floating_point() or keys.is_complex():
        raise ConfigError(
            f"{where} has {str(keys.dtype).replace('torch.', '')} keys; keys must be integers "
            "(torch.long): items are matched by exact key, so cast the ids you pack, not "
            "values computed from them"
        )
    if keys.dim() not in (1, 2) or (keys.dim() == 2 and keys.shape[1] == 0):
        raise ConfigError(f"{where} has keys of shape {tuple(keys.shape)}; give {KEYED_FORM}")
    if keys.shape[0] != values.shape[0]:
        raise ConfigError(
            f"{where} has {keys.shape[0]} keys but {values.shape[0]} items along dim 0 of its "
            f"values (shape {tuple(values.shape)}); one key (row) per item: items run along "
            "dim 0, so move the item dim first (values.movedim(d, 0))"
        )
    if keys.dim() == 1:
        keys = keys[:, None]  # one column: every key is a row, also when there are no items
    column = shard.cell_column
    if column is not None and not (
        isinstance(column, int) and not isinstance(column, bool) and 0 <= column < keys.shape[1]
    ):
        raise ConfigError(
            f"{where} has cell_column={column!r} but its keys have {keys.shape[1]} column(s); "
            f"give the index of the column holding the cell, 0..{keys.shape[1] - 1}"
        )
    if column is not None and keys.numel() and int(keys[:, column].min()) < 0:
        raise ConfigError(
            f"{where} has a negative cell ({int(keys[:, column].min())}) in key column "
            f"{column}; cells are HEALPix NESTED ids counting from 0"
        )
    return FieldRecord(detached(values), None, 0, None, shard.unit, detached(keys.long()), column)


def shard_index(case: SpatialCase, name: str, shard: Shard, origin: str = "") -> torch.Tensor:
    """A shard's index as a 1-D LongTensor of non-negative positions, one per value along
    ``dim``; anything else is one clear error naming the field (the rank is named by the
    failure that carries it)."""
    where = f"{origin or case.label + '.forward'}: Shard of field {name!r}"
    index = _integer_index(where, shard.index)
    if index.dim() != 1:
        raise ConfigError(
            f"{where} has an index of shape {tuple(index.shape)}; it must be 1-D (positions "
            "along one dim). For a 2-D block of a lat x lon grid use Shard.grid(values, rows, "
            "cols, nrows, ncols); for items named by several keys, Shard.keyed"
        )
    dim = shard.dim if shard.dim >= 0 else shard.values.dim() + shard.dim
    if not 0 <= dim < max(shard.values.dim(), 1):
        raise ConfigError(
            f"{where}: dim={shard.dim} but its values have {shard.values.dim()} dimension(s)"
        )
    if index.numel() != shard.values.shape[dim]:
        block = shard.values.dim() >= 2 and index.numel() == shard.values.shape[-2:].numel()
        raise ConfigError(
            f"{where} has {index.numel()} positions in its index but {shard.values.shape[dim]} "
            f"values along dim {shard.dim} (values of shape {tuple(shard.values.shape)}); one "
            "position per value"
            + (
                ": its last two dims are a (rows, cols) block, not flattened: use "
                "Shard.grid(values, rows, cols, nlat, nlon)"
                if block
                else ""
            )
        )
    if index.numel() and int(index.min()) < 0:
        raise ConfigError(
            f"{where} has a negative position ({int(index.min())}) in its index; positions "
            "are global and count from 0"
        )
    return index.long()


# ---------------------------------------------------------------------- declarations

ACTIVATION_FORM = 'a Shard, "whole", "skip" or None (infer it from partition)'


def check_partition(case: SpatialCase, topo: Topology) -> None:
    """``case.partition(topo)`` on a rank, checked up front: a value locating cannot read
    is one ``ConfigError`` now, whether or not the check ever locates."""
    from harness.divergence import axes_of

    given = case.partition(topo)
    try:
        axes_of(given, topo.spatial_rank)
    except TypeError:
        raise ConfigError(
            f"{case.label}.partition {_whose(topo)} returned {_shown(given)}; return a "
            "LatLonPartition, a CellPartition, harness.Positions, a list of them, or None"
        ) from None


def _shown(value: object) -> str:
    """``'junk' (a str)``: a value as a message quotes it, cut to a line's share."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} (a {type(value).__name__})"


def check_activation_shard(case: SpatialCase, name: str, said: Any, whose: str = "") -> Any:
    """One answer of ``case.activation_shard`` for module ``name``: returned as is when it
    is one the harness reads (a ``Shard`` whose index fits its values, ``"whole"``,
    ``"skip"``, ``None``), else one ``ConfigError`` naming the module and the fix.
    ``whose``: `` on rank 2`` (the error's evidence), empty where the caller says it."""
    if said is None or (isinstance(said, str) and said in ("whole", "skip")):
        return said
    where = f"{case.label}.activation_shard({name!r}, ...){whose}"
    if not isinstance(said, Shard):
        raise ConfigError(f"{where} returned {_shown(said)}; return {ACTIVATION_FORM}")
    if not isinstance(said.values, torch.Tensor):
        raise ConfigError(
            f"{where} returned a Shard whose values are a {type(said.values).__name__}; give "
            "the module's tensor itself as the values"
        )
    if said.keys is not None:
        raise ConfigError(
            f"{where} returned a Shard.keyed; a module's tensor is placed by positions: "
            f"return {ACTIVATION_FORM}"
        )
    if not isinstance(said.index, slice):
        shard_index(
            case, f"activation of {name!r}", dataclasses.replace(said, values=plain(said.values))
        )
    return said


class ActivationCheck:
    """Asks ``case.activation_shard`` about each module's first output on a rank, during
    the first step, and checks every answer (``check_activation_shard``): a case that
    declares layouts locating cannot read fails the check as a ``ConfigError`` up front,
    not in a locating rerun that may never run. Nothing is hooked when the case keeps the
    default ``activation_shard``."""

    def __init__(self, case: SpatialCase, model: torch.nn.Module, topo: Topology) -> None:
        self.case, self.topo = case, topo
        self.handles: list[RemovableHandle] = []
        self.asked: set[str] = set()
        if type(case).activation_shard is SpatialCase.activation_shard:
            return
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if name in self.asked:
                return
            self.asked.add(name)
            tensor = next(_tensors_in(output), None)
            if tensor is not None:
                said = self.case.activation_shard(name, tensor, self.topo)
                check_activation_shard(self.case, name, said, f" {_whose(self.topo)}")

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _tensors_in(obj: Any) -> Any:
    """The tensors in ``obj``'s tuples, lists and dicts, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors_in(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)


# ---------------------------------------------------------------------- model, batch, loss


def check_batch(case: SpatialCase, batch: Any, step: int) -> Any:
    if batch is None or isinstance(batch, (str, bytes)):
        got = "None" if batch is None else f"a {type(batch).__name__}"
        raise ConfigError(
            f"{case.label}.batch returned {got} for step {step}; it must return this rank's "
            "share of the step's batch (a tensor, or a dict, tuple or dataclass of tensors) "
            "for forward to use (a missing `return`?)"
        )
    return batch


def check_model(case: SpatialCase, model: object) -> torch.nn.Module:
    if model is None:
        raise ConfigError(
            f"{case.label}.build returned None; it must return the torch.nn.Module under test "
            "(a missing `return model`?)"
        )
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"{case.label}.build returned a {type(model).__name__}; it must return a "
            "torch.nn.Module (wrap a function in a Module whose forward calls it)"
        )
    return model


def check_returned_loss(case: SpatialCase, out: object, trainable: bool) -> torch.Tensor:
    if not isinstance(out, Outputs):
        raise ConfigError(
            f"{case.label}.forward must return harness.Outputs(loss, fields), got "
            f"{type(out).__name__}"
        )
    loss = out.loss
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"{case.label}.forward: Outputs.loss is a {type(loss).__name__}; it must be a "
            "scalar torch.Tensor (keep it a tensor: the harness back-propagates it)"
        )
    if loss.numel() != 1:
        raise ConfigError(
            f"{case.label}.forward: Outputs.loss has shape {tuple(loss.shape)}; it must be a "
            "scalar: reduce it to the one global loss (identical on every rank), e.g. with "
            "reduce_loss(local.sum(), topo) / count"
        )
    if trainable and not loss.requires_grad:
        raise ConfigError(
            f"{case.label}.forward: Outputs.loss does not depend on any trainable parameter "
            "(requires_grad is False): was it detached, computed under torch.no_grad(), or "
            "reduced from detached values? The harness back-propagates it to compare gradients"
        )
    return loss
