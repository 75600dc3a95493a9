"""Where a partitioned run first departs from its reference: the pure rule.

``harness.equivalence._locating`` reruns one step of the reference (twice: once as is, once nudged
at its
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
  backward over); one that departs with no activation gradient departing after it is its
  synchronisation (``gradient synchronisation of 'decoder.weight'``) when the ranks'
  gradients before the synchronisation (recorded ahead of every hook on it) add up to the
  reference's, and the backward of the module owning it when they do not (named with the
  user's autograd Functions on the graph between them: ``backward of 'attn'
  (RingAttention) through _RingAttention``); without that record, both are named. A module
  call no rank made (the ranks use its parameters in a functional call) is skipped and
  listed;
- then the fields as the case reported them: a rank whose values are the reference's at
  another block (another rank's, or its own partition's) holds them misplaced, and the
  line says where they belong.

A module the ranks run as another class than the reference's is named with both.

"Departs" is measured, not guessed: each quantity's noise floor is how far the nudged
reference moved it (at least a few units of rounding of its magnitude); a quantity departs
when a rank is more than ``DEPART`` times its floor away from the reference.

A rank's tensor is placed in the reference's by the layouts the case declares
(``harness.divergence._place``); tensors that cannot be placed are listed as not compared, never
taken as matching. The records (``Trace``, ``Event``, ``Divergence``, ``Location``) are in
``harness.divergence._trace``, the verdict on one quantity of one rank in
``harness.divergence._measure``; their
public names are this module's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from harness.divergence._measure import DEPART, MIN_ULPS, _judge, _placement, _plain_type, _Verdict
from harness.divergence._place import (
    Axis,
    Placement,
    Positions,
    axes_of,
    block_of,
    place,
    same_positions,
    shard_placement,
    span,
)
from harness.divergence._trace import Calibration, Divergence, Event, Location, Trace
from harness.errors import exception_summary

__all__ = [
    "DEPART",
    "MIN_ULPS",
    "Axis",
    "Calibration",
    "Divergence",
    "Event",
    "Location",
    "Placement",
    "Positions",
    "Trace",
    "axes_of",
    "first_divergence",
    "place",
    "shard_placement",
]

# The classes' module stays ``harness.divergence``, their home before they moved below (as
# trio and numpy do for names behind a facade): reprs, pickles and the public-API rule (a
# name ``harness`` exports lives in a public module, ``tests/unit/test_layers.py``) see them
# where users import them.
for _public in (Axis, Calibration, Divergence, Event, Location, Placement, Positions, Trace):
    _public.__module__ = __name__


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

    A parameter's gradient that departs is held while the rest of the backward is judged
    (it feeds no activation gradient: one departing later is the module bug); if none
    does, the ranks' gradients before the synchronisation tell it from the backward. A
    module call that no rank made (e.g. a functional call with the module's parameters)
    is skipped and listed, never taken as departing.
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
        _misplaced(out, e, noisy.get(e.key), verdicts, ranks, by_rank, depart)
        break
    if out.first is None and held is not None:
        first = _divergence(*held, reference.step, calls, types, parents, upstream)
        out.first = _parameter(first, held[0], noisy, ranks, activation_grads > 0, depart)
    _finish(out, ranks, path)
    return out


def _finish(out: Location, ranks: Sequence[Trace], path: dict[str, None]) -> None:
    """The class the departing rank ran, and what was not compared and the dtypes seen,
    in order."""
    if out.first is not None:
        out.first = replace(out.first, rank_type=_rank_type(ranks, out.first))
    out.not_compared = {label: sorted(set(v)) for label, v in out.not_compared.items()}
    out.path_dtypes = tuple(d for d in path if d != "-")
    # the classes the ranks ran (the parallel code under test), the departing rank's last
    departing = out.first.rank if out.first is not None else -1
    for t in [*ranks, *ranks[departing : departing + 1]] if departing >= 0 else ranks:
        out.sources.update(t.sources)


def _parameter(
    d: Divergence,
    e: Event,
    noisy: dict[tuple[str, int, str, str], Event],
    ranks: Sequence[Trace],
    matched: bool,
    depart: float,
) -> Divergence:
    """A parameter's gradient departs and no activation gradient after it does: its
    synchronisation when the ranks' gradients before it add up to the reference's, the
    backward of its module (through the Functions it ran through) when they do not, and
    either, said so, when nothing before the synchronisation was recorded but every
    activation gradient compared matched."""
    trace = ranks[d.rank] if d.rank < len(ranks) else None
    function = trace.functions.get(e.slot, ()) if trace is not None else ()
    evidence = _before_sync(e, noisy.get(e.key), ranks, depart)
    if evidence == "sync":
        return replace(d, cause="synchronisation", name=e.slot)
    if evidence == "backward":
        return replace(d, cause="backward", name=e.slot, function=function)
    if matched:
        return replace(d, cause="undecided", name=e.slot, function=function)
    return replace(d, function=function)


def _before_sync(e: Event, nudged: Event | None, ranks: Sequence[Trace], depart: float) -> str:
    """``"sync"`` when the ranks' gradients of a parameter before any synchronisation are
    the reference's (each as it is: reduced inside the graph; or summed over the ranks
    holding the same part, averaged over the data groups), ``"backward"`` when they are not,
    ``""`` when they were not recorded on every rank."""
    mine = [t.presync.get(e.slot) for t in ranks]
    if e.tensor is None or not ranks or any(m is None for m in mine):
        return ""
    readings: list[list[_Verdict | None]] = []
    try:
        readings.append([_judge(e, nudged, m, t, r) for r, (m, t) in enumerate(zip(mine, ranks))])
        readings.append(_summed_before_sync(e, nudged, [m for m in mine if m], ranks))
    except Exception:  # noqa: BLE001 - a diagnosis never takes a verdict down: no evidence
        return ""
    judged = [[v for v in vs if v is not None] for vs in readings if vs and None not in vs]
    if not judged:
        return ""
    return "sync" if any(_worst(vs) <= depart for vs in judged if vs) else "backward"


def _summed_before_sync(
    e: Event, nudged: Event | None, mine: Sequence[Event], ranks: Sequence[Trace]
) -> list[_Verdict | None]:
    """Per part of a parameter (the whole, or a shard several ranks hold), the sum of the
    gradients of the ranks holding it over the data groups' count, judged."""
    groups: dict[object, list[int]] = {}
    for r, m in enumerate(mine):
        p = m.placement
        key = (
            tuple(None if i is None else tuple(i.tolist()) for i in p.index)
            if isinstance(p, Placement)
            else None
        )
        groups.setdefault(key, []).append(r)
    out: list[_Verdict | None] = []
    for members in groups.values():
        tensors = [mine[r].tensor for r in members]
        if any(x is None or x.shape != tensors[0].shape for x in tensors):  # type: ignore[union-attr]
            return [None]
        total = torch.stack(tensors).sum(0) / ranks[members[0]].data_size  # type: ignore[arg-type]
        summed = replace(mine[members[0]], tensor=total.to(tensors[0].dtype))  # type: ignore[union-attr]
        out.append(_judge(e, nudged, summed, ranks[members[0]], members[0]))
    return out


