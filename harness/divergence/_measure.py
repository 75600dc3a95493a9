"""How far one rank's tensor is from the reference's, against its noise floor: the verdict
on one quantity of one rank that ``harness.divergence.first_divergence`` walks the trace with.

The noise floor is how far the nudged reference moved the quantity (at least ``MIN_ULPS``
units of rounding of its magnitude); the quantity departs when the rank is more than
``DEPART`` times it away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness._base.values import is_distributed, plain
from harness.divergence._place import Placement, _view, _where, place
from harness.divergence._trace import Event, Trace

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


def _plain_type(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


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
