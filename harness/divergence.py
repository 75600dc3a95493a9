"""Where a partitioned run first departs from its reference: the pure rule.

``harness._locate`` reruns one step of the reference (twice: once as is, once nudged at its
dtype's rounding level) and of every rank with hooks on every module, and hands the three
kinds of ``Trace`` to ``first_divergence``. Nothing here runs on a rank or touches a process
group, so the rule is tested on hand-made traces.

The rule, in the reference's execution order:

- forward: the first module call whose *output* departs while its inputs matched is where the
  bug lives (``forward of 'blocks.2.mixer'``); if a call's *input* departs first, the code
  between the modules did it: the enclosing module's own forward (outside its submodules), or
  the batch when the model's own input departs; then the loss, computed outside the model;
- backward: the first module call whose gradient *into its inputs* departs while the gradient
  *at its output* matched (``backward of 'decoder'``); a gradient at an output that departs
  first was made by the code that consumed it (the enclosing module, or the loss); a
  parameter's gradient is judged where it is complete (accumulated, and its module's
  backward over), and one that departs with every activation gradient matching is its
  synchronisation (``gradient synchronisation of 'decoder.weight'``); a module call no
  rank made (the ranks use its parameters in a functional call) is skipped and listed;
- then the fields as the case reported them (a shard at the wrong positions).

"Departs" is measured, not guessed: each quantity's noise floor is how far the nudged
reference moved it (at least a few units of rounding of its magnitude); a quantity departs
when a rank is more than ``DEPART`` times its floor away from the reference.

A rank's tensor is placed in the reference's without annotations for the layouts a case's
``partition(topo)`` names: dims of the reference's size are replicated; a dim of the rank's
block of a ``LatLonPartition`` (the last two dims), of its cells of a ``CellPartition`` or of
its ``Positions`` is that block; a block plus a halo of ``k`` on each side is recognised; the
samples of a data group are its share of dim 0. Tensors that cannot be placed are listed as
not compared, never taken as matching.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from harness._values import is_distributed, plain
from harness.partition import CellPartition, LatLonPartition

#: a quantity departs when a rank is this many times its noise floor away from the reference.
#: Measured: on the catalogue's correct layouts and the guide-style model (float64) every
#: matching quantity sat below 0.5x its floor, and the false-alarm sweep's drawn layouts
#: (float32 too) below 1000x; the catalogue's bugs sat at 1e12x and more. 1000 leaves room
#: for ill-conditioned modules and still locates any bug above ~1e-12 relative in float64.
DEPART = 1000.0
#: the smallest floor: this many units of rounding of the quantity's largest magnitude (a
#: quantity the nudge cannot move, like a module on the raw batch, still rounds differently
#: when the ranks sum in another order)
MIN_ULPS = 8.0

# ---------------------------------------------------------------------- the case's layouts


@dataclass(frozen=True)
class Positions:
    """This rank's positions ``index`` along one dimension of global length ``size``.

    For a case split along one dimension (positions of a line, rows of a mesh): return it
    from ``SpatialCase.partition(topo)``. ``unit`` names a position in reports.

    >>> Positions(37, range(10, 19)).positions().tolist()[:3]
    [10, 11, 12]
    """

    size: int
    index: range | slice | Sequence[int] | torch.Tensor  # 1-D LongTensor: global positions
    unit: str = "position"

    def positions(self) -> torch.Tensor:
        if isinstance(self.index, slice):
            return torch.arange(self.size)[self.index]
        return torch.as_tensor(list(self.index) if isinstance(self.index, range) else self.index)


@dataclass(frozen=True)
class Axis:
    """One partitioned dimension as seen by one rank: the global ``size``, the rank's global
    ``positions`` (ascending), the unit for reports, and the dim it must be (``-2`` for
    latitudes, ``-1`` for longitudes; ``None``: any dim of that size)."""

    size: int
    positions: torch.Tensor
    unit: str
    dim: int | None = None
    #: which of the case's partitions it comes from: a tensor's dims are named by one
    #: partition where it can (a spectral (l, m) tensor is not half lat, half m)
    group: int = 0


def axes_of(partition: object, spatial_rank: int) -> list[Axis]:
    """The partitioned dimensions that ``partition`` (one of a case's) gives this rank, each
    named by the partition's own axis names (``LatLonPartition.axes``, ``Positions.unit``).

    >>> [a.unit for a in axes_of(LatLonPartition(4, 8, 2, 1), 1)]
    ['lat', 'lon']
    >>> [a.unit for a in axes_of(LatLonPartition(4, 5, 2, 1, axes=("l", "m")), 1)]
    ['l', 'm']
    """
    if isinstance(partition, (list, tuple)):
        out = []
        for group, p in enumerate(partition):
            out += [replace(a, group=group) for a in _axes_of(p, spatial_rank)]
        return out
    return _axes_of(partition, spatial_rank)


def _axes_of(partition: object, spatial_rank: int) -> list[Axis]:
    if partition is None:
        return []
    if isinstance(partition, (list, tuple)):  # nested lists: one group
        return [a for p in partition for a in _axes_of(p, spatial_rank)]
    if isinstance(partition, LatLonPartition):
        rows, cols = partition.slices(spatial_rank)
        lat, lon = partition.axes
        return [
            Axis(partition.nlat, torch.arange(rows.start, rows.stop), lat, -2),
            Axis(partition.nlon, torch.arange(cols.start, cols.stop), lon, -1),
        ]
    if isinstance(partition, CellPartition):
        cells = partition.cells(spatial_rank)
        return [Axis(partition.npix, torch.arange(cells.start, cells.stop), "cell")]
    if isinstance(partition, Positions):
        return [Axis(partition.size, partition.positions().long(), partition.unit)]
    raise TypeError(
        f"SpatialCase.partition returned a {type(partition).__name__}; return a "
        "LatLonPartition, a CellPartition, harness.Positions, a list of them, or None"
    )


@dataclass(frozen=True)
class Placement:
    """Where a rank's tensor sits in the reference's: per dim, ``None`` (the whole dim) or
    the global position of each local index (``-1``: a halo position outside the globe,
    not compared). ``flatten``: the reference's last two dims are flattened first (a
    ``Shard.grid`` the case gave)."""

    index: tuple[torch.Tensor | None, ...]
    units: tuple[str, ...]
    flatten: tuple[int, int] | None = None


def place(
    local: Sequence[int],
    ref: Sequence[int],
    axes: Sequence[Axis],
    data: tuple[int, int] = (0, 1),
) -> Placement | None:
    """How a rank's tensor of shape ``local`` sits in the reference's of shape ``ref``, or
    ``None`` when nothing the case declared explains it.

    ``data`` is (data rank, data size): with several data groups dim 0 may be the group's
    share of the samples.

    >>> lat = Axis(4, torch.arange(2, 4), "lat", -2)
    >>> p = place((3, 2, 8), (3, 4, 8), [lat])
    >>> [None if i is None else i.tolist() for i in p.index]
    [None, [2, 3], None]
    >>> place((3, 5, 8), (3, 4, 8), [lat]) is None   # 5 rows: not a block of 4 nor a halo
    True
    >>> [i.tolist() for i in place((4, 8), (4, 8), [lat]).index if i is not None]   # whole
    []
    >>> place((4, 8), (4, 8, 1), [lat]) is None
    True
    """
    if len(local) != len(ref):
        return None
    axes = _by_fit(local, ref, axes)
    ndim, used = len(ref), set()
    index: list[torch.Tensor | None] = []
    units: list[str] = []
    for i, (n_local, n_ref) in enumerate(zip(local, ref)):
        if n_local == n_ref:  # the whole dim (a partitioned one all on this rank, too)
            index.append(None)
            whole = [a.unit for a in axes if a.dim in (None, i - ndim) and a.size == n_ref]
            units.append(whole[0] if whole else "")
            continue
        found = None
        if i == 0 and data[1] > 1 and n_ref == n_local * data[1]:
            found = torch.arange(data[0] * n_local, (data[0] + 1) * n_local), "sample"
        for k, axis in enumerate(axes):
            if found is not None:
                break
            if k in used or (axis.dim is not None and axis.dim != i - ndim):
                continue
            hit = _along(axis, n_local, n_ref)
            if hit is not None:
                used.add(k)
                found = hit, axis.unit
        if found is None:
            return None
        index.append(found[0])
        units.append(found[1])
    return Placement(tuple(index), tuple(units))


def _by_fit(local: Sequence[int], ref: Sequence[int], axes: Sequence[Axis]) -> list[Axis]:
    """The axes, those of the partition that explains most of this tensor's dims first (a
    tensor of (l, m) modes whose l count is the grid's latitude count is named l, m)."""
    ndim = len(ref)

    def fits(axis: Axis, i: int) -> bool:
        if axis.dim is not None and axis.dim != i - ndim:
            return False
        if local[i] == ref[i]:
            return axis.size == ref[i]
        return _along(axis, local[i], ref[i]) is not None

    score: dict[int, int] = {}
    for a in axes:
        score.setdefault(a.group, 0)
    for g in score:
        score[g] = sum(any(a.group == g and fits(a, i) for a in axes) for i in range(ndim))
    order = sorted(score, key=lambda g: -score[g])  # stable: the case's order on a tie
    return sorted(axes, key=lambda a: order.index(a.group))


