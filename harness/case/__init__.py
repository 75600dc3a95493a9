"""The downstream contract: ``SpatialCase``, ``Outputs``, ``Shard``, ``data_share``, and
the checks of the parameter shards a case declares (``parameter_shards``) and the loading of
the reference's initial values into them (``load_shards``, ``load_init``), each one clear
``ConfigError``. The checks of what else it declares and returns (its fields, partition,
activation shards, batch, model and loss) are ``harness.case.declared``, which imports this.

Running a case is the rank side's (``harness._rank.run.run_case``): this module imports
nothing of the pool, the ranks' watchers or the mutants (``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from harness._base.values import block, describe, is_distributed, plain
from harness._records.run import ParamShard
from harness.compare import Tolerance
from harness.errors import ConfigError
from harness.topology import Topology

# ---------------------------------------------------------------------- contract


@dataclass
class Shard:
    """A rank's part of a global field: ``values`` at global positions ``index`` along ``dim``.

    ``index`` is a 1-D LongTensor (or a ``slice``) of positions along ``dim`` of the global
    field. ``unit`` names a position in reports ("cell" for HEALPix cells). ``grid_shape``
    (rows, cols), set by ``Shard.grid``, says positions are ``row * cols + col`` of the
    field's last two dimensions flattened, so reports can name (lat, lon) (or the grid's
    own axes, ``unit`` then holding the two names: ``"l,m"``). ``Shard.keyed``
    makes the other kind: a set of items named by integer ``keys`` (``index`` is ``None``).
    """

    values: torch.Tensor
    index: torch.Tensor | slice | None
    dim: int = -1
    grid_shape: tuple[int, int] | None = None
    unit: str = "position"
    keys: Any = None  # Shard.keyed: one integer key (or key row) per item along dim 0
    cell_column: int | None = None  # Shard.keyed: the key column that holds a HEALPix cell

    def __post_init__(self) -> None:
        # refused where the Shard is made, in the case's own line: later, a list's missing
        # .dim() was a bare AttributeError from inside the harness
        _shard_values("Shard", self.values)
        if isinstance(self.dim, bool) or not isinstance(self.dim, numbers.Integral):
            raise ConfigError(
                f"Shard: dim={self.dim!r} (a {type(self.dim).__name__}); give the int "
                "dimension of values that index runs along, e.g. dim=-1"
            )

    @classmethod
    def grid(
        cls,
        values: torch.Tensor,
        rows: slice,
        cols: slice,
        nrows: int,
        ncols: int,
        *,
        axes: tuple[str, str] = ("lat", "lon"),
    ) -> Shard:
        """The block ``values`` = field[..., rows, cols] of a (..., nrows, ncols) field.

        The last two dimensions are flattened; the reference's full field is flattened the
        same way when compared. ``axes`` names the two dimensions in reports (``("l",
        "m")`` for spectral coefficients): ``(lat 3, lon 7)`` by default.
        """
        if not (
            isinstance(axes, tuple)
            and len(axes) == 2
            and all(isinstance(a, str) and a and "," not in a for a in axes)
        ):
            raise ConfigError(
                f"Shard.grid: axes={axes!r} must be two names without commas, one per grid "
                'dimension, e.g. axes=("l", "m")'
            )
        _shard_values("Shard.grid", values)
        r = torch.arange(nrows)[rows]
        c = torch.arange(ncols)[cols]
        if tuple(values.shape[-2:]) != (len(r), len(c)):
            raise ConfigError(
                f"Shard.grid: values end in shape {tuple(values.shape[-2:])} but the block "
                f"rows {rows} x cols {cols} of a {nrows}x{ncols} grid is {len(r)}x{len(c)}"
            )
        index = (r[:, None] * ncols + c[None, :]).reshape(-1)
        unit = "position" if axes == ("lat", "lon") else ",".join(axes)  # a grid's names
        return cls(values.reshape(*values.shape[:-2], -1), index, -1, (nrows, ncols), unit)

    @classmethod
    def keyed(cls, values: torch.Tensor, keys: Any, *, cell_column: int | None = None) -> Shard:
        """Items named by integer keys, in any packing order: ``values[i]`` is item
        ``keys[i]``.

        Items run along dim 0 of ``values`` (tokens packed along dim 0, as a decoder emits
        them); ``keys`` is 1-D (one key per item) or 2-D (one key row per item, e.g.
        ``(sample, cell, token)``). The reference returns ``Shard.keyed`` of the whole field
        in its own packing order, and the ranks' items are matched with its items by key:
        every reference key must be held by exactly one rank, across all data groups (key
        samples by their global index). ``cell_column``: the key column holding the item's
        HEALPix cell (NESTED), so reports name the cell and error maps can be drawn.
        Checked when ``forward`` returns (the error then names the field).
        """
        unit = "position" if cell_column is None else "cell"
        return cls(values, None, 0, None, unit, keys=keys, cell_column=cell_column)


def _shard_values(where: str, values: object) -> None:
    """A Shard's values must be a tensor (a DTensor's local part counts): one clear error."""
    if not isinstance(values, torch.Tensor):
        raise ConfigError(
            f"{where}: values is a {type(values).__name__}; give this rank's part of the field "
            "as a torch.Tensor (torch.as_tensor(values) for a list or an array)"
        )


@dataclass
class Outputs:
    """What one forward pass produced: the global loss and named output fields.

    ``loss`` is a scalar already reduced to the global value on every rank. ``fields`` maps a
    name to a ``Shard`` (partitioned) or a full tensor (the reference, or a replicated value).
    """

    loss: torch.Tensor
    fields: dict[str, torch.Tensor | Shard] = field(default_factory=dict)


class SpatialCase:
    """One model under test. Subclass it and write ``build``, ``batch`` and ``forward``.

    The harness seeds torch, numpy and ``random`` identically on every rank before ``build``
    and before each ``batch``, sets the default dtype to ``dtype`` (if given) and runs plain
    SGD with the given ``lr`` after each ``forward`` + ``loss.backward()``. Gradient
    synchronisation is the case's job (e.g. ``harness.collectives.sync_gradients`` in
    ``build``): that is what is under test. The case object is pickled to the ranks, so
    define the class at module level.
    """

    name: str | None = None
    dtype: torch.dtype | None = None
    #: The latitude (degrees) of each row of the case's lat x lon fields, north first or
    #: south first: error maps then put north at the top. ``None``: row 0 drawn at the top.
    latitudes: Any = None
    #: Set to True if the model is meant to produce NaN or inf (a masked field, say). Then
    #: non-finite values are not findings, but they must match the reference's position
    #: for position. Otherwise any NaN or inf, in the reference or on a rank, fails the check.
    expect_nonfinite: bool = False
    #: The case's own tolerance, used when ``check_equivalence`` is given none (a model with a
    #: known float32 step in a float64 run, say). ``None``: ``Tolerance.for_dtype``.
    tolerance: Tolerance | None = None
    #: Why this case may partition and communicate nothing (a test of replicated code):
    #: without a reason such a check fails as ``vacuous``, since it proves nothing.
    vacuous_ok: str | None = None
    #: Set to True if the ranks initialise their parameter shards independently (each draws
    #: its own slice, so no seed can make them the reference's): the reference's initial
    #: values are then copied into every rank's shard (``parameter_shards``) before the
    #: first step, and the report says so. Their initial values are then not checked.
    load_reference_shards: bool = False
    #: Set to True if the ranks cannot draw the reference's initial values at all: a shard
    #: drawn at the shard's shape consumes fewer random numbers than the reference's whole
    #: parameter, so every parameter drawn after it differs too (makani at h = 2). The
    #: reference's initial values are then copied into every parameter, whole or sharded
    #: (``parameter_shards``, DTensor placements), before the first step, and the report
    #: says so. Initial values are then not checked; everything after them is.
    load_reference_init: bool = False
    #: How many axes the case's process grid has (``Topology.mesh``): 1 for a split along
    #: one dimension (bands, cell ranges), 2 for lat x lon blocks. ``check_layouts`` hands
    #: the case every grid of that many factors of the spatial group.
    mesh_dims: int = 1
    #: Roll the model out this many steps with ``predict`` (inference) in every check, as
    #: ``check_equivalence(..., rollout=N)`` does (``harness.rollout``). ``None``: no rollout.
    rollout_steps: int | None = None
    #: Run the check under ``torch.autocast`` at this dtype (``torch.bfloat16``), as
    #: ``check_equivalence(..., autocast=...)`` does (``harness.equivalence._autocast``). ``None``:
    #: off.
    autocast: torch.dtype | None = None

    def build(self, topo: Topology) -> torch.nn.Module:
        raise NotImplementedError

    def batch(self, topo: Topology, step: int) -> Any:
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        raise NotImplementedError

    def predict(self, model: torch.nn.Module, batch: Any, topo: Topology, steps: int) -> Any:
        """An autoregressive rollout of ``steps`` steps from ``batch`` (step 0's): a list with
        one ``{name: Shard | tensor}`` dict per step, this rank's part of each field as in
        ``forward``. Run by rollout checks in eval mode under ``torch.no_grad()`` on the model
        as built, on the reference and on every rank (``harness.rollout``). It may ``yield``
        each step's dict instead: a failure then names the step it was computing."""
        raise no_predict(self)

    def block_variants(self, mesh: tuple[int, ...]) -> dict[str, SpatialCase]:
        """Uneven and empty blocks this case's partition allows on the process grid ``mesh``
        (``check_layouts`` runs each after the even layout of that grid): a name of
        ``harness.layouts.BLOCKS`` (``"uneven"``: blocks of different sizes; ``"empty-rank"``:
        a rank owning nothing) -> the case to run there. Each is this case with only how the
        partitioned run splits the domain changed (explicit band sizes, cell bounds): the
        same model and data, so the same reference (the sweep runs it once). Default: none,
        only the case's own blocks on each grid."""
        return {}

    def describe(self, topo: Topology | None = None) -> str:
        """A short description of the partition for reports (override to say more)."""
        return ""

    def parameter_shards(self, model: torch.nn.Module, topo: Topology) -> dict[str, Shard]:
        """The parameters this rank holds only a part of, each as a ``Shard`` of the
        reference's parameter: ``{name: Shard(param, index, dim)}``.

        ``name`` as in ``model.named_parameters()`` (a leading ``module.`` may be left out);
        ``index`` the global positions (a 1-D LongTensor or a ``slice``) along ``dim`` of the
        reference's parameter that the rank's values hold. ``values`` is the parameter
        itself: the harness records the parameter (after build, its gradient, after each
        step), so ``values`` only has to have its shape. Called after ``build``, on every rank
        and for the reference (whose parameters are whole: return ``{}`` there, or shards
        covering everything; the reference's are not read). Sharded parameters are compared
        with the reference's at their positions; the ranks of a spatial group must cover
        every position once (ranks holding the same positions hold copies, which must stay
        bitwise equal, as must the same shard in every data group). Default: nothing sharded.
        """
        return {}

    def partition(self, topo: Topology) -> Any:
        """How this rank's part of the domain is laid out: a ``LatLonPartition``, a
        ``CellPartition``, ``harness.Positions`` (one dimension), a list of them, or ``None``.

        Read on the ranks when a check locates its first divergence: a module's tensor whose
        dims are this rank's block of one of them (the last two dims for a lat x lon grid;
        the cells or positions at any dim; a block plus a halo) is compared with that block
        of the reference's, one of the global size with the whole. ``None`` (the default):
        only tensors of the reference's shape are compared.
        """
        return None

    def activation_shard(self, name: str, tensor: torch.Tensor, topo: Topology) -> Any:
        """Where a module's tensor on this rank sits in the reference's, when
        ``partition`` cannot say: a ``Shard`` (its values at global positions along one dim,
        or ``Shard.grid``), ``"whole"`` (replicated: the reference's tensor as is), ``"skip"``
        (not comparable, and not to be listed), or ``None`` (infer it from ``partition``).

        ``name`` is the module's qualified name (``model.named_modules()``); ``tensor`` one of
        its inputs, outputs or gradients on this rank.
        """
        return None

    def teardown(self, model: torch.nn.Module | None, topo: Topology) -> None:
        """Undo what ``build`` changed outside the model (patched libraries, module globals),
        after every run, on every rank and for the reference, even when the run failed
        (``model`` is ``None`` when ``build`` itself raised). Rank processes are reused by
        the next test: leave them as you found them. (RNG states, default dtype, grad mode,
        cwd and environment variables are restored by the harness already.)"""

    @property
    def label(self) -> str:
        return self.name or type(self).__name__


def no_predict(case: SpatialCase) -> ConfigError:
    """The error for a rollout of a case without ``predict``."""
    return ConfigError(
        f"{case.label} has no predict, so it cannot be rolled out (rollout=N or the case's "
        "rollout_steps asked for it); define predict(self, model, batch, topo, steps) on the "
        "case: roll the model out autoregressively from the batch and return one "
        "{name: Shard | tensor} dict per step"
    )


def data_share(n: int, topo: Topology) -> slice:
    """The samples ``[start, stop)`` of ``n`` that data group ``topo.data_rank`` gets.

    The rule the harness assumes when it compares the fields of several data groups with the
    reference's: contiguous, equal shares (``n`` must divide evenly).

    >>> data_share(4, Topology.single())
    slice(0, 4, None)
    """
    if n % topo.data_size:
        raise ConfigError(
            f"{n} samples do not split evenly over {topo.data_size} data groups; "
            f"use a batch size that is a multiple of {topo.data_size}"
        )
    k = n // topo.data_size
    return slice(topo.data_rank * k, (topo.data_rank + 1) * k)


def strip_module_prefix(name: str) -> str:
    return name[len("module.") :] if name.startswith("module.") else name


KEYED_FORM = (
    "Shard.keyed(values, keys): values with one item per row along dim 0, keys a 1-D "
    "integer tensor (one key per item) or a 2-D one (one key row per item)"
)


def _integer_index(where: str, raw: object) -> torch.Tensor:
    """``raw`` as a tensor of integer positions, or one clear error naming ``where``: a mask,
    a float index (which indexing would truncate) and a non-tensor are each refused. Shared
    by field shards and parameter shards."""
    try:
        index = torch.as_tensor(raw)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"{where} has an index of type {type(raw).__name__}; give a 1-D "
            "LongTensor of global positions, or a slice"
        ) from None
    if index.dtype == torch.bool:
        raise ConfigError(
            f"{where} has a bool index (a mask); give the positions themselves: "
            "mask.nonzero().flatten() (or torch.arange(n)[mask])"
        )
    if index.is_floating_point() or index.is_complex():
        raise ConfigError(
            f"{where} has a {str(index.dtype).replace('torch.', '')} index; positions must be "
            "integers (torch.long): a float index would be truncated, silently moving values"
        )
    return index


