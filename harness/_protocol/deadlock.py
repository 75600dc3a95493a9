"""The deadlock rule: when the waits of a run can never all complete, and when a leftover is
truly unmatched. Evidence in, verdict out; pure (no torch, no processes, no clock).

A run is deadlocked only when that is proven from what the ranks say they did:

- **missing**: a rank waits in an operation that needs a peer which has returned (or died)
  without doing its part: the ``k``-th collective on a group that the peer left after fewer
  than ``k`` collectives on it; a receive whose sender returned having sent fewer messages to
  it with that tag; a send (gloo's send waits for the receive) whose peer returned having
  received fewer.
- **mismatch**: members of one group wait in (or have done) the same ``k``-th collective as
  different operations, or with different sizes where the operation needs equal ones
  (an ``all_reduce`` of 3 elements against one of 4).
- **cycle**: ranks wait on each other's parts, round a cycle, across groups or in
  point-to-point (two blocking receives from each other).

When every member of a group waits in the same collective with the same number, the
collective is in progress, however long it takes: nothing here ends it; only the timeout
does. A rank that computes, sleeps or waits on anything else is *running*: it may still do
its part, so nobody waiting for it is proven stuck.

The numbers are per run: ``k`` counts the collectives a rank issued on a group since the run
began (torch's per-group sequence number, which counts every operation including those issued
from C++ such as DDP's reducer, less the point-to-point operations the harness saw), and
sends and receives are counted per (group, peer, tag).

>>> groups = {"0": (0, 1)}
>>> wait = Op(Kind.COLLECTIVE, "0", "all_reduce", 3, numel=1, dtype="float32")
>>> views = [RankView(0, Status.WAITING, wait=wait, since=0.4),
...          RankView(1, Status.RETURNED, since=0.1, counts=Counts(collectives={"0": 2}))]
>>> verdict = decide(views, groups)
>>> verdict.culprits, [s.rank for s in verdict.stuck]
((1,), [0])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum

#: peer of a receive from any source
ANY_SOURCE = -2


class Kind(IntEnum):
    """What an operation is, for matching: a collective, or one side of point-to-point."""

    COLLECTIVE = 1
    SEND = 2
    RECV = 3


#: Collectives whose every member must pass the same number of elements (and dtype); for the
#: others (all_to_all with split sizes, gather, scatter, barrier) only the operation must match.
SAME_SIZE = frozenset(
    {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
)

#: public names of one collective (torch 2.13 adds ``*_single`` beside the names it
#: deprecates): either side of a match may use either
SAME_OP = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "gather_single": "gather_into_tensor",  # torch 2.14
}


@dataclass(frozen=True)
class Op:
    """One operation a rank issued: what it is, where in the run's order, where in the code.

    ``index``: for a collective, its number among the collectives this rank issued on
    ``group`` this run (1 for the first); for a send or receive, its number among this rank's
    sends to (receives from) ``peer`` with ``tag`` on ``group``.
    """

    kind: Kind
    group: str
    op: str
    index: int
    peer: int | None = None  # global rank of the other side (p2p); ANY_SOURCE
    tag: int = 0
    numel: int | None = None
    dtype: str = ""
    site: str = ""
    #: the group as the user made it, written by its rank (``"the group of ranks [0, 1]
    #: (new_group at model.py:42)"``, ``"the world group"``); ``""``: only its id is known
    label: str = ""

    def group_text(self) -> str:
        """The group in a message: its label, else ``"group 4"`` (torch's id)."""
        return self.label or f"group {self.group}"

    def describe(self) -> str:
        """``"all_reduce #3 on the world group (1 float32) at model.py:12 in halo"``."""
        if self.kind == Kind.COLLECTIVE:
            text = f"{self.op} #{self.index} on {self.group_text()}"
        else:
            where = "to" if self.kind == Kind.SEND else "from"
            peer = "any rank" if self.peer == ANY_SOURCE else f"rank {self.peer}"
            text = f"{self.op} {where} {peer} (tag {self.tag}, #{self.index})"
        size = " ".join(p for p in (_count(self.numel), self.dtype) if p)
        if size:
            text += f" ({size})"
        if self.site:
            text += f" at {self.site}"
        return text

    def shape_text(self) -> str:
        return " ".join(p for p in (self.op, _count(self.numel), self.dtype) if p)


def _count(numel: int | None) -> str:
    if numel is None:
        return ""
    return f"{numel} element" + ("" if numel == 1 else "s")


@dataclass(frozen=True)
class Counts:
    """What a rank issued this run: collectives per group, sends and receives per
    (group, peer, tag), and the operation and size of its recent collectives."""

    collectives: Mapping[str, int] = field(default_factory=dict)
    sends: Mapping[tuple[str, int, int], int] = field(default_factory=dict)  # (group, dst, tag)
    recvs: Mapping[tuple[str, int, int], int] = field(default_factory=dict)  # (group, src, tag)
    #: (group, index) -> the collective issued there (recent ones only)
    issued: Mapping[tuple[str, int], Op] = field(default_factory=dict)

    def collectives_on(self, group: str) -> int:
        return int(self.collectives.get(group, 0))

    def received_from(self, group: str, src: int, tag: int) -> int:
        """Receives posted for ``src`` with ``tag`` (a receive from any source may take it)."""
        return int(
            self.recvs.get((group, src, tag), 0) + self.recvs.get((group, ANY_SOURCE, tag), 0)
        )

    def sent_to(self, group: str, dst: int, tag: int) -> int:
        return int(self.sends.get((group, dst, tag), 0))


class Status(Enum):
    RUNNING = "running"  # computing, sleeping, or anything the evidence does not pin down
    WAITING = "waiting"  # its main thread waits on one operation (``wait``)
    BLOCKED = "blocked"  # idle inside torch on something unseen (DDP's backward, say)
    RETURNED = "returned"  # the function returned: it will issue nothing more
    DEAD = "dead"


FINISHED = (Status.RETURNED, Status.DEAD)


@dataclass(frozen=True)
class RankView:
    """One rank as the evidence shows it. ``counts``: final for a finished rank; for a waiting
    or blocked rank, as probed while it waited (``None``: not known)."""

    rank: int
    status: Status
    wait: Op | None = None
    since: float = 0.0  # seconds into the run: when the wait began, or when it returned
    counts: Counts | None = None
    where: str = ""  # a blocked rank's innermost frame


@dataclass(frozen=True)
class Stuck:
    """A rank that can never go on, and why (one line)."""

    rank: int
    reason: str
    waits_for: tuple[int, ...]


@dataclass(frozen=True)
class Verdict:
    """The run is deadlocked: ``stuck`` ranks can never go on; ``culprits`` are the finished
    ranks that never did the part the stuck ranks wait for (``()`` for a pure cycle or a
    mismatch between waiting ranks)."""

    kind: str  # "missing", "mismatch" or "cycle"
    stuck: tuple[Stuck, ...]
    culprits: tuple[int, ...]

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.stuck]

    def reason(self, rank: int) -> str:
        return next((s.reason for s in self.stuck if s.rank == rank), "")