def _along(axis: Axis, n_local: int, n_ref: int) -> torch.Tensor | None:
    """The global positions of ``n_local`` entries along ``axis``: its block, or its block
    with a halo of ``k`` each side (positions off the globe are ``-1``; a reference padded
    by the same ``k`` is indexed in its padded coordinates)."""
    own = axis.positions
    if n_ref == axis.size and n_local == len(own):
        return own
    extra = n_local - len(own)
    if extra <= 0 or extra % 2 or len(own) == 0:
        return None
    if not bool((own[1:] - own[:-1] == 1).all()):  # a halo is recognised on contiguous blocks
        return None
    k = extra // 2
    start = int(own[0])
    if n_ref == axis.size:
        pos = torch.arange(start - k, start + len(own) + k)
        return torch.where((pos >= 0) & (pos < axis.size), pos, -1)
    if n_ref == axis.size + extra:  # the reference pads too: the window of its padded tensor
        return torch.arange(start, start + n_local)
    return None


def shard_placement(
    index: torch.Tensor, dim: int, ndim: int, grid: tuple[int, int] | None
) -> Placement:
    """A ``Shard`` the case gave for a tensor: positions along one dim."""
    dim = dim % ndim
    units = tuple("position" if d == dim else "" for d in range(ndim))
    return Placement(tuple(index.long() if d == dim else None for d in range(ndim)), units, grid)


# ---------------------------------------------------------------------- traces


