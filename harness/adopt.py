"""Hand the harness's world and groups to a model that owns its own, and take them back.

Many models do not take process groups as arguments: they build them, or look them up in a
library that holds them for the whole process. To run such a model on the harness's ranks,
its adapter *adopts* the harness's groups into that library in ``build`` and undoes it in
``teardown`` (the warm ranks serve the next test):

- ``adopt_distributed_manager(topo)``: physicsnemo's ``DistributedManager`` (used by
  ACE/fme's vendored copy and NVIDIA makani) believes it initialised the harness's world,
  so it never calls ``init_process_group`` (nor destroys the group at exit); the harness's
  spatial and data groups are registered under names ``manager.group(name)`` answers.
- ``device_mesh(topo)``: a ``DeviceMesh`` over the harness's data x spatial groups
  (``DeviceMesh.from_group``), for DTensor code; no new groups are made.
- ``patch(owner, name, value)``: any module-level or class-level attribute (a module that
  caches its groups in a global), restored by ``undo``; ``on_undo(action)`` for anything
  else.

Every adoption pushes its undo onto one stack per process; ``undo()`` runs it, last first.
The harness also runs it after every run (after ``teardown``, on every rank and for the
reference), down to where the run began, so an adoption never outlives its run.

And one check for every model that builds its own groups: ``check_group(group, topo,
name)`` raises one ``GroupMismatch`` line, on every rank together, when the group does not
hold the ranks the topology says (the model would compute on different ranks than the
harness partitions for: its verdict would be about a layout nobody asked for).

Nothing here imports physicsnemo until asked to adopt into it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from harness.errors import ConfigError
from harness.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GroupMismatch",
    "adopt_distributed_manager",
    "adopted",
    "check_group",
    "device_mesh",
    "group_ranks",
    "on_undo",
    "patch",
    "pending",
    "undo",
]

_PHYSICSNEMO = "pip install nvidia-physicsnemo"

# ---------------------------------------------------------------------- the undo stack

_UNDO: list[Callable[[], None]] = []
_ABSENT = object()


def on_undo(action: Callable[[], None]) -> None:
    """Run ``action()`` at the next ``undo`` (after every later adoption's undo)."""
    _UNDO.append(action)


def patch(owner: object, name: str, value: object) -> None:
    """Set ``owner.name`` (a module, a class or an object) to ``value`` until ``undo``.

    The old value is kept as stored (``vars(owner)``), so a class's ``staticmethod`` comes
    back as a ``staticmethod``; an attribute that was not set on ``owner`` itself (absent,
    or inherited) is deleted again.
    """
    old = vars(owner).get(name, _ABSENT)

    def restore() -> None:
        if old is _ABSENT:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, old)

    _UNDO.append(restore)
    setattr(owner, name, value)


def pending() -> int:
    """How many adoptions ``undo`` would undo (the harness records it when a run begins)."""
    return len(_UNDO)


def undo(to: int = 0) -> None:
    """Undo every adoption made since the stack held ``to`` entries, the last first.

    Every undo runs even if one raises; the first error is raised after the last.
    """
    first: BaseException | None = None
    while len(_UNDO) > to:
        action = _UNDO.pop()
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the others must still be undone
            first = first or exc
    if first is not None:
        raise first


@contextmanager
def adopted() -> Iterator[None]:
    """``with adopted(): ...``: undo what the block adopted when it ends, however it ends."""
    depth = pending()
    try:
        yield
    finally:
        undo(depth)


# ---------------------------------------------------------------------- physicsnemo


