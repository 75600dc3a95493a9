"""A check judged by the model's own rounding: each entry of every loss, gradient, field and
parameter against the spread that nudged reruns of the reference reach there.

A fixed float32 tolerance (``rtol 1e-5``: ~100 units of rounding) lets a halo that is one
row short pass where the rows it drops carry small weights: the fields move by a few units
of rounding at the block edges only. What rounding alone does to each entry is measured
instead: the reference rerun ``members`` times with its parameters and batches nudged by a
unit of rounding (``harness._rank.nudge``). An entry's **spread** is the furthest any rerun
lands from the reference there, and at least one unit of rounding of the entry itself and
of the tensor's mean magnitude (where every rerun happened to land on the reference, the
partitioned run may still round its last bit the other way; an entry that cancels rounds
like the terms it was summed from). An entry **fails** when the partitioned run is further from the
reference than ``factor`` times its spread (an exact zero, which no nudge moves, by more than
one unit of rounding of the quantity's largest value).

Per entry, not per quantity: a quantity's largest spread sits at its largest values, so a
bug of a few units of rounding at small entries hides under it (a one-row-short halo: 0.7x
the per-quantity spread, 8x the per-entry one; docs/precision.md has the measurements).

Pure: reads records, touches no process group; ``harness.equivalence._calibrate`` runs the reruns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harness._records.run import RunRecord, StepRecord
from harness.compare import Quantity

_REAL = {torch.complex128: torch.float64, torch.complex64: torch.float32}


def _eps(t: torch.Tensor) -> float:
    dtype = _REAL.get(t.dtype, t.dtype)
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def entry_spread(reference: torch.Tensor, members: list[torch.Tensor]) -> torch.Tensor | None:
    """Each entry's rounding spread (float64, ``reference``'s shape): the furthest member
    from ``reference`` there, and at least one unit of rounding of the entry and of the
    tensor's mean magnitude; ``None`` where the reference is not floating, a member's shape
    differs, or a member is not finite where the reference is (nothing to measure).

    The mean magnitude's unit is for entries that cancel: an entry summed from terms of the
    tensor's usual size that nearly cancel rounds like those terms, not like its own small
    value, and one-ulp nudges can leave it almost in place (a correct float32 SFNO: an
    output of 1.6e-3 among values ~1, 2.5 units of rounding of 1.0 off in the partitioned
    run, its members 100x closer).

    >>> r = torch.tensor([1.0, 0.0, 8.0], dtype=torch.float32)  # mean magnitude 3
    >>> m = [r + torch.tensor([1e-6, 0.0, 0.0]), r - torch.tensor([3e-6, 0.0, 0.0])]
    >>> [f"{v:.2g}" for v in entry_spread(r, m).tolist()]
    ['3e-06', '3.6e-07', '9.5e-07']
    """
    if not (reference.is_floating_point() or reference.is_complex()):
        return None
    if any(m.shape != reference.shape for m in members):
        return None
    r = _as64(reference)
    size = r.abs()
    finite = size[torch.isfinite(size)]
    typical = float(finite.mean()) if finite.numel() else 0.0
    unit = _eps(reference) * size.clamp_min(typical)
    if not members:
        return unit
    away = torch.stack([(_as64(m) - r).abs() for m in members]).amax(0)
    if not bool(torch.isfinite(away[torch.isfinite(r)]).all()):
        return None
    return torch.maximum(away, unit)


def _as64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def allowance(spread: torch.Tensor, expected: torch.Tensor, factor: float) -> torch.Tensor:
    """The largest difference allowed at each entry: ``factor`` times its spread; where the
    spread is 0 (an exact zero that no nudge moved), one unit of rounding of the largest
    finite value of ``expected`` (a floor added everywhere would hide errors of a few units
    of rounding at entries much smaller than the largest: a halo bug's block edges).

    >>> one = torch.tensor([1.0, 0.0])  # float32: one unit of rounding of 1.0 is 2**-23
    >>> allowance(torch.tensor([0.5, 0.0], dtype=torch.float64), one, 10.0).tolist()
    [5.0, 1.1920928955078125e-07]
    """
    finite = expected.detach()[torch.isfinite(expected.detach())]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    spread = spread.to(torch.float64)
    return torch.where(spread > 0, factor * spread, _eps(expected) * largest)


@dataclass
class Spreads:
    """The rounding spread of every entry of a reference run: a ``RunRecord`` shaped like
    the reference's (``record``: each loss, gradient, field and parameter replaced by its
    per-entry spread), the reruns it was measured from, and the ``factor`` a check allows.
    """

    record: RunRecord
    members: int
    factor: float
    #: a quantity's own factor where it is not ``factor`` (gradients: their sums cancel more)
    factors: dict[str, float] = dataclasses.field(default_factory=dict)

    def factor_of(self, quantity: Quantity) -> float:
        """The multiple of its spread that ``quantity``'s entries may reach."""
        return self.factors.get(str(quantity), self.factor)

    def of(self, quantity: Quantity, step: int, name: str) -> torch.Tensor | None:
        """The spread of ``name``'s ``quantity`` at ``step`` (``None``: not measured)."""
        if step >= len(self.record.steps):
            return None
        st = self.record.steps[step]
        if quantity is Quantity.LOSS:
            return st.loss if st.loss.numel() else None
        if quantity is Quantity.GRAD:
            return st.grads.get(name)
        if quantity is Quantity.PARAM:
            return st.params.get(name)
        if quantity is Quantity.FIELD:
            f = st.fields.get(name)
            return None if f is None or f.keyed else f.values
        return None


def spreads_of(
    reference: RunRecord,
    members: list[RunRecord],
    factor: float,
    factors: dict[str, float] | None = None,
) -> Spreads:
    """Every entry's spread over ``members`` (nudged reruns of ``reference``), judged
    within ``factor`` (``factors``: per quantity, where another)."""
    steps = []
    for k, ref in enumerate(reference.steps):
        mine = [m.steps[k] for m in members if k < len(m.steps)]

        def spread(r: torch.Tensor | None, of: list[torch.Tensor | None]) -> torch.Tensor | None:
            if r is None or any(t is None for t in of):
                return None
            return entry_spread(r, [t for t in of if t is not None])

        loss = spread(ref.loss, [m.loss for m in mine])
        grads = {n: spread(g, [m.grads.get(n) for m in mine]) for n, g in ref.grads.items()}
        params = {n: spread(p, [m.params.get(n) for m in mine]) for n, p in ref.params.items()}
        fields = {}
        for n, f in ref.fields.items():
            of = [m.fields.get(n) for m in mine]
            if f.keyed or any(x is None for x in of):
                continue
            s = spread(f.values, [x.values for x in of if x is not None])
            if s is not None:
                fields[n] = dataclasses.replace(f, values=s)
        steps.append(
            StepRecord(
                loss=torch.zeros(0) if loss is None else loss,
                grads={n: g for n, g in grads.items() if g is not None},
                fields=fields,
                params={n: p for n, p in params.items() if p is not None},
            )
        )
    record = RunRecord(init={}, steps=steps)
    return Spreads(record, len(members), factor, dict(factors or {}))


__all__ = ["Spreads", "allowance", "entry_spread", "spreads_of"]