@dataclass
class Event:
    """One recorded quantity of one module call (or the loss, a parameter gradient, a field).

    ``key`` matches it across the reference, the nudged reference and the ranks:
    ``(module, call, kind, slot)``. ``parent`` is the module call whose forward encloses this
    one (``None``: called from outside the model), ``through`` is set when the call's output
    is its parent's output too (a ``Sequential``'s last module), ``placement`` is what the
    case said for it (``"whole"``, ``"skip"``, a ``Placement``) or ``None`` (infer it).
    """

    module: str
    type: str
    call: int
    kind: str
    slot: str
    tensor: torch.Tensor | None
    parent: tuple[str, int] | None = None
    through: bool = False
    placement: Placement | str | None = None

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.module, self.call, self.kind, self.slot)

    @property
    def phase(self) -> str:
        if self.kind in ("input", "output", "loss"):
            return "forward"
        return "field" if self.kind == "field" else "backward"


@dataclass
class Trace:
    """One run's events of one step, in execution order, and where the rank sat."""

    step: int
    events: list[Event] = field(default_factory=list)
    spatial_rank: int = 0
    data_rank: int = 0
    data_size: int = 1
    axes: list[Axis] = field(default_factory=list)
    #: True when backward hooks were left out (the model broke under them)
    forward_only: bool = False
    problem: str = ""


# ---------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Divergence:
    """Where the partitioned run first departs from the reference.

    ``direction`` is ``"forward"``, ``"backward"`` or ``"field"``. ``module`` is the module's
    qualified name as in ``model.named_modules()`` (``""``: the model itself), or ``None``
    when the departure is outside every module: then ``name`` says what (``"loss"``, the
    batch, a field). ``quantity`` is what departed (``"output"``, ``"grad_input"``,
    ``"grad 'decoder.weight'"``, ...); ``multiple`` is its error over its noise floor.

    ``cause`` is what the evidence blames when it is not the module's own code:
    ``"synchronisation"`` for a parameter's gradient that departs with every activation
    gradient matching (``module`` is then the module owning the parameter, whose own
    gradients match: context, not the culprit; ``name`` is the parameter), ``"absent"`` for a
    module call some ranks never made. ``zero``: the reference is exactly zero there, so the
    error is an absolute one (``max_rel`` is it over the check's absolute term).
    """

    direction: str
    module: str | None
    module_type: str
    quantity: str
    step: int
    rank: int
    max_abs: float
    max_rel: float
    where: str
    noise: float
    multiple: float
    dtype: str
    call: int = 0
    calls: int = 1
    upstream_rel: float | None = None  # worst relative error of what it consumed
    name: str = ""
    cause: str = ""
    zero: bool = False

    @property
    def located(self) -> str:
        """``"forward of 'blocks.2.mixer' (GlobalMean)"``, ``"field 'out'"``, ``"loss"``,
        ``"gradient synchronisation of 'decoder.weight'"``."""
        if self.cause == "synchronisation":
            return f"gradient synchronisation of {self.name!r}"
        if self.module is None:
            if self.direction == "field":
                return f"field {self.name!r}"
            return f"{self.direction} of {self.name}"
        return f"{self.direction} of {self.module!r} ({self.module_type})"

    def line(self) -> str:
        """The report's line: ``First divergence: forward of 'x' (T), step 0: ...``."""
        call = f" (call {self.call + 1} of {self.calls})" if self.calls > 1 else ""
        if self.cause == "synchronisation":
            owner = f"{self.module!r} ({self.module_type})" if self.module is not None else "?"
            return (
                f"First divergence: {self.located} (backward, owner {owner}), step {self.step}: "
                f"the gradient of {self.name!r} departs with every activation gradient "
                f"matching: its synchronisation; {self._size()}"
            )
        head = f"First divergence: {self.located}{call}, step {self.step}: "
        if self.cause == "absent":
            return head + (
                f"{_what(self.quantity)} never computed on rank {self.rank}, "
                "where the reference (and other ranks) computed it"
            )
        if self.upstream_rel is not None and self.quantity in _UPSTREAM:
            head += f"{_UPSTREAM[self.quantity]} (max rel {self.upstream_rel:.0e}), "
        return head + f"{_what(self.quantity)} {self._size()}"

    def _size(self) -> str:
        """``max rel 0.5 at [lat 3] on rank 1 (1e+14x its float64 noise)``."""
        if math.isinf(self.max_abs) and not self.dtype.startswith(("float", "complex")):
            text = "values differ"  # integers or booleans: equal or not
        elif math.isinf(self.max_abs):
            text = "a NaN or inf where the reference differs"
        elif self.zero:
            text = f"max abs {self.max_abs:.2g} where the reference is exactly zero"
        else:
            text = f"max rel {self.max_rel:.2g}"
        if self.where:
            text += f" at {self.where}"
        if math.isinf(self.multiple):
            return text + f" on rank {self.rank} ({self.dtype})"
        return text + f" on rank {self.rank} ({_times(self.multiple)} its {self.dtype} noise)"


_UPSTREAM = {
    "output": "inputs match",
    "grad_input": "gradient at its output matches",
}


def _what(quantity: str) -> str:
    """What departed, in words: ``"grad_output of 'enc'"`` -> the gradient at its output."""
    kind, _, of = quantity.partition(" of ")
    if kind == "grad_output":
        return f"gradient at the output of {of}" if of else "gradient at its output"
    if kind == "grad_input":
        return "gradient into its inputs"
    if kind == "input" and of:
        return f"input of {of}"
    if quantity.startswith("field"):
        return "values"
    return quantity