def adopt_distributed_manager(
    topo: Topology,
    manager: type | None = None,
    *,
    device: torch.device | str = "cpu",
    groups: Mapping[str, str] | None = None,
) -> type:
    """Make physicsnemo's ``DistributedManager`` (or ``manager``, a class of the same
    design: its state in the class dict ``_shared_state``) hold the harness's world.

    On a rank the manager is initialised on the harness's default group: rank, world size,
    ``distributed`` and ``device`` are the harness's, and its ``initialize()`` returns at
    once (it would call ``init_process_group``, and its ``cleanup`` destroy the harness's
    group). For the reference it is initialised as one process, as physicsnemo does
    without a launcher. ``groups`` names the harness's groups for ``manager.group(name)``:
    ``{"spatial": "spatial", "data": "data"}`` (the default) registers
    ``topo.spatial_group`` as ``"spatial"`` and ``topo.data_group`` as ``"data"``; keys are
    the model's names, values ``"spatial"``, ``"data"`` or ``"world"``.

    ``undo`` puts the manager's whole state back as it was. Returns the manager class.
    """
    manager = _physicsnemo_manager() if manager is None else manager
    state = _shared_state(manager)
    names = {"spatial": "spatial", "data": "data"} if groups is None else dict(groups)
    chosen = {name: _topology_group(topo, which) for name, which in names.items()}
    saved = dict(state)

    def restore() -> None:
        state.clear()  # in place: every manager instance's __dict__ is this dict
        state.update(saved)

    on_undo(restore)
    dev = torch.device(device)
    world = not topo.is_reference and dist.is_initialized()
    state.update(
        _is_initialized=True,
        _distributed=world and topo.world_size > 1,
        _rank=topo.rank,
        _world_size=topo.world_size,
        # the pool's ranks are one machine's processes; a launcher says which one this is
        _local_rank=int(os.environ.get("LOCAL_RANK", topo.rank)),
        _device=dev,
        _cuda=dev.type == "cuda",
        _initialization_method="harness",
        # the reference has no groups: group(name) answers None, which the model's
        # collectives take for "no group" as the harness's do
        _groups=chosen,
        _group_names={g: n for n, g in chosen.items() if g is not None},
        _group_ranks={n: [topo.rank] if g is None else group_ranks(g) for n, g in chosen.items()},
    )
    return manager


def _physicsnemo_manager() -> type:
    try:
        from physicsnemo.distributed import DistributedManager
    except ImportError as exc:
        raise ConfigError(
            f"adopt_distributed_manager needs physicsnemo's DistributedManager ({exc}): "
            f"install it ({_PHYSICSNEMO}) or pass the manager class (e.g. fme's vendored "
            "fme.core.distributed.external.pnd_manager.DistributedManager)"
        ) from exc
    return cast(type, DistributedManager)


def _shared_state(manager: type) -> dict[str, object]:
    state = getattr(manager, "_shared_state", None)
    if not isinstance(state, dict):
        raise ConfigError(
            f"{manager!r} keeps no _shared_state dict: adopt_distributed_manager fills "
            "physicsnemo's DistributedManager (or a class of its design); adopt other "
            "libraries' state with harness.adopt.patch"
        )
    return state


def _topology_group(topo: Topology, which: str) -> ProcessGroup | None:
    if which == "spatial":
        return topo.spatial_group
    if which == "data":
        return topo.data_group
    if which == "world":
        return None if topo.is_reference else dist.group.WORLD
    raise ConfigError(f"unknown topology group {which!r}: name one of 'spatial', 'data' or 'world'")


# ---------------------------------------------------------------------- DeviceMesh


def device_mesh(
    topo: Topology,
    *,
    device_type: str = "cpu",
    names: tuple[str, str] = ("data", "spatial"),
) -> DeviceMesh | None:
    """A 2-D ``DeviceMesh`` (data x spatial) over the harness's own groups, or ``None`` for
    the reference (a ``DeviceMesh`` needs a process group).

    Row ``g`` of the mesh is spatial group ``g`` (consecutive ranks), so
    ``mesh[names[1]].get_group()`` is ``topo.spatial_group`` and ``mesh[names[0]]``'s group
    is ``topo.data_group``: DTensor code placed on it communicates on the harness's groups.
    A mesh holds no process-wide state, so there is nothing to undo.
    """
    if topo.spatial_group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(topo.world_size).reshape(topo.data_size, topo.spatial_size)
    # Topology.create makes the spatial and the data groups together: both are here
    groups = cast("list[ProcessGroup]", [topo.data_group, topo.spatial_group])
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


# ---------------------------------------------------------------------- the group check


class GroupMismatch(ConfigError):
    """A group the model built does not hold the ranks the topology says.

    ``held`` and ``expected`` map each mismatching rank to its group's global ranks and to
    the topology's; ``held[rank]`` is ``None`` where the model has no group.
    """

    def __init__(
        self,
        message: str,
        name: str,
        held: dict[int, list[int] | None],
        expected: dict[int, list[int]],
    ) -> None:
        super().__init__(message)
        self.name, self.held, self.expected = name, held, expected

    def __reduce__(self) -> tuple[object, ...]:  # crosses from the ranks whole
        return (type(self), (str(self), self.name, self.held, self.expected))


def group_ranks(group: ProcessGroup | None) -> list[int] | None:
    """The global ranks of ``group`` in group-rank order; ``[]`` on a rank that is not a
    member (``new_group`` hands non-members a placeholder); ``None`` for no group."""
    if group is None:
        return None
    placeholder: object = dist.GroupMember.NON_GROUP_MEMBER  # an int, not a group
    if group is placeholder:
        return []
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def _expected(topo: Topology, of: str | Sequence[int]) -> list[int]:
    if not isinstance(of, str):
        return [int(r) for r in of]
    if of == "spatial":
        return topo.spatial_ranks
    if of == "data":
        return topo.data_ranks
    if of == "world":
        return list(range(topo.world_size))
    raise ConfigError(
        f"check_group(of={of!r}): name the topology's 'spatial', 'data' or 'world' group, "
        "or give the global ranks the group must hold"
    )


