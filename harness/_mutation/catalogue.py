"""Mutants of a user's distributed code: what a test suite would notice if a call were wrong.

The harness proves its own checks by mutation testing; this module lets a user ask the same
of their model's tests. A first run of the tests records every call site their code reaches
on the ranks (``Site``: where, which operation, on which group, how often, whether in
backward). Each site then yields the bugs that the fault catalogue has seen there
(``mutants_for``): the collective skipped, SUM turned into AVG or MAX, the world instead of
the group, the pieces of a gather or a transpose rotated, a transpose's split sizes swapped,
a received halo zeroed or stale, a broadcast from the wrong source, a backward's all-reduce
done twice (or skipped: the identity backward), DDP's gradient all-reduce dropped, the RNG
seeded per rank before ``build`` or ``batch``, buffers broadcast in place. The tests rerun
once per mutant, with the mutant injected on every rank at that site only; a mutant that
makes a test fail is killed (a hang counts, as the deadlock detection ends it).

Pure data and rules here: the injection itself is ``harness._mutation.inject`` (rank side),
the loop over sites and mutants ``harness._mutation.campaign``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum


class MutantKind(str, Enum):
    """What a mutant does at its call site (``KINDS`` says it in words). A ``str`` enum, as
    ``harness.compare.Quantity``: ``MutantKind.SKIP == "skip"``, ``str()`` is the plain text a
    table prints, and it crosses to xdist's controller (built-in types only) as that text,
    read back with ``MutantKind(text)``."""

    SKIP = "skip"
    AVG = "avg"
    MAX = "max"
    WORLD = "world"
    DOUBLE = "double"
    ROTATE = "rotate"
    SWAP_SPLITS = "swap-splits"
    WRONG_SOURCE = "wrong-source"
    ZERO = "zero"
    STALE = "stale"
    NO_GRAD_ALLREDUCE = "no-grad-allreduce"
    RNG_PER_RANK = "rng-per-rank"
    BUFFERS_BROADCAST = "buffers-broadcast"

    def __str__(self) -> str:
        return self.value


#: (kind, what it does), in the order a table lists them
KINDS: dict[MutantKind, str] = {
    MutantKind.SKIP: "the operation is not performed (its tensors keep their local values)",
    MutantKind.AVG: "SUM becomes AVG (the result divided by the group's size)",
    MutantKind.MAX: "SUM becomes MAX",
    MutantKind.WORLD: "run over the whole world instead of its group",
    MutantKind.DOUBLE: "an extra all-reduce of the result (a summed backward summed twice)",
    MutantKind.ROTATE: "each rank's piece lands in its neighbour's place",
    MutantKind.SWAP_SPLITS: "an all_to_all's input and output split sizes exchanged (each "
    "piece cut at the boundaries meant for the other direction of the transpose)",
    MutantKind.WRONG_SOURCE: "broadcast from the next rank instead of the root",
    MutantKind.ZERO: "the received tensor is zeros",
    MutantKind.STALE: "the received tensor holds the previous call's data",
    MutantKind.NO_GRAD_ALLREDUCE: "DDP's gradient all-reduce dropped (each rank keeps its own)",
    MutantKind.RNG_PER_RANK: "the RNG seeded per rank (rank-dependent initialisation or data)",
    MutantKind.BUFFERS_BROADCAST: "buffers copied in place from the group's first rank before each "
    "forward (DDP's broadcast_buffers)",
}

#: ProcessGroup methods by the mutants that apply to them
_BY_METHOD: dict[str, tuple[MutantKind, ...]] = {
    "allreduce": (MutantKind.SKIP, MutantKind.AVG, MutantKind.MAX, MutantKind.WORLD),
    "allreduce_coalesced": (MutantKind.SKIP,),
    "broadcast": (MutantKind.SKIP, MutantKind.WRONG_SOURCE),
    "reduce": (MutantKind.SKIP,),
    "allgather": (MutantKind.SKIP, MutantKind.ROTATE),
    "_allgather_base": (MutantKind.SKIP, MutantKind.ROTATE),
    "all_gather_single": (MutantKind.SKIP, MutantKind.ROTATE),
    "allgather_coalesced": (MutantKind.SKIP,),
    "allgather_into_tensor_coalesced": (MutantKind.SKIP,),
    "all_gather_single_coalesced": (MutantKind.SKIP,),
    "alltoall": (MutantKind.SKIP, MutantKind.ROTATE),
    "alltoall_base": (MutantKind.SKIP, MutantKind.ROTATE, MutantKind.SWAP_SPLITS),
    "all_to_all_single": (MutantKind.SKIP, MutantKind.ROTATE, MutantKind.SWAP_SPLITS),
    "reduce_scatter": (MutantKind.SKIP, MutantKind.AVG),
    "_reduce_scatter_base": (MutantKind.SKIP, MutantKind.AVG),
    "reduce_scatter_single": (MutantKind.SKIP, MutantKind.AVG),
    "reduce_scatter_tensor_coalesced": (MutantKind.SKIP,),
    "reduce_scatter_single_coalesced": (MutantKind.SKIP,),
    "gather": (MutantKind.SKIP,),
    "gather_single": (MutantKind.SKIP,),
    "scatter": (MutantKind.SKIP,),
    "barrier": (MutantKind.SKIP,),
    "monitored_barrier": (MutantKind.SKIP,),
    "send": (MutantKind.SKIP,),
    "recv": (MutantKind.ZERO, MutantKind.STALE),
    "recv_anysource": (MutantKind.ZERO, MutantKind.STALE),
    "ddp": (MutantKind.NO_GRAD_ALLREDUCE,),
    "case-build": (MutantKind.RNG_PER_RANK, MutantKind.BUFFERS_BROADCAST),
    "case-batch": (MutantKind.RNG_PER_RANK,),
}

#: ProcessGroup methods whose reduction may be turned from SUM into another (``avg``, ``max``)
REDUCING = frozenset(
    {"allreduce", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single"}
)


@dataclass
class SiteStats:
    """What one rank saw of one call site during a run (merged into a ``Site``)."""

    op: str
    method: str
    group_size: int = 1
    whole_world: bool = True
    reduce: str = ""  # "sum", "max", ... for a reduction
    backward: bool = False  # reached while autograd ran a backward
    calls: int = 0
    data: list[float] = field(default_factory=list)  # a checksum of each call's input
    nonzero: bool = False  # some call's input held a value other than zero
    buffers: bool = False  # case-build: the model has buffers
    uneven: bool = False  # an all_to_all whose input and output split sizes differed

    def merge(self, other: SiteStats) -> None:
        self.calls = max(self.calls, other.calls)
        self.group_size = max(self.group_size, other.group_size)
        self.nonzero |= other.nonzero
        self.backward |= other.backward
        self.buffers |= other.buffers
        self.uneven |= other.uneven


@dataclass(frozen=True)
class Site:
    """A call site the tests reached, as every rank saw it."""

    site: str  # "/path/model.py:41 in halo"
    op: str
    method: str
    group_size: int
    whole_world: bool
    reduce: str
    backward: bool
    calls: int  # per run, on the rank that called it most
    same_data: bool  # every call passed the same input on every rank that reached it
    buffers: bool = False
    zeros: bool = False  # every call's input was all zeros on every rank
    uneven: bool = False  # an all_to_all whose input and output split sizes differed

    @property
    def location(self) -> str:
        """``"model.py:41"``: the file (its name) and line."""
        where = self.site.split(" in ", 1)[0]
        path, _, line = where.rpartition(":")
        return f"{os.path.basename(path)}:{line}"


@dataclass(frozen=True, order=True)
class Mutant:
    """One bug injected at one call site."""

    site: str
    kind: MutantKind
    op: str = ""

    @property
    def label(self) -> str:
        return f"{self.kind} {self.op}".strip()


def merge_sites(per_rank: Iterable[Mapping[str, SiteStats]]) -> dict[str, Site]:
    """The sites every rank reached, merged over ranks (and runs)."""
    merged: dict[str, SiteStats] = {}
    inputs: dict[str, list[list[float]]] = {}
    for stats in per_rank:
        for where, s in stats.items():
            if where in merged:
                merged[where].merge(s)
                merged[where].whole_world &= s.whole_world
            else:
                merged[where] = dataclasses.replace(s, data=[])  # the data is kept per rank
            inputs.setdefault(where, []).append(s.data)
    return {
        where: Site(
            where,
            s.op,
            s.method,
            s.group_size,
            s.whole_world,
            s.reduce,
            s.backward,
            s.calls,
            same_data=_same(inputs[where]),
            buffers=s.buffers,
            zeros=not s.nonzero and s.method not in _NO_INPUT and any(inputs[where]),
            uneven=s.uneven,
        )
        for where, s in merged.items()
    }


#: methods whose first argument is not data sent (a receive's buffer, a case's method)
_NO_INPUT = frozenset(
    {"recv", "recv_anysource", "ddp", "case-build", "case-batch", "barrier", "monitored_barrier"}
)


def _same(data: Sequence[Sequence[float]]) -> bool:
    seen = [d for d in data if d]
    return len(seen) > 1 and all(d == seen[0] for d in seen)


def mutants_for(site: Site) -> list[Mutant]:
    """The mutants of one site (a reduction other than SUM gets no AVG/MAX; only a backward's
    all-reduce gets ``double``; ``buffers-broadcast`` only for models with buffers)."""
    kinds = list(_BY_METHOD.get(site.method, (MutantKind.SKIP,)))
    if site.method in REDUCING and site.reduce not in ("", "sum"):
        kinds = [k for k in kinds if k not in (MutantKind.AVG, MutantKind.MAX)]
    if site.method == "allreduce" and site.backward:
        kinds.append(MutantKind.DOUBLE)
    if site.method == "case-build" and not site.buffers:
        kinds.remove(MutantKind.BUFFERS_BROADCAST)
    return [Mutant(site.site, k, site.op) for k in kinds]


def cannot_matter(mutant: Mutant, site: Site) -> str:
    """Why the mutant cannot change any result on this layout, where that is known without
    running it; else ``""``. (Such a mutant survives whatever the tests check: it names
    what the tests' layouts cannot show.)"""
    if site.group_size == 1 and site.method not in ("ddp", "case-build", "case-batch"):
        return "one rank in the group: the operation is the identity here"
    if site.zeros and mutant.kind in (
        MutantKind.SKIP,
        MutantKind.AVG,
        MutantKind.MAX,
        MutantKind.WORLD,
        MutantKind.ROTATE,
        MutantKind.DOUBLE,
    ):
        return (
            "every rank passed zeros here in every run (a guard that only fires on an error?): "
            "summing, averaging or moving zeros changes nothing"
        )
    if mutant.kind == MutantKind.WORLD and site.whole_world:
        return (
            "the group is the whole world on every layout the tests ran: test a layout with "
            "data groups (spatial_size < ranks)"
        )
    if (
        mutant.kind in (MutantKind.ROTATE, MutantKind.MAX)
        and site.same_data
        and site.method not in _NO_INPUT
    ):
        return "every rank passed the same data here: rotating or taking the max changes nothing"
    if mutant.kind == MutantKind.SWAP_SPLITS and not site.uneven:
        return (
            "the input and output split sizes were the same in every call (even pieces): "
            "exchanging them changes nothing; test a layout that splits unevenly"
        )
    if mutant.kind == MutantKind.STALE and site.calls <= 1:
        return (
            "called once per run: the previous call's data is the untouched buffer (the same "
            "mutant as zero, or as skip); run more steps"
        )
    return ""


# ---------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Outcome:
    """What the tests did to one mutant."""

    mutant: Mutant
    location: str  # "model.py:41"
    killed_by: str = ""  # the test that failed
    quantity: str = ""  # how it failed (grad, field, deadlock, assert, ...)
    reason: str = ""  # a survivor's reason, where known

    @property
    def killed(self) -> bool:
        return bool(self.killed_by)


def score(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    """(killed, total)."""
    return sum(o.killed for o in outcomes), len(outcomes)


def score_line(outcomes: Sequence[Outcome]) -> str:
    """``"spatial mutation score: 9/11 killed"``: the table's last line."""
    killed, total = score(outcomes)
    return f"spatial mutation score: {killed}/{total} killed"


def table_rows(outcomes: Sequence[Outcome]) -> list[tuple[str, str, str]]:
    """(mutant, call site, verdict) per outcome, in site order."""
    rows = []
    for o in sorted(outcomes, key=lambda o: (o.location, o.mutant.kind)):
        if o.killed:
            found = o.quantity.split(", ") if o.quantity else []
            how = found[0] + (f" +{len(found) - 1}" if len(found) > 1 else "") if found else ""
            verdict = f"killed by {o.killed_by}" + (f" ({how})" if how else "")
        else:
            verdict = "SURVIVED" + (f": {o.reason}" if o.reason else "")
        rows.append((o.mutant.label, o.location, verdict))
    return rows


def quantity_of(error: str) -> str:
    """How a killing test failed, from its failure text: the harness's own quantity
    (``deadlock``, ``timeout``... for the ``RankFailure`` raised), else ``assert`` or
    ``failed``. (``harness.compare`` is imported here, not above: it loads torch, and this
    module stays pure.)"""
    from harness.compare import Quantity

    for name, quantity in (
        ("RankDeadlock", Quantity.DEADLOCK),
        ("RankTimeout", Quantity.TIMEOUT),
        ("RankCrash", Quantity.CRASH),
        ("RankPending", Quantity.PENDING),
        ("RankError", Quantity.ERROR),
    ):
        if name in error:
            return str(quantity)
    return "assert" if "AssertionError" in error else "failed"
