"""The covering set of a layout sweep: few layouts that still show every layout-only bug.

A parallel bug shows on the layouts that have some feature: a split axis of 2 or of 3 or
of more, both axes split, uneven blocks, a rank owning nothing, data groups, an odd rank
count. Each layout is read as a handful of such features (``features``), each at one level;
the covering set (``covering``) holds the smallest layout (``Layout.order``) with each level
that any layout of the sweep has. Nothing else.

Why the smallest layout of each: a bug that first shows on the smallest layout with some
level is reported by the covering sweep at that very layout, the exhaustive sweep's
smallest failing one (the covering set is a subset, so nothing smaller fails).

Why levels and not pairs of levels: a bug of the domain's cut (a halo, a band's start, a
ring neighbour, a reduction over one axis) needs its domain level, a bug of the grouping (a
gradient sync, a sampler) its world level, and for every fault of the catalogue and of the
held-out stencil the smallest layout with its one level is where the exhaustive sweep first
fails (``tests/distributed/test_layouts_covering.py``). The one mix of two features that
real code gets wrong is how a rank's index splits into its data index and its spatial
index (``rank // spatial_size`` against ``rank % data_size``): the two readings agree
until data groups sit beside a split domain, so that is a level of its own
(``data groups``: ``"beside a split"``). The smallest layout of each other pair of levels
(data groups with each axis's split, an odd count with uneven blocks) added a third of a
sweep's cost for no bug of the catalogue; an ``exhaustive=True`` nightly runs them.

Pure: torch-free, no ranks; a layout is anything with ``world_size``, ``spatial_size``,
``data_size``, ``mesh``, ``blocks`` and ``order`` (``harness.layouts.Layout``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

__all__ = ["Covering", "covering", "features"]


class _Layout(Protocol):
    @property
    def world_size(self) -> int: ...
    @property
    def spatial_size(self) -> int: ...
    @property
    def data_size(self) -> int: ...
    @property
    def mesh(self) -> tuple[int, ...]: ...
    @property
    def blocks(self) -> str: ...
    @property
    def order(self) -> tuple[Any, ...]: ...


L = TypeVar("L", bound=_Layout)


def _split(n: int) -> str:
    """A split's level: 1, 2, 3 (the first that does not halve), or more."""
    return str(n) if n <= 3 else ">3"


def features(layout: _Layout) -> dict[str, str]:
    """The layout's level of each feature.

    >>> from harness.layouts import Layout
    >>> features(Layout(4, 2, 2, (2, 1)))  # doctest: +NORMALIZE_WHITESPACE
    {'ranks': 'even', 'data groups': 'beside a split', 'spatial ranks': '2', 'blocks': 'even',
     'axis 0': '2', 'axis 1': '1', 'both axes split': 'no'}
    """
    found = {
        "ranks": "odd" if layout.world_size % 2 else "even",
        "data groups": _groups(layout),
        "spatial ranks": _split(layout.spatial_size),
        "blocks": layout.blocks,
    }
    if len(layout.mesh) >= 2:  # one axis: its split is the spatial ranks'
        found.update({f"axis {i}": _split(n) for i, n in enumerate(layout.mesh)})
        found["both axes split"] = "yes" if sum(n > 1 for n in layout.mesh) >= 2 else "no"
    return found


def _groups(layout: _Layout) -> str:
    """``"1"``; ``"replicas"``: data groups of an unsplit domain; ``"beside a split"``:
    data groups of a split one, where a rank's data and spatial indices both vary."""
    if layout.data_size == 1:
        return "1"
    return "beside a split" if layout.spatial_size > 1 else "replicas"


class Covering:
    """The covering walk, one layout at a time, smallest first: ``wants(x)`` when ``x`` has
    a level that no layout run so far had; ``ran(x)`` once it ran. A layout the case
    refused is not told to ``ran``: what it would have covered is still wanted, so the next
    layout with it runs (3 data groups refused by a batch of 2: then 4 data groups, if any
    layout has a level or pair only they have)."""

    def __init__(self) -> None:
        self.covered: set[tuple[str, str]] = set()

    def wants(self, layout: _Layout) -> bool:
        return bool(_has(layout) - self.covered)

    def ran(self, layout: _Layout) -> None:
        self.covered |= _has(layout)


def _has(layout: _Layout) -> set[tuple[str, str]]:
    return set(features(layout).items())


def covering(candidates: Iterable[L]) -> list[L]:
    """The smallest of ``candidates`` with each level that any candidate has, smallest
    first (where every layout runs: none refused).

    >>> from harness.layouts import layouts
    >>> [x.row + (f" d{x.data_size}" if x.data_size > 1 else "")
    ...  for x in covering(layouts(4, mesh_dims=1))]
    ['1', '1 d2', '2', '3', '2 d2', '4']
    """
    walk = Covering()
    chosen = []
    for x in sorted(candidates, key=lambda x: x.order):
        if walk.wants(x):  # the first layout with a level is its smallest
            chosen.append(x)
            walk.ran(x)
    return chosen
