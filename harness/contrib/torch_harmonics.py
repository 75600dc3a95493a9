"""torch-harmonics' polar and azimuth groups, adopted from the harness's topology in one call.

``torch_harmonics.distributed`` keeps one polar and one azimuth process group in module
globals (``thd.init(polar, azimuth)``); its distributed SHTs, convolutions and transposes
read them at build and in every forward. A case whose model uses them calls, in ``build``::

    polar, azimuth = adopt_groups(topo)  # h x w = topo.mesh_shape(2), or adopt_groups(topo, h, w)

On every rank this builds the ``h x w`` process grid of each spatial group (every rank
creates every data group's subgroups, in the same order: ``Topology.grid``), hands this
rank's pair to ``thd.init``, and checks what torch-harmonics then answers
(``check_groups``). For the reference both groups are ``None``: the library's operators
run serially, so one model code path serves both. ``harness.adopt.undo`` (run after every
run, on every rank and for the reference) puts the library's previous groups back.

A model that calls ``thd.init`` itself is checked with ``check_groups(topo, h, w)`` after
it did: its groups must hold, in order, the ranks of the topology's grid (polar group: the
``h`` ranks of this rank's azimuth index, in polar order; azimuth group: the ``w`` ranks of
its polar index), within this rank's spatial group. Otherwise every rank raises the same
``GroupMismatch`` line naming the groups, the ranks and the fix (torch-harmonics' own
docstring builds them over the whole world, which is right only without data groups).

Tested with torch-harmonics 0.8.0 and 0.9.3. One private name: ``_IS_INITIALIZED`` in
``torch_harmonics.distributed.utils``, set by ``adopt_groups`` because 0.8's ``init``
assigns it without ``global`` (its ``is_initialized()`` stays ``False``), and restored by
``undo`` with both groups.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torch.distributed import ProcessGroup

from harness.adopt import GroupMismatch, check_group, on_undo
from harness.errors import ConfigError
from harness.topology import Topology

__all__ = ["TorchHarmonicsNotInstalled", "adopt_groups", "check_groups", "grid_ranks"]

#: what the library holds in ``torch_harmonics.distributed.utils`` (0.8.0 to 0.9.3)
_STATE = ("_POLAR_PARALLEL_GROUP", "_AZIMUTH_PARALLEL_GROUP", "_IS_INITIALIZED")


class TorchHarmonicsNotInstalled(ConfigError, ImportError):
    """torch-harmonics is not importable here: an ``ImportError`` and a ``ConfigError``."""


def _distributed() -> ModuleType:
    try:
        return importlib.import_module("torch_harmonics.distributed")
    except ImportError as exc:
        raise TorchHarmonicsNotInstalled(
            f"harness.contrib.torch_harmonics needs torch-harmonics ({exc}): install it with "
            'pip install "pytest-spatial-harness[sfno]" (torch-harmonics >= 0.8.0)'
        ) from exc


def _grid(topo: Topology, h: int | None, w: int | None) -> tuple[int, int]:
    """``(h, w)``: both given, one given (the other from the spatial size), or neither
    (``topo.mesh_shape(2)``: the harness's mesh, else all ranks polar)."""
    if topo.spatial_group is None:  # the reference runs the whole grid, whatever h and w
        return h or 1, w or 1
    if h is None and w is None:
        h, w = topo.mesh_shape(2)
    s = topo.spatial_size
    if h is None or w is None:
        given = h if h is not None else w
        assert given is not None
        if given < 1 or s % given:
            raise ConfigError(
                f"a {'h' if h is not None else 'w'}={given} process grid does not divide the "
                f"spatial group of {s} ranks; give h and w with h * w == {s}"
            )
        h, w = (given, s // given) if h is not None else (s // given, given)
    if h < 1 or w < 1 or h * w != s:
        raise ConfigError(
            f"torch-harmonics' process grid {h}x{w} has {h * w} ranks but the spatial group "
            f"has {s}; give h and w with h * w == {s} (or pass mesh= to the check)"
        )
    return h, w


def grid_ranks(
    topo: Topology, h: int | None = None, w: int | None = None
) -> tuple[list[int], list[int]]:
    """The global ranks torch-harmonics' polar and azimuth groups must hold on this rank, in
    group-rank order: ``Topology.grid``'s layout (spatial rank ``p * w + a``)."""
    h, w = _grid(topo, h, w)
    if topo.spatial_group is None:
        return [topo.rank], [topo.rank]  # the reference: no groups (a group of itself)
    base = topo.data_rank * topo.spatial_size
    p, a = divmod(topo.spatial_rank, w)
    return [base + i * w + a for i in range(h)], [base + p * w + j for j in range(w)]


def adopt_groups(
    topo: Topology, h: int | None = None, w: int | None = None
) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """Set torch-harmonics' polar and azimuth groups to the topology's ``h x w`` grid on this
    rank (``None`` for the reference), check them, and return them.

    Call it in ``build`` on every rank (it creates every data group's grid groups, once per
    default group). ``h`` and ``w`` default to ``topo.mesh_shape(2)``: set
    ``mesh_dims = 2`` on the case and the harness's layouts choose the grid. Undone by
    ``harness.adopt.undo`` (the harness runs it after every run): the library's previous
    groups come back.
    """
    thd = _distributed()
    h, w = _grid(topo, h, w)
    polar, azimuth = topo.grid(h, w)
    utils = thd.utils
    saved = {name: getattr(utils, name) for name in _STATE if hasattr(utils, name)}

    def restore() -> None:
        for name, value in saved.items():
            setattr(utils, name, value)

    on_undo(restore)
    thd.init(polar, azimuth)
    utils._IS_INITIALIZED = True  # 0.8's init leaves it False (no ``global``); 0.9's sets it
    check_groups(topo, h, w)
    return polar, azimuth


def check_groups(topo: Topology, h: int | None = None, w: int | None = None) -> None:
    """Raise one ``GroupMismatch`` (a ``ConfigError``), on every rank together, unless
    torch-harmonics' polar and azimuth groups hold the topology's ``h x w`` grid's ranks in
    order (sizes, ranks and order: the group rank is the block a rank computes).

    Collective over the world: call it on every rank, in the same order.
    """
    thd = _distributed()
    h, w = _grid(topo, h, w)
    polar, azimuth = grid_ranks(topo, h, w)
    found: list[tuple[str, GroupMismatch]] = []
    for name, group, ranks in (
        ("polar", thd.polar_group(), polar),
        ("azimuth", thd.azimuth_group(), azimuth),
    ):
        try:  # both checked on every rank, so every rank issues the same collectives
            check_group(group, topo, f"torch-harmonics' {name} group", of=ranks, ordered=True)
        except GroupMismatch as exc:
            found.append((name, exc))
    if found:
        raise _mismatch(found, h, w)


def _mismatch(found: list[tuple[str, GroupMismatch]], h: int, w: int) -> GroupMismatch:
    """One line for both groups: which differ, on which ranks, what they hold, the fix."""
    parts = []
    for name, exc in found:
        shown = sorted(exc.held)[:2]
        evidence = "; ".join(
            f"rank {r} holds {_text(exc.held[r])}, must hold {exc.expected[r]}" for r in shown
        )
        more = f" (and {len(exc.held) - len(shown)} more ranks)" if len(exc.held) > 2 else ""
        ranks = ", ".join(map(str, sorted(exc.held)))
        parts.append(f"its {name} group differs on rank {ranks}: {evidence}{more}")
    names = " and ".join(name for name, _ in found)
    first = found[0][1]
    return GroupMismatch(
        f"torch-harmonics' {names} {'groups are' if len(found) > 1 else 'group is'} not the "
        f"topology's {h}x{w} grid (polar group: this rank's column of {h}, azimuth group: "
        f"its row of {w}, in order, within its spatial group): "
        f"{'; '.join(parts)}; call harness.contrib.torch_harmonics.adopt_groups(topo) in "
        "build instead of thd.init, or build them with topo.grid(h, w)",
        f"torch-harmonics' {names} group",
        first.held,
        first.expected,
    )


def _text(ranks: list[int] | None) -> str:
    if ranks is None:
        return "no group (None)"
    return str(ranks) if ranks else "a group it is not a member of"