# ---------------------------------------------------------------------- sharded parameters


def parameter_shards(
    case: SpatialCase, model: torch.nn.Module, topo: Topology
) -> dict[str, ParamShard]:
    """``case.parameter_shards`` checked against the model and recorded as ``ParamShard``s.

    Anything that cannot be a shard of one of the model's parameters is one ``ConfigError``
    naming the parameter, the rank and the fix; whether the positions fit the reference's
    parameter is for the comparison to say (only it sees the reference).
    """
    given = case.parameter_shards(model, topo)
    where = f"{case.label}.parameter_shards {_whose(topo)}"
    if not isinstance(given, dict):
        raise ConfigError(
            f"{where} returned a {type(given).__name__}; return a dict "
            "{parameter name: Shard(param, index, dim)} ({} when nothing is sharded)"
        )
    params = {strip_module_prefix(n): p for n, p in model.named_parameters()}
    out: dict[str, ParamShard] = {}
    for key, shard in given.items():
        name = strip_module_prefix(key) if isinstance(key, str) else key
        if name not in params:
            close = difflib.get_close_matches(str(name), list(params), n=3)
            raise ConfigError(
                f"{where} names {key!r}, which is not a parameter of the model; name "
                "parameters as model.named_parameters() does"
                + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
            )
        out[name] = _param_shard(f"{where}: parameter {name!r}", params[name], shard)
    for name, param in params.items():
        at = block(param) if name not in out and is_distributed(param) else None
        if at is not None and at[0] is not None:  # a DTensor's shard: its placements say where
            dim, start, size = int(at[0]), at[1], at[2]
            index = torch.arange(start, start + size)
            out[name] = ParamShard(index, dim, describe(param))
    return out