def _misplaced(
    out: Location,
    e: Event,
    nudged: Event | None,
    verdicts: list[_Verdict],
    ranks: Sequence[Trace],
    by_rank: list[dict[tuple[str, int, str, str], Event]],
    depart: float,
) -> None:
    """A field that departs: the first departing rank whose values are the reference's at
    another block (another rank's, as that rank placed it or as its partition gives it)
    holds them misplaced, and ``out.first`` says where they belong. A search that cannot
    read the values leaves the field's own line and says so on a ``Not located:`` line."""
    if out.first is None or e.kind != "field" or e.tensor is None:
        return
    try:
        out.first = _elsewhere(out.first, e, nudged, verdicts, ranks, by_rank, depart)
    except Exception as exc:  # noqa: BLE001 - a diagnosis never takes a verdict down
        out.not_located.append(
            f"where the values of {out.first.located} belong ({exception_summary(exc)})"
        )


def _elsewhere(
    d: Divergence,
    e: Event,
    nudged: Event | None,
    verdicts: list[_Verdict],
    ranks: Sequence[Trace],
    by_rank: list[dict[tuple[str, int, str, str], Event]],
    depart: float,
) -> Divergence:
    assert e.tensor is not None
    for v in sorted(verdicts, key=lambda v: v.rank):
        mine = by_rank[v.rank].get(e.key)
        if v.multiple <= depart or mine is None or mine.tensor is None:
            continue
        trace = ranks[v.rank]
        said = _placement(e, mine, mine.tensor, e.tensor, trace)
        if said is None:
            continue
        blocks = [o.placement for ev in by_rank if isinstance(o := ev.get(e.key), Event)]
        blocks += [
            block_of(t.axes, tuple(mine.tensor.shape), tuple(e.tensor.shape), said) for t in ranks
        ]
        for p in blocks:
            if not isinstance(p, Placement) or same_positions(p, said):
                continue
            there = _judge(e, nudged, replace(mine, placement=p), trace, v.rank)
            if there is not None and there.multiple <= depart:
                return replace(
                    d,
                    rank=v.rank,
                    max_abs=v.max_abs,
                    max_rel=v.max_rel,
                    where=v.where,
                    noise=v.noise,
                    multiple=v.multiple,
                    zero=v.zero,
                    cause="misplaced",
                    belongs=span(p, trace.axes),
                    said=span(said, trace.axes),
                )
    return d


def _rank_type(ranks: Sequence[Trace], d: Divergence) -> str:
    """The class the departing rank ran as the divergence's module (``""``: not seen)."""
    if d.module is None or d.rank >= len(ranks):
        return ""
    for e in ranks[d.rank].events:
        if e.module == d.module and e.kind in ("input", "output") and e.type:
            return e.type
    return ""


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