def check_group(
    group: ProcessGroup | None,
    topo: Topology,
    name: str = "the model's group",
    *,
    of: str | Sequence[int] = "spatial",
    ordered: bool = False,
) -> None:
    """Raise ``GroupMismatch`` unless ``group`` holds the ranks the topology says.

    ``of`` is what it must hold: ``"spatial"`` (``topo.spatial_ranks``), ``"data"``
    (``topo.data_ranks``), ``"world"``, or the global ranks themselves (a finer group of the
    model's own, e.g. one row of its process grid). ``ordered=True`` also requires the
    group's ranks in that order (group rank ``i`` is the ``i``-th); by default only the set
    matters, since shards are placed by global position, not by group rank.

    On the ranks this is collective over the world (call it on every rank, in the same
    order): every rank learns every rank's verdict and all raise the same one line, so one
    rank's mismatch cannot leave the others waiting in the model's first collective (that
    agreement is the harness's talk: the ``vacuous`` rule does not count it). For
    the reference (no process group) ``group`` must be ``None`` or a group of one rank.
    """
    expected_here = _expected(topo, of)  # a wrong ``of`` fails the reference already
    if topo.is_reference or not dist.is_initialized():
        alone = group_ranks(group) if group is not None and dist.is_initialized() else None
        if group is not None and alone != [topo.rank]:
            raise GroupMismatch(
                f"{name} on the reference holds ranks {alone if alone is not None else '?'}, "
                "but the reference runs on one process with no groups: build the group only "
                "when topo.spatial_group is not None (and pass None to the model otherwise)",
                name,
                {topo.rank: alone},
                {topo.rank: []},
            )
        return
    mine = (group_ranks(group), expected_here)
    verdicts = [mine] * topo.world_size  # placeholders: the gather fills every slot
    before = _operations_so_far()
    dist.all_gather_object(verdicts, mine)  # decided together: every rank sees every rank
    _CHECK_OPERATIONS[0] += _operations_so_far() - before
    held: dict[int, list[int] | None] = {}
    expected: dict[int, list[int]] = {}
    for rank, (h, e) in enumerate(verdicts):
        if not _holds(h, e, rank, ordered):
            held[rank], expected[rank] = h, e
    if held:
        raise GroupMismatch(_mismatch_line(name, of, held, expected, ordered), name, held, expected)


#: operations ``check_group`` issued on this rank: the harness's, not the model's (the
#: ``vacuous`` rule asks whether the model communicated)
_CHECK_OPERATIONS = [0]


def check_operations() -> int:
    """How many operations ``check_group`` has issued on this rank so far."""
    return _CHECK_OPERATIONS[0]


def _operations_so_far() -> int:
    from harness._base.compat import group_sequence_numbers

    return sum(seq for seq, _ in group_sequence_numbers().values())


def _holds(held: list[int] | None, expected: list[int], rank: int, ordered: bool) -> bool:
    if held is None:  # no group: right only where the group would hold this rank alone
        return expected == [rank]
    return held == expected if ordered else sorted(held) == sorted(expected)


def _mismatch_line(
    name: str,
    of: str | Sequence[int],
    held: dict[int, list[int] | None],
    expected: dict[int, list[int]],
    ordered: bool,
) -> str:
    """One line: which group, where it differs, what it holds, what it must hold, the fix."""
    what = f"the topology's {of} group" if isinstance(of, str) else "the ranks asked for"
    shown = sorted(held)[:2]
    evidence = "; ".join(
        f"rank {r} holds {_ranks_text(held[r])}, {what} is {expected[r]}" for r in shown
    )
    more = f" (and {len(held) - len(shown)} more ranks)" if len(held) > len(shown) else ""
    order = " in this order" if ordered else ""
    source = {"spatial": "topo.spatial_ranks", "data": "topo.data_ranks"}.get(str(of), "")
    build = f"build it from {source}, or " if source else ""
    fix = f"{build}hand the model the harness's own group (harness.adopt)"
    ranks = ", ".join(map(str, sorted(held)))
    return (
        f"{name} does not hold the ranks the topology says{order} on rank {ranks}: "
        f"{evidence}{more}; {fix}"
    )


def _ranks_text(ranks: list[int] | None) -> str:
    if ranks is None:
        return "no group (None)"
    if not ranks:
        return "a group it is not a member of"
    return str(ranks)