# ---------------------------------------------------------------------- deciding


def decide(views: Sequence[RankView], groups: Mapping[str, Sequence[int]]) -> Verdict | None:
    """The ranks that can never go on, or ``None`` when nothing is proven.

    The greatest set ``S`` of waiting (or blocked) ranks such that each waits for a part that
    a finished rank or a rank of ``S`` has not done: a finished rank never will, a rank of
    ``S`` cannot while it waits itself. Parts of a rank whose counts are unknown are taken as
    possibly done, so a verdict is never built on what was not seen.
    """
    by_rank = {v.rank: v for v in views}
    candidates = {
        v.rank
        for v in views
        if v.status == Status.BLOCKED or (v.status == Status.WAITING and v.wait)
    }
    mismatches = {r: _mismatch(by_rank[r], by_rank, groups) for r in candidates}
    stuck = set(candidates)
    why: dict[int, tuple[str, tuple[int, ...]]] = {}
    changed = True
    while changed:
        changed = False
        for r in sorted(stuck):
            found = mismatches[r] or _witnesses(by_rank[r], by_rank, stuck, groups)
            if found is None:
                stuck.discard(r)
                why.pop(r, None)
                changed = True
            else:
                why[r] = found
    if not stuck:
        return None
    finished = {v.rank for v in views if v.status in FINISHED}
    culprits = sorted({m for r in stuck for m in why[r][1] if m in finished})
    kind = "mismatch" if any(mismatches[r] for r in stuck) else "missing" if culprits else "cycle"
    return Verdict(
        kind,
        tuple(Stuck(r, why[r][0], why[r][1]) for r in sorted(stuck)),
        tuple(culprits),
    )