def _times(x: float) -> str:
    return "inf x" if math.isinf(x) else f"{x:.0f}x" if x < 1e4 else f"{x:.0e}x"


@dataclass
class Location:
    """What locating found: the first divergence (or ``None``), what could not be compared,
    and the dtypes of the activations seen on the ranks (float32 in a float64 run is
    evidence for a precision hint)."""

    first: Divergence | None = None
    compared: int = 0
    not_compared: dict[str, list[str]] = field(default_factory=dict)  # module -> shapes
    dtypes: tuple[str, ...] = ()
    #: the dtypes of the ranks' tensors compared up to and including the first divergence
    #: (all of them when nothing departs): a float32 one is evidence of float32 on the path
    path_dtypes: tuple[str, ...] = ()
    step: int = 0
    seconds: float = 0.0
    problem: str = ""  # why nothing could be located (the rerun failed)
    forward_only: bool = False
    worst_multiple: float = 0.0  # the largest multiple of a matching quantity
    calibration: dict[str, Calibration] = field(default_factory=dict)
    #: module calls of the reference that no rank made ("'conv' (Conv2d)"): skipped
    not_run: list[str] = field(default_factory=list)
    #: values locating cannot read (a tensor subclass it cannot convert): module -> what
    unreadable: dict[str, list[str]] = field(default_factory=dict)

    def calibration_lines(self, rtols: dict[str, float] | None = None) -> list[str]:
        """Per quantity: the rounding noise measured, the error seen, the rtol they support
        (``--spatial-calibrate``); ``rtols``: the check's, to compare with."""
        out = []
        for quantity in ("loss", "grad", "field"):
            cal = self.calibration.get(quantity)
            if cal is None or not cal.compared:
                continue
            now = f" (now {rtols[quantity]:g})" if rtols and quantity in rtols else ""
            out.append(
                f"{quantity}: rounding noise {cal.noise:.1e}, partitioned run {cal.error:.1e} "
                f"(relative to the largest value) -> supports rtol {cal.supports():.0e}{now}"
            )
        return out

    def lines(self) -> list[str]:
        out = []
        if self.first is not None:
            out.append(self.first.line())
        elif self.problem:
            out.append(f"First divergence: not located: {self.problem}")
        if self.not_compared:
            names = list(self.not_compared)
            shown = ", ".join(f"{n!r} {' '.join(self.not_compared[n][:2])}" for n in names[:4])
            more = f", and {len(names) - 4} more" if len(names) > 4 else ""
            out.append(
                f"Not compared (no layout the case declares fits; "
                f"SpatialCase.activation_shard can say): {len(names)} module"
                f"{'' if len(names) == 1 else 's'}: {shown}{more}"
            )
        if self.not_run:
            more = f", and {len(self.not_run) - 4} more" if len(self.not_run) > 4 else ""
            out.append(
                "Not compared (called in the reference, on no rank: the ranks compute it "
                "another way, e.g. a functional call with the module's parameters): "
                f"{', '.join(self.not_run[:4])}{more}"
            )
        if self.unreadable:
            names = list(self.unreadable)
            shown = ", ".join(f"{n!r} {'; '.join(self.unreadable[n][:1])}" for n in names[:3])
            more = f", and {len(names) - 3} more" if len(names) > 3 else ""
            out.append(
                "Not compared (values locating cannot read; return plain tensors, or "
                f"SpatialCase.activation_shard a Shard of them): {shown}{more}"
            )
        return out


@dataclass
class _Verdict:
    rank: int
    max_abs: float
    max_rel: float
    noise: float
    multiple: float
    where: str
    dtype: str
    scale: float = 0.0  # the reference's largest magnitude there
    zero: bool = False  # the reference is exactly zero: max_rel is over the absolute term
    absent: bool = False  # the rank never computed it


@dataclass
class Calibration:
    """One quantity's measured rounding noise and the partitioned run's error, both
    relative to the reference's largest magnitude, over every tensor of it compared."""

    noise: float = 0.0
    error: float = 0.0
    compared: int = 0

    def supports(self) -> float:
        """The smallest rtol that holds the errors seen with a 10x margin (and never below
        10x the noise: a rerun with other rounding must pass too)."""
        return 10 * max(self.error, self.noise)


#: which quantity of a check's Tolerance each kind of event calibrates
_CALIBRATES = {"loss": "loss", "param_grad": "grad", "field": "field"}