def _whose(topo: Topology) -> str:
    return "for the reference" if topo.is_reference else f"on rank {topo.rank}"


def _param_shard(where: str, param: torch.Tensor, shard: object) -> ParamShard:
    """One parameter's ``Shard`` as its positions along a non-negative dim, or an error."""
    if not isinstance(shard, Shard):
        raise ConfigError(
            f"{where} is given as a {type(shard).__name__}; give Shard(param, index, dim): "
            "the global positions along dim of the reference's parameter that it holds"
        )
    # a DTensor parameter's shape is the global one: its positions are of its local values
    local = plain(param)
    if tuple(shard.values.shape) not in (tuple(param.shape), tuple(local.shape)):
        raise ConfigError(
            f"{where}: Shard.values has shape {tuple(shard.values.shape)} but the parameter "
            f"is {tuple(param.shape)}; give the parameter itself, Shard(param, index, dim) "
            "(the harness records the parameter's own values)"
        )
    param = local
    ndim = param.dim()
    dim = shard.dim + ndim if shard.dim < 0 else shard.dim
    if not 0 <= dim < ndim:
        raise ConfigError(
            f"{where}: dim={shard.dim} but the parameter has {ndim} dimension(s) "
            f"(shape {tuple(param.shape)}); give the dim along which it is sharded"
        )
    n = int(param.shape[dim])
    if isinstance(shard.index, slice):
        index = _slice_positions(where, shard.index, n, dim)
    else:
        index = _integer_index(where, shard.index)
        if index.dim() > 1 or index.numel() != n:
            raise ConfigError(
                f"{where} has {index.numel()} positions in an index of shape "
                f"{tuple(index.shape)}, but the parameter has {n} values along dim {dim} "
                f"(shape {tuple(param.shape)}); give one global position per value"
            )
        index = index.detach().to("cpu", torch.long).reshape(-1)
    if index.numel() and int(index.min()) < 0:
        raise ConfigError(
            f"{where} has a negative position ({int(index.min())}); positions are global "
            "positions in the reference's parameter and count from 0"
        )
    if int(torch.unique(index).numel()) != index.numel():
        raise ConfigError(
            f"{where} repeats a position in its index; each value holds a position of its own"
        )
    return ParamShard(index.clone(), dim)


