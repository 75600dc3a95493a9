"""The records of locating: one run's ``Trace`` of ``Event`` s, and the verdict records
``Divergence``, ``Location`` and ``Calibration`` that ``harness.divergence`` (whose public names
these are) fills in and the report prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harness.divergence._place import Axis, Placement

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
    #: each parameter's gradient as the rank's backward made it, before any synchronisation
    #: (recorded ahead of every hook on the parameter): the evidence that tells a wrong
    #: synchronisation from a wrong backward. A parameter missing here has no such evidence
    presync: dict[str, Event] = field(default_factory=dict)
    #: the user's autograd Functions (``torch.autograd.Function`` classes) on the graph from
    #: a module call's output to each of its own parameters, by parameter name, and to its
    #: inputs, by (module, call): what a backward that departs ran through
    functions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: where each module's class defines its ``forward``, by module name: (file, first
    #: line), so a failure can point at the user's line (GitHub annotations)
    sources: dict[str, tuple[str, int]] = field(default_factory=dict)


# ---------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Divergence:
    """Where the partitioned run first departs from the reference.

    ``direction`` is ``"forward"``, ``"backward"`` or ``"field"``. ``module`` is the module's
    qualified name as in ``model.named_modules()`` (``""``: the model itself), or ``None``
    when the departure is outside every module: then ``name`` says what (``"loss"``, the
    batch, a field). ``quantity`` is what departed (``"output"``, ``"grad_input"``,
    ``"grad 'decoder.weight'"``, ...); ``multiple`` is its error over its noise floor.

    ``cause`` says what the evidence blames beside the module's own code:
    ``"synchronisation"`` for a parameter's gradient that the ranks' backward made right (their
    gradients before any synchronisation add up to the reference's) and that departs after
    it (``module`` is then the module owning the parameter: context, not the culprit;
    ``name`` is the parameter); ``"backward"`` for one whose gradients before the
    synchronisation already depart: the backward of the module owning it (``function``: the
    user's autograd Functions on the graph between its output and the parameter);
    ``"undecided"`` where no gradient before the synchronisation was recorded to tell those
    two apart; ``"misplaced"`` for a field whose rank holds the reference's values of other
    positions (``belongs``, not ``said``); ``"absent"`` for a module call some ranks never
    made. ``rank_type``: the module's class on the ranks where it is not the reference's.
    ``zero``: the reference is exactly zero there, so the error is an absolute one
    (``max_rel`` is it over the check's absolute term).
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
    rank_type: str = ""
    function: tuple[str, ...] = ()
    belongs: str = ""
    said: str = ""

    @property
    def located(self) -> str:
        """``"forward of 'blocks.2.mixer' (GlobalMean)"``, ``"field 'out'"``, ``"loss"``,
        ``"gradient synchronisation of 'decoder.weight'"``, ``"backward of 'attn'
        (RingAttention) through _RingAttention"``."""
        if self.cause == "synchronisation":
            return f"gradient synchronisation of {self.name!r}"
        if self.cause == "undecided":
            return f"gradient synchronisation of {self.name!r} or {self._module()}"
        if self.module is None:
            if self.direction == "field":
                return f"field {self.name!r}"
            return f"{self.direction} of {self.name}"
        return self._module()

    def _module(self) -> str:
        """``"backward of 'conv' (DistConv on the ranks, Conv in the reference)"``, with the
        autograd Functions it ran through where they are known."""
        kind = self.module_type
        if self.rank_type and self.rank_type != self.module_type:
            kind = f"{self.rank_type} on the ranks, {self.module_type} in the reference"
        through = f" through {', '.join(self.function)}" if self.function else ""
        return f"{self.direction} of {self.module!r} ({kind}){through}"

    def line(self) -> str:
        """The report's line: ``First divergence: forward of 'x' (T), step 0: ...``."""
        call = f" (call {self.call + 1} of {self.calls})" if self.calls > 1 else ""
        if self.cause in _PARAMETER_CAUSES:
            owner = f"{self.module!r} ({self.module_type})" if self.module is not None else "?"
            context = f" (backward, owner {owner})" if self.cause == "synchronisation" else ""
            return (
                f"First divergence: {self.located}{context}, step {self.step}: the gradient "
                f"of {self.name!r} {_PARAMETER_CAUSES[self.cause]}; {self._size()}"
            )
        head = f"First divergence: {self.located}{call}, step {self.step}: "
        if self.cause == "misplaced":
            return head + (
                f"rank {self.rank}'s values are the reference's at {self.belongs}, not at "
                f"{self.said} where it puts them; at {self.said}: {self._size()}"
            )
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


#: what the evidence says of a parameter's gradient that departs, by cause
_PARAMETER_CAUSES = {
    "synchronisation": (
        "departs after its synchronisation: the ranks' gradients before it add up to the "
        "reference's"
    ),
    "backward": (
        "departs before any synchronisation: the ranks' gradients as their backward made "
        "them do not add up to the reference's"
    ),
    "undecided": (
        "departs with every activation gradient matching, and no gradient before its "
        "synchronisation was recorded to tell the two apart"
    ),
}

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
    #: what a refinement of the first divergence could not do, one line each, shown as
    #: ``Not located: ...`` (the first divergence found before it stands)
    not_located: list[str] = field(default_factory=list)
    #: where each module's class defines its ``forward`` (file, first line), by module
    #: name, as the ranks ran it (``Trace.sources``): where a module's divergence lives
    sources: dict[str, tuple[str, int]] = field(default_factory=dict)

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
        out += [f"Not located: {line}" for line in self.not_located]
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