def first_divergence(
    reference: Trace,
    nudged: Trace | None,
    ranks: Sequence[Trace],
    *,
    depart: float = DEPART,
) -> Location:
    """Walk the reference's events in order; the first that departs on some rank, judged
    by the rule of this module's docstring.

    A parameter's gradient that departs is held while the rest of the backward is judged:
    a parameter's gradient feeds no activation gradient, so if one departs later it is the
    module bug (and may explain the parameter's); if none does, the parameter's gradient
    departs with every activation gradient matching, and its synchronisation is blamed.
    A module call that no rank made (the ranks compute it another way, e.g. a functional
    call with the module's parameters) is skipped and listed, never taken as departing.
    """
    out = Location(step=reference.step, forward_only=any(t.forward_only for t in ranks))
    noisy = {e.key: e for e in nudged.events} if nudged is not None else {}
    by_rank = [{e.key: e for e in t.events} for t in ranks]
    _mean_loss_over_data_groups(ranks, by_rank)
    calls, types, parents = _call_graph(reference)
    out.dtypes = _activation_dtypes(ranks)
    skipped = _not_run(reference, ranks, types, out)
    upstream: dict[tuple[str, int], float] = {}  # worst rel of a call's inputs / grad_outputs
    path: dict[str, None] = {}
    held: tuple[Event, _Verdict] | None = None  # a parameter's gradient that departed
    activation_grads = 0  # activation gradients compared: the evidence that they matched
    for e in reference.events:
        if e.tensor is None or ((e.module, e.call) in skipped and e.kind not in _OUTSIDE):
            continue
        if held is not None and e.kind not in ("grad_output", "grad_input"):
            continue  # after a parameter's departure: only the activation gradients count
        verdicts = _verdicts(e, noisy.get(e.key), ranks, by_rank, out)
        if not verdicts:
            continue
        for v in verdicts:
            path[v.dtype] = None
        _calibrate(out, e, verdicts)
        out.compared += 1
        activation_grads += e.kind in ("grad_output", "grad_input")
        worst = max(verdicts, key=lambda v: v.multiple)
        if worst.multiple <= depart:
            out.worst_multiple = max(out.worst_multiple, worst.multiple)
            if e.kind in ("input", "grad_output"):
                call = (e.module, e.call)
                upstream[call] = max(upstream.get(call, 0.0), worst.max_rel)
            continue
        if e.kind == "param_grad" and held is None and not out.forward_only:
            held = (e, worst)
            continue
        out.first = _divergence(e, worst, reference.step, calls, types, parents, upstream)
        break
    if out.first is None and held is not None:
        out.first = _divergence(*held, reference.step, calls, types, parents, upstream)
        if activation_grads:  # they were compared, and matched: only the sync is left
            out.first = replace(out.first, cause="synchronisation", name=held[0].slot)
    out.not_compared = {label: sorted(set(v)) for label, v in out.not_compared.items()}
    out.path_dtypes = tuple(d for d in path if d != "-")
    return out


#: kinds recorded outside any module call (their module name is the model's, ``""``)
_OUTSIDE = ("loss", "field", "param_grad")

#: (module, call) -> (the enclosing call, whether this call's output is that call's too)
_Parents = dict[tuple[str, int], tuple[tuple[str, int] | None, bool]]


def _call_graph(reference: Trace) -> tuple[dict[str, int], dict[str, str], _Parents]:
    """From the reference's events: each module's number of calls, its type, and each
    call's parent."""
    calls: dict[str, int] = {}
    types: dict[str, str] = {}
    parents: _Parents = {}
    for e in reference.events:
        if e.kind in ("input", "output"):
            calls[e.module] = max(calls.get(e.module, 0), e.call + 1)
            types[e.module] = e.type
            parents[(e.module, e.call)] = (e.parent, e.through)
    return calls, types, parents


def _activation_dtypes(ranks: Sequence[Trace]) -> tuple[str, ...]:
    """The dtypes the ranks' module inputs and outputs were in, in order of appearance."""
    dtypes: dict[str, None] = {}
    for t in ranks:
        for e in t.events:
            if e.tensor is not None and e.kind in ("input", "output"):
                dtypes[str(e.tensor.dtype).replace("torch.", "")] = None
    return tuple(dtypes)


def _not_run(
    reference: Trace, ranks: Sequence[Trace], types: dict[str, str], out: Location
) -> set[tuple[str, int]]:
    """Module calls that no rank made (the ranks compute them without calling the module),
    each module listed once in ``out.not_run``."""
    made = {(e.module, e.call) for t in ranks for e in t.events if e.kind == "output"}
    skipped = {
        (e.module, e.call)
        for e in reference.events
        if e.kind == "output" and ranks and (e.module, e.call) not in made
    }
    for module, _ in sorted(skipped):
        label = f"{module!r} ({types.get(module, '')})"
        if label not in out.not_run:
            out.not_run.append(label)
    return skipped


def _calibrate(out: Location, e: Event, verdicts: list[_Verdict]) -> None:
    """Note the noise and the error of a quantity a check's Tolerance calibrates."""
    if e.kind not in _CALIBRATES:
        return
    cal = out.calibration.setdefault(_CALIBRATES[e.kind], Calibration())
    cal.compared += 1
    for v in verdicts:
        if v.scale > 0 and math.isfinite(v.max_abs):
            cal.noise = max(cal.noise, v.noise / v.scale)
            cal.error = max(cal.error, v.max_abs / v.scale)