def _slice_positions(where: str, index: slice, n: int, dim: int) -> torch.Tensor:
    """A slice's positions for ``n`` local values: no global length is needed, so the start
    must be given as a position (>= 0) and the step positive."""
    start, step = index.start or 0, index.step or 1
    if start < 0 or step < 1:
        raise ConfigError(
            f"{where} has index {index}; give a slice with a non-negative start and a "
            "positive step (global positions), or a LongTensor"
        )
    positions = start + step * torch.arange(n)
    if index.stop is not None and len(range(start, index.stop, step)) != n:
        raise ConfigError(
            f"{where} has index {index}, {len(range(start, index.stop, step))} positions, but "
            f"the parameter has {n} values along dim {dim}; give one position per value"
        )
    return positions


def load_shards(
    case: SpatialCase,
    model: torch.nn.Module,
    topo: Topology,
    shards: dict[str, ParamShard],
    reference_init: dict[str, torch.Tensor],
) -> list[str]:
    """Copy the reference's initial values into each parameter shard (the case's
    ``load_reference_shards``); the names loaded."""
    where = f"{case.label}.load_reference_shards {_whose(topo)}"
    if not shards:
        raise ConfigError(
            f"{where}: parameter_shards returned no shards, so there is nothing to load; "
            "name the sharded parameters in parameter_shards, or drop load_reference_shards"
        )
    params = {strip_module_prefix(n): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, shard in shards.items():
            _load_shard(where, name, params[name], shard, reference_init.get(name))
    return sorted(shards)


def load_init(
    case: SpatialCase,
    model: torch.nn.Module,
    topo: Topology,
    shards: dict[str, ParamShard],
    reference_init: dict[str, torch.Tensor],
) -> list[str]:
    """Copy the reference's initial values into every parameter, whole or sharded (the
    case's ``load_reference_init``); the names loaded."""
    where = f"{case.label}.load_reference_init {_whose(topo)}"
    params = {strip_module_prefix(n): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in params.items():
            ref = reference_init.get(name)
            if name in shards:
                _load_shard(where, name, param, shards[name], ref)
                continue
            local = plain(param)
            if is_distributed(param) and block(param) is None:
                raise ConfigError(
                    f"{where}: parameter {name!r} is a {describe(param)} whose placements do "
                    "not say which of the reference's values this rank holds; name its "
                    "positions in parameter_shards, or load it in build"
                )
            if ref is None or tuple(ref.shape) != tuple(local.shape):
                what = "no such parameter" if ref is None else f"shape {tuple(ref.shape)}"
                raise ConfigError(
                    f"{where}: parameter {name!r} (shape {tuple(local.shape)}) does not fit the "
                    f"reference's ({what}); a parameter this rank holds only part of must be "
                    "named in parameter_shards"
                )
            local.copy_(ref)
    return sorted(params)


def _load_shard(
    where: str, name: str, param: torch.Tensor, shard: ParamShard, ref: torch.Tensor | None
) -> None:
    """The reference's values at ``shard``'s positions, copied into ``param``'s (local)
    values; a shard that does not fit them is one error naming it."""
    local = plain(param)  # a DTensor's local values: copied into in place
    expected = list(local.shape)
    if ref is not None and ref.dim() == local.dim():
        expected[shard.dim] = int(ref.shape[shard.dim])
    fits = (
        ref is not None
        and list(ref.shape) == expected
        and (not shard.index.numel() or int(shard.index.max()) < ref.shape[shard.dim])
    )
    if not fits:
        what = "no such parameter" if ref is None else f"shape {tuple(ref.shape)}"
        raise ConfigError(
            f"{where}: the shard of {name!r} ({shard.text()}, "
            f"shape {tuple(local.shape)}) does not fit the reference's parameter "
            f"({what}); its other dims must match and its positions lie inside"
        )
    local.copy_(ref.index_select(shard.dim, shard.index))  # type: ignore[union-attr]