def _witnesses(
    view: RankView,
    ranks: Mapping[int, RankView],
    stuck: set[int],
    groups: Mapping[str, Sequence[int]],
) -> tuple[str, tuple[int, ...]] | None:
    """Why ``view`` can never go on, given that the ranks of ``stuck`` cannot; or ``None``."""
    if view.status == Status.BLOCKED:
        return _blocked_witnesses(view, ranks, groups)
    wait = view.wait
    assert wait is not None
    never: list[tuple[int, str]] = []
    for peer, done_by in _needs(view.rank, wait, groups):
        other = ranks.get(peer)
        if other is None or other.counts is None:
            continue  # not seen: possibly done
        if other.status not in FINISHED and peer not in stuck:
            continue
        if not done_by(other.counts):
            never.append((peer, _why_not(other, wait, view.rank)))
    if not never:
        return None
    head = f"waits in {wait.describe()} since {view.since:.2f}s"
    return f"{head}; " + "; ".join(text for _, text in never), tuple(p for p, _ in never)


def _needs(
    rank: int, wait: Op, groups: Mapping[str, Sequence[int]]
) -> list[tuple[int, _DonePredicate]]:
    """Each peer ``wait`` needs, and how to tell from the peer's counts that it did its part."""
    g, k, t = wait.group, wait.index, wait.tag
    if wait.kind == Kind.COLLECTIVE:
        return [(m, _CollectivesAtLeast(g, k)) for m in groups.get(g, ()) if m != rank]
    if wait.peer is None or wait.peer == ANY_SOURCE:
        return []  # a receive from any source: no one peer to prove it against
    if wait.kind == Kind.RECV:
        return [(wait.peer, _SentAtLeast(g, rank, t, k))]
    return [(wait.peer, _ReceivedAtLeast(g, rank, t, k))]  # gloo's send waits for the receive


@dataclass(frozen=True)
class _CollectivesAtLeast:
    group: str
    index: int

    def __call__(self, counts: Counts) -> bool:
        return counts.collectives_on(self.group) >= self.index


@dataclass(frozen=True)
class _SentAtLeast:
    group: str
    dst: int
    tag: int
    index: int

    def __call__(self, counts: Counts) -> bool:
        return counts.sent_to(self.group, self.dst, self.tag) >= self.index


@dataclass(frozen=True)
class _ReceivedAtLeast:
    group: str
    src: int
    tag: int
    index: int

    def __call__(self, counts: Counts) -> bool:
        return counts.received_from(self.group, self.src, self.tag) >= self.index


_DonePredicate = _CollectivesAtLeast | _SentAtLeast | _ReceivedAtLeast


def _why_not(other: RankView, wait: Op, rank: int) -> str:
    """``"rank 3 never entered it: it returned after 2 collectives on group 0"``."""
    assert other.counts is not None
    c = other.counts
    if other.status in FINISHED:
        state = "returned" if other.status == Status.RETURNED else "died"
        if wait.kind == Kind.COLLECTIVE:
            n = c.collectives_on(wait.group)
            return (
                f"rank {other.rank} never entered it: it {state} after {n} "
                f"collective{'s' if n != 1 else ''} on {wait.group_text()}"
            )
        if wait.kind == Kind.RECV:
            n = c.sent_to(wait.group, rank, wait.tag)
            return f"rank {other.rank} {state} having sent it {n} with tag {wait.tag}"
        n = c.received_from(wait.group, rank, wait.tag)
        return f"rank {other.rank} {state} having received {n} from it with tag {wait.tag}"
    theirs = f"in {other.wait.describe()}" if other.wait else f"at {other.where}"
    return f"rank {other.rank} has not done its part and waits itself, {theirs}"