def _verdicts(
    e: Event,
    nudged: Event | None,
    ranks: Sequence[Trace],
    by_rank: list[dict[tuple[str, int, str, str], Event]],
    out: Location,
) -> list[_Verdict]:
    """Each rank's verdict on one quantity, in the reading that fits best (``[]``: not
    compared). What cannot be judged (a value locating cannot read) is listed in ``out``."""
    verdicts: list[_Verdict] = []
    try:
        ways = _readings(e, ranks, by_rank)
    except Exception:  # noqa: BLE001 - values that cannot be summed: read as they are
        ways = [{}]
    for k, readings in enumerate(ways):
        found = []
        for r, (trace, events) in enumerate(zip(ranks, by_rank)):
            if e.kind in ("grad_output", "grad_input") and trace.forward_only:
                continue
            mine = readings.get(r, events.get(e.key))
            if mine is _JUDGED_BY_GROUP:
                continue
            label = e.module if e.kind != "field" else f"field {e.slot}"
            try:
                v = _judge(e, nudged, mine, trace, r)
            except Exception as exc:  # noqa: BLE001 - a diagnosis never takes a verdict down
                if k == 0:
                    what = f"{e.kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                    out.unreadable.setdefault(label, []).append(what)
                continue
            if v is None:
                if k == 0 and mine is not None and mine.placement != "skip":
                    if mine.tensor is not None and not _plain_type(mine.tensor):
                        kind = type(mine.tensor).__name__
                        out.unreadable.setdefault(label, []).append(f"{e.kind}: a {kind}")
                        continue
                    shape = tuple(mine.tensor.shape) if mine.tensor is not None else ""
                    out.not_compared.setdefault(label, []).append(f"{e.kind} {shape}")
                continue
            found.append(v)
        if found and (not verdicts or _worst(found) < _worst(verdicts)):
            verdicts = found
    return verdicts