def _blocked_witnesses(
    view: RankView, ranks: Mapping[int, RankView], groups: Mapping[str, Sequence[int]]
) -> tuple[str, tuple[int, ...]] | None:
    """A rank idle inside torch on something unseen (DDP's reducer, a functional collective)
    is stuck when it issued a collective on a group that a finished member left with fewer:
    that collective can never complete."""
    mine = view.counts
    if mine is None:
        return None
    for group, n in sorted(mine.collectives.items()):
        for m in groups.get(group, ()):
            other = ranks.get(m)
            if other is None or other.status not in FINISHED or other.counts is None:
                continue
            theirs = other.counts.collectives_on(group)
            if theirs < n:
                state = "returned" if other.status == Status.RETURNED else "died"
                on = _group_text(mine, group)
                return (
                    f"is blocked inside torch ({view.where}) having issued {n} collective"
                    f"{'s' if n != 1 else ''} on {on} (from Python or C++, e.g. "
                    f"DDP's gradient all-reduce); rank {m} {state} after {theirs}: the "
                    f"collective #{theirs + 1} can never complete",
                    (m,),
                )
    return None


def _group_text(counts: Counts, group: str) -> str:
    """A group known by its id only: named by the label of a collective issued there."""
    op = next((op for (g, _), op in counts.issued.items() if g == group and op.label), None)
    return f"group {group}" if op is None else op.label


def _mismatch(
    view: RankView, ranks: Mapping[int, RankView], groups: Mapping[str, Sequence[int]]
) -> tuple[str, tuple[int, ...]] | None:
    """Members that entered the same collective as a different operation or size."""
    wait = view.wait
    if view.status != Status.WAITING or wait is None or wait.kind != Kind.COLLECTIVE:
        return None
    for m in groups.get(wait.group, ()):
        other = ranks.get(m)
        if m == view.rank or other is None:
            continue
        theirs = _collective_of(other, wait.group, wait.index)
        if theirs is not None and not compatible(wait, theirs):
            doing = "waits in" if other.status == Status.WAITING else "did"
            return (
                f"waits in {wait.describe()} since {view.since:.2f}s; rank {m} {doing} that "
                f"collective as {theirs.shape_text()}"
                + (f" at {theirs.site}" if theirs.site else "")
                + ": the ranks called different collectives (or sizes) at the same point",
                (m,),
            )
    return None


def _collective_of(view: RankView, group: str, index: int) -> Op | None:
    if (
        view.wait is not None
        and view.wait.kind == Kind.COLLECTIVE
        and ((view.wait.group, view.wait.index) == (group, index))
    ):
        return view.wait
    if view.counts is not None:
        return view.counts.issued.get((group, index))
    return None


def compatible(a: Op, b: Op) -> bool:
    """Can ``a`` and ``b`` be the two sides of one collective?"""
    op = SAME_OP.get(a.op, a.op)
    if op != SAME_OP.get(b.op, b.op):
        return False
    if a.dtype and b.dtype and a.dtype != b.dtype:
        return False
    if op in SAME_SIZE and a.numel is not None and b.numel is not None:
        return a.numel == b.numel
    return True


def skipped_by(rank: int, wait: Op, members: Sequence[RankView]) -> list[tuple[int, str]]:
    """The members of ``wait``'s group whose counts show they skipped the collective that
    ``rank`` was waiting in when it died (gloo aborts a rank whose peer sent it another
    collective's data): each with the evidence, one line. A member that returned having
    issued fewer collectives on the group never entered it; one that waited in (or died in)
    the same collective by number as another operation, another size, or from another line
    called something else there. ``members``: a waiting member's ``wait``; a member that
    runs, with the collective it last waited on as ``wait`` (done); a finished one's counts.
    Members with no evidence are left out."""
    if wait.kind != Kind.COLLECTIVE:
        return []
    found: list[tuple[int, str]] = []
    others: list[tuple[int, Op]] = []  # members that did (or wait in) another collective there
    for v in members:
        if v.rank == rank:
            continue
        theirs = v.wait
        if v.status in FINISHED and v.counts is not None and theirs is None:
            n = v.counts.collectives_on(wait.group)
            if n < wait.index:
                state = "returned" if v.status == Status.RETURNED else "died"
                found.append(
                    (
                        v.rank,
                        f"rank {v.rank} never entered it: it {state} after {n} "
                        f"collective{'s' if n != 1 else ''} on {wait.group_text()}",
                    )
                )
                continue
            theirs = v.counts.issued.get((wait.group, wait.index))
        if theirs is None or theirs.kind != Kind.COLLECTIVE or theirs.group != wait.group:
            continue
        if theirs.index != wait.index:
            continue
        other_line = bool(theirs.site and wait.site and theirs.site != wait.site)
        if compatible(wait, theirs) and not other_line:
            continue
        others.append((v.rank, theirs))
        where = f" at {theirs.site}" if theirs.site else ""
        doing = "was in" if v.status == Status.WAITING else "did"
        found.append(
            (
                v.rank,
                f"rank {v.rank} {doing} that collective as {theirs.shape_text()}{where}: the "
                f"ranks disagree on which collective #{wait.index} on {wait.group_text()} is "
                f"(rank {v.rank} skipped one, or added one, before it)",
            )
        )
    return _odd_one_out(rank, wait, others, len(members)) or found