def _plain_type(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


_JUDGED_BY_GROUP = Event("", "", 0, "", "", None)


def _worst(verdicts: list[_Verdict]) -> float:
    return max(v.multiple for v in verdicts)


def _readings(
    e: Event, ranks: Sequence[Trace], by_rank: list[dict[tuple[str, int, str, str], Event]]
) -> list[dict[int, Event]]:
    """The ways a quantity replicated over ranks may be read; the best is judged.

    As is (every rank holds the reference's value); for a gradient, the sum over the
    spatial group (each rank back-propagates its own part of the loss, ``reduce_loss``
    having an identity backward, so upstream of it the ranks' gradients of a replicated
    activation are parts of the reference's; downstream of it, the loss's own gradient is
    whole on every rank); with data groups, a forward value's mean over the groups (a
    group's loss is the mean over its own samples).
    """
    out: list[dict[int, Event]] = [{}]
    if e.tensor is None:
        return out
    if e.kind in ("grad_output", "grad_input"):
        summed = _replicated_gradients(e, ranks, by_rank)
        if summed:
            out.append(summed)
    elif e.kind in ("input", "output") and any(t.data_size > 1 for t in ranks):
        mine = [ev.get(e.key) for ev in by_rank]
        tensors = [m.tensor for m in mine if m is not None and m.tensor is not None]
        floating = e.tensor.is_floating_point() or e.tensor.is_complex()  # not indexes
        if (
            floating
            and len(tensors) == len(ranks)
            and all(x.shape == e.tensor.shape for x in tensors)
        ):
            m0 = mine[0]
            assert m0 is not None
            mean = torch.stack(tensors).mean(0).to(e.tensor.dtype)
            out.append({0: Event(m0.module, m0.type, m0.call, m0.kind, m0.slot, mean)})
            out[-1].update({r: _JUDGED_BY_GROUP for r in range(1, len(ranks))})
    return out


def _replicated_gradients(
    e: Event, ranks: Sequence[Trace], by_rank: list[dict[tuple[str, int, str, str], Event]]
) -> dict[int, Event]:
    """The gradient of a tensor replicated over a spatial group, summed over the group:
    per spatial group, the sum in place of its first rank's event and a marker for the
    others; nothing for tensors that are not replicated."""
    if e.tensor is None:
        return {}
    out: dict[int, Event] = {}
    groups: dict[int, list[int]] = {}
    for r, t in enumerate(ranks):
        groups.setdefault(t.data_rank, []).append(r)
    for members in groups.values():
        if len(members) < 2:
            continue
        mine = [by_rank[r].get(e.key) for r in members]
        tensors = [m.tensor for m in mine if m is not None and m.placement is None]
        if len(tensors) != len(members) or any(x is None for x in tensors):
            continue
        first = ranks[members[0]]
        shapes = {tuple(x.shape) for x in tensors if x is not None}
        if len(shapes) != 1:
            continue
        p = place(
            shapes.pop(), tuple(e.tensor.shape), first.axes, (first.data_rank, first.data_size)
        )
        if p is None or any(i is not None and u != "sample" for i, u in zip(p.index, p.units)):
            continue  # not replicated over the group: each rank's is its block's gradient
        total = torch.stack([x for x in tensors if x is not None]).sum(0)
        m0 = mine[0]
        assert m0 is not None
        out[members[0]] = Event(m0.module, m0.type, m0.call, m0.kind, m0.slot, total)
        out.update({r: _JUDGED_BY_GROUP for r in members[1:]})
    return out


def _mean_loss_over_data_groups(
    ranks: Sequence[Trace], by_rank: list[dict[tuple[str, int, str, str], Event]]
) -> None:
    """With several data groups, the loss the reference's is compared with is the mean of
    the groups' losses (as the check compares it)."""
    key = ("", 0, "loss", "loss")
    losses = [ev[key].tensor for ev in by_rank if key in ev]
    if not any(t.data_size > 1 for t in ranks) or not losses or any(x is None for x in losses):
        return
    mean = torch.stack([x for x in losses if x is not None]).mean(0)
    for ev in by_rank:
        if key in ev:
            old = ev[key]
            ev[key] = Event(old.module, old.type, old.call, old.kind, old.slot, mean)


def _divergence(
    e: Event,
    v: _Verdict,
    step: int,
    calls: dict[str, int],
    types: dict[str, str],
    parents: _Parents,
    upstream: dict[tuple[str, int], float],
) -> Divergence:
    common = dict(
        step=step,
        rank=v.rank,
        max_abs=v.max_abs,
        max_rel=v.max_rel,
        where=v.where,
        noise=v.noise,
        multiple=v.multiple,
        dtype=v.dtype,
        zero=v.zero,
        cause="absent" if v.absent else "",
    )
    if e.kind == "loss":
        return Divergence("forward", None, "", "loss", name="the loss", **common)  # type: ignore[arg-type]
    if e.kind == "field":
        return Divergence("field", None, "", f"field {e.slot!r}", name=e.slot, **common)  # type: ignore[arg-type]
    if e.kind == "param_grad":
        return Divergence(
            "backward",
            e.module,
            e.type,
            f"grad {e.slot!r}",
            **common,  # type: ignore[arg-type]
        )
    module, call, quantity = e.module, e.call, e.kind
    if e.kind in ("input", "grad_output"):
        return _made_around(e, common, calls, types, parents)
    return Divergence(
        "forward" if e.kind == "output" else "backward",
        module,
        e.type,
        quantity,
        call=call,
        calls=calls.get(module, 1),
        upstream_rel=upstream.get((module, call)),
        **common,  # type: ignore[arg-type]
    )


def _made_around(
    e: Event,
    common: dict[str, object],
    calls: dict[str, int],
    types: dict[str, str],
    parents: _Parents,
) -> Divergence:
    """A call's input (or output gradient) departs: made by the code around the call, its
    enclosing module's own code (climbing past parents that merely hand this output on), or
    the batch / the loss outside the model."""
    module, call = e.module, e.call
    parent, through = parents.get((module, call), (None, False))
    while e.kind == "grad_output" and through and parent is not None:
        parent, through = parents.get(parent, (None, False))
    if parent is None:
        what = "the batch (the model's input)" if e.kind == "input" else "the loss"
        direction = "forward" if e.kind == "input" else "backward"
        return Divergence(
            direction,
            None,
            "",
            f"{e.kind} of {module!r}",
            name=what,
            **common,  # type: ignore[arg-type]
        )
    quantity = f"{e.kind} of {module!r}"
    module, call = parent
    return Divergence(
        "forward" if e.kind == "input" else "backward",
        module,
        types.get(module, ""),
        quantity,
        call=call,
        calls=calls.get(module, 1),
        **common,  # type: ignore[arg-type]
    )


def _judge(
    ref: Event, nudged: Event | None, mine: Event | None, trace: Trace, rank: int
) -> _Verdict | None:
    """How far this rank's tensor is from the reference's, against the noise floor; ``None``
    when it cannot be compared.

    The scale errors are relative to is the reference tensor's largest magnitude (the whole
    tensor's, not only this rank's part: a rank whose part is exactly zero, like a block of
    spectral modes above the truncation, is judged at the tensor's scale). A reference that
    is exactly zero everywhere has no scale: its errors are absolute, judged against the
    check's absolute term for the dtype (``Tolerance.for_dtype(...).atol``).
    """
    assert ref.tensor is not None
    if mine is None or mine.tensor is None:
        if ref.kind in ("output", "loss", "field"):  # a call the rank never made
            return _Verdict(rank, math.inf, math.inf, 0.0, math.inf, "", "-", absent=True)
        return None
    if mine.placement == "skip":
        return None
    local = _readable(mine.tensor)
    expected = _readable(ref.tensor)
    noise_t = _readable(nudged.tensor) if nudged is not None else None
    if local is None or expected is None:
        return None
    placement = _placement(ref, mine, local, expected, trace)
    if placement is None:
        return None
    try:
        view, keep = _view(expected, placement)
        noise_view = _view(noise_t, placement)[0] if noise_t is not None else None
    except (IndexError, RuntimeError):
        return None
    if view.shape != local.shape or view.dtype != local.dtype:
        return None
    whole = expected
    if ref.kind in ("grad_output", "grad_input") and trace.data_size > 1:
        # each data group back-propagates the mean over its own samples: d times the
        # reference's share of the same gradient (the parameters' are averaged back)
        view = view * trace.data_size
        whole = whole * trace.data_size
        noise_view = None if noise_view is None else noise_view * trace.data_size
    return _measure(ref.kind, rank, local, view, keep, whole, noise_view, placement)


def _measure(
    kind: str,
    rank: int,
    local: torch.Tensor,
    view: torch.Tensor,
    keep: torch.Tensor,
    whole: torch.Tensor,
    noise_view: torch.Tensor | None,
    placement: Placement,
) -> _Verdict:
    """This rank's ``local`` against the reference's ``view`` of it (where ``keep``), the
    whole reference tensor giving the scale and the nudged reference's view the noise."""
    dtype = str(local.dtype).replace("torch.", "")
    if not (local.is_floating_point() or local.is_complex()):
        return _exact(rank, local, view, keep, placement, dtype)
    a = _wide(local)
    e = _wide(view)
    diff = torch.where(keep, (a - e).abs(), 0.0)
    nonfinite = keep & ~(torch.isfinite(a) & torch.isfinite(e))
    same_nonfinite = nonfinite & ((a == e) | (torch.isnan(a) & torch.isnan(e)))
    if bool((nonfinite & ~same_nonfinite).any()):
        flat = int(torch.argmax((nonfinite & ~same_nonfinite).reshape(-1).to(torch.uint8)))
        where = _where(flat, local.shape, placement)
        return _Verdict(rank, math.inf, math.inf, 0.0, math.inf, where, dtype)
    finite = keep & ~nonfinite
    diff = torch.where(finite, diff, 0.0)
    w = _wide(whole).abs()
    scale = float(torch.where(torch.isfinite(w), w, 0.0).max()) if w.numel() else 0.0
    noise = _noise(noise_view, e, finite)
    eps = torch.finfo(_real(local.dtype)).eps
    tiny = torch.finfo(_real(local.dtype)).tiny
    zero = scale == 0.0
    atol = _absolute_term(kind, local.dtype)
    if zero:  # no scale to be relative to: the check's absolute term decides
        floor = max(noise, atol / DEPART, tiny)
    else:
        floor = max(noise, MIN_ULPS * eps * scale, tiny)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    if max_abs == 0.0:
        return _Verdict(rank, 0.0, 0.0, floor, 0.0, "", dtype, scale, zero)
    flat = int(torch.argmax(diff.reshape(-1)))
    against = atol if zero else scale
    return _Verdict(
        rank,
        max_abs,
        max_abs / against if against else math.inf,
        floor,
        max_abs / floor,
        _where(flat, local.shape, placement),
        dtype,
        scale,
        zero,
    )


def _placement(
    ref: Event, mine: Event, local: torch.Tensor, expected: torch.Tensor, trace: Trace
) -> Placement | None:
    """Where this rank's tensor sits in the reference's: as the case said, whole, or found."""
    if isinstance(mine.placement, Placement):  # the case said (a sharded parameter too)
        return mine.placement
    if ref.kind in ("param_grad", "loss") or mine.placement == "whole":
        return Placement((None,) * local.dim(), ("",) * local.dim())
    return place(
        tuple(local.shape),
        tuple(expected.shape),
        trace.axes,
        (trace.data_rank, trace.data_size),
    )


def _exact(
    rank: int,
    local: torch.Tensor,
    view: torch.Tensor,
    keep: torch.Tensor,
    placement: Placement,
    dtype: str,
) -> _Verdict:
    """An integer tensor (indexes, masks): equal, or departing without measure."""
    bad = (local != view) & keep
    if bool(bad.any()):
        flat = int(torch.argmax(bad.reshape(-1).to(torch.uint8)))
        where = _where(flat, local.shape, placement)
        return _Verdict(rank, math.inf, math.inf, 0.0, math.inf, where, dtype)
    return _Verdict(rank, 0.0, 0.0, 0.0, 0.0, "", dtype)


def _noise(noise_view: torch.Tensor | None, e: torch.Tensor, finite: torch.Tensor) -> float:
    """The nudged reference's largest distance from the reference (widened ``e``), where
    both are finite: the noise floor this run's rounding sets."""
    if noise_view is None or noise_view.shape != e.shape:
        return 0.0
    n = _wide(noise_view)
    ok = finite & torch.isfinite(n)
    if not e.numel():
        return 0.0
    return float(torch.where(ok, (n - e).abs(), 0.0).max())


def _absolute_term(kind: str, dtype: torch.dtype) -> float:
    """The check's absolute tolerance for this kind of quantity in this dtype: what an
    error against an exact zero is measured by."""
    from harness.compare import Tolerance

    quantity = "loss" if kind == "loss" else "grad" if kind in _BACKWARD_KINDS else "field"
    return float(Tolerance.for_dtype(dtype).bound(quantity).atol)


_BACKWARD_KINDS = ("grad_output", "grad_input", "param_grad")


def _readable(t: torch.Tensor | None) -> torch.Tensor | None:
    """A plain tensor of ``t``'s values on this rank, or ``None`` when locating cannot read
    it. A DTensor (or a subclass of one, like physicsnemo's ShardTensor) that reached here
    unconverted is read as its local shard (placed like any rank's tensor)."""
    if t is None or _plain_type(t):
        return t
    if not is_distributed(t):
        return None
    try:
        return plain(t)
    except Exception:  # noqa: BLE001 - unreadable: listed, never raised
        return None


def _real(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex128: torch.float64, torch.complex64: torch.float32}.get(dtype, dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def _view(t: torch.Tensor, p: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's part that a placement names, and where it is defined (halo positions
    off the globe are not)."""
    if p.flatten is not None:
        t = t.reshape(*t.shape[:-2], -1)
    keep = torch.ones((), dtype=torch.bool)
    for d, index in enumerate(p.index):
        if index is None:
            continue
        t = t.index_select(d, index.clamp(min=0))
        shape = [1] * len(p.index)
        shape[d] = len(index)
        keep = keep & (index >= 0).reshape(shape)
    return t, keep.expand(t.shape) if t.dim() else keep


def _where(flat: int, shape: Iterable[int], p: Placement) -> str:
    """The worst element's global position: ``"[1, 3, lat 7, lon 12]"``."""
    shape = tuple(shape)
    if not shape:
        return ""
    coords = np.unravel_index(flat, shape)
    parts = []
    for d, c in enumerate(coords):
        index = p.index[d] if d < len(p.index) else None
        unit = p.units[d] if d < len(p.units) else ""
        if index is None:
            parts.append(f"{unit} {int(c)}" if unit else str(int(c)))
        else:
            parts.append(f"{unit} {int(index[int(c)])}")
    return "[" + ", ".join(parts) + "]"