def _odd_one_out(
    rank: int, wait: Op, others: Sequence[tuple[int, Op]], n_members: int
) -> list[tuple[int, str]]:
    """When every other member of the group did one and the same collective there, and
    ``rank`` another, ``rank`` is the one that skipped or added one: gloo aborts whichever
    side reads the other's data first, often the rank that skipped (an empty rank returning
    early, then making the group's next collective). ``[]`` unless that is proven."""
    if len(others) < 2 or len(others) != n_members - 1:
        return []
    first = others[0][1]
    if any(not compatible(first, op) or op.site != first.site for _, op in others[1:]):
        return []
    where = f" at {first.site}" if first.site else ""
    ranks = ", ".join(str(r) for r, _ in others)
    return [
        (
            rank,
            f"rank {rank} is the odd one out: ranks {ranks} all did that collective as "
            f"{first.shape_text()}{where} (rank {rank} skipped one, or added one, before it)",
        )
    ]


# ---------------------------------------------------------------------- after the run


def unmatched(
    leftovers: Mapping[int, Iterable[Op]],
    counts: Mapping[int, Counts],
    groups: Mapping[str, Sequence[int]],
) -> dict[int, list[tuple[Op, str]]]:
    """Of the operations ranks left in flight when every rank had returned, those that can
    never complete, each with why: a collective some member never entered, a send nobody
    receives, a receive nobody sends. The others are matched: they complete by themselves."""
    out: dict[int, list[tuple[Op, str]]] = {}
    for rank, ops in leftovers.items():
        for op in ops:
            why = _unmatched_why(rank, op, counts, groups)
            if why:
                out.setdefault(rank, []).append((op, why))
    return out


def _unmatched_why(
    rank: int, op: Op, counts: Mapping[int, Counts], groups: Mapping[str, Sequence[int]]
) -> str:
    if op.kind == Kind.COLLECTIVE:
        missing = [
            m
            for m in groups.get(op.group, ())
            if m != rank and m in counts and counts[m].collectives_on(op.group) < op.index
        ]
        if missing:
            return f"rank {_ranks(missing)} never entered it"
        return ""
    if op.peer is None or op.peer == ANY_SOURCE or op.peer not in counts:
        return ""
    peer = counts[op.peer]
    if op.kind == Kind.SEND and peer.received_from(op.group, rank, op.tag) < op.index:
        return f"rank {op.peer} never received it"
    if op.kind == Kind.RECV and peer.sent_to(op.group, rank, op.tag) < op.index:
        return f"rank {op.peer} never sent it"
    return ""


def consistent(counts: Mapping[int, Counts], groups: Mapping[str, Sequence[int]]) -> bool:
    """Did the members of every group issue the same collectives, and every send meet its
    receive? Then the groups are in step and the next run may reuse them."""
    for group, members in groups.items():
        seen = {counts[m].collectives_on(group) for m in members if m in counts}
        if len(seen) > 1:
            return False
    sent: dict[tuple[str, int, int, int], int] = {}
    received: dict[tuple[str, int, int, int], int] = {}
    for rank, c in counts.items():
        for (g, dst, tag), n in c.sends.items():
            sent[(g, rank, dst, tag)] = n
        for (g, src, tag), n in c.recvs.items():
            if src == ANY_SOURCE:
                return False  # which sender it took is not known: start afresh
            received[(g, src, rank, tag)] = n
    return sent == received


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
