"""The covering set of a layout sweep: few layouts that still show every layout-only bug.

A parallel bug shows on the layouts that have some feature: a split axis of 2 or of 3,
both axes split, uneven blocks, a rank owning nothing, data groups, an odd rank count. Each
layout is read as a handful of such features (``features``), each at one level; the
covering set (``covering``) holds, for every level and for every pair of levels of a
*world* feature (how the ranks are grouped: their count's parity, data groups) and a
*domain* feature (how the domain is cut: spatial ranks, each grid axis's split, both axes
split, blocks), the smallest layout (``Layout.order``) that has it. Nothing else.

Why these pairs: a bug of the domain's cut (a halo, a band's start, a reduction over a
grid axis) needs its domain level; a bug of the grouping (a gradient sync, a sampler) its
world level; the bugs that mix the two (a reduction over the world where the spatial group
was meant, a key per data group) need both at once. Pairs of two domain features (3 x 2
grids, uneven blocks on 3 ranks) or two world features (3 data groups) add the largest
layouts of a sweep for no bug of the catalogue; a ``harness.check_layouts(...,
exhaustive=True)`` nightly runs them.

Why the smallest layout of each: a bug that first shows on the smallest layout with some
level, or pair, is reported by the covering sweep at that very layout, the exhaustive
sweep's smallest failing one (the covering set is a subset, so nothing smaller fails).

Pure: torch-free, no ranks; a layout is anything with ``world_size``, ``spatial_size``,
``data_size``, ``mesh``, ``blocks`` and ``order`` (``harness.layouts.Layout``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

__all__ = ["WORLD", "Covering", "covering", "features", "pairs"]

#: the features of how the ranks are grouped; every other feature is of the domain's cut
WORLD = ("ranks", "data groups")


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
Level = tuple[str, str]


def _split(n: int) -> str:
    """A split's level: 1, 2, 3 (the first that does not halve), or more."""
    return str(n) if n <= 3 else ">3"


def features(layout: _Layout) -> dict[str, str]:
    """The layout's level of each feature.

    >>> from harness.layouts import Layout
    >>> features(Layout(4, 2, 2, (2, 1)))  # doctest: +NORMALIZE_WHITESPACE
    {'ranks': 'even', 'data groups': '>1', 'spatial ranks': '2', 'blocks': 'even',
     'axis 0': '2', 'axis 1': '1', 'both axes split': 'no'}
    """
    found = {
        "ranks": "odd" if layout.world_size % 2 else "even",
        "data groups": "1" if layout.data_size == 1 else ">1",
        "spatial ranks": _split(layout.spatial_size),
        "blocks": layout.blocks,
    }
    if len(layout.mesh) >= 2:  # one axis: its split is the spatial ranks'
        found.update({f"axis {i}": _split(n) for i, n in enumerate(layout.mesh)})
        found["both axes split"] = "yes" if sum(n > 1 for n in layout.mesh) >= 2 else "no"
    return found


def pairs(layout: _Layout) -> set[tuple[Level, Level]]:
    """Each (world level, domain level) pair the layout has."""
    have = features(layout)
    world = [(k, v) for k, v in have.items() if k in WORLD]
    domain = [(k, v) for k, v in have.items() if k not in WORLD]
    return set(itertools.product(world, domain))


class Covering:
    """The covering walk, one layout at a time, smallest first: ``wants(x)`` when ``x`` has
    a level or pair that no layout run so far had; ``ran(x)`` once it ran. A layout the case
    refused is not told to ``ran``: what it would have covered is still wanted, so the next
    layout with it runs (3 data groups refused by a batch of 2: then 4 data groups, if any
    layout has a level or pair only they have)."""

    def __init__(self) -> None:
        self.covered: set[tuple[Any, ...]] = set()

    def wants(self, layout: _Layout) -> bool:
        return bool(_has(layout) - self.covered)

    def ran(self, layout: _Layout) -> None:
        self.covered |= _has(layout)


def _has(layout: _Layout) -> set[tuple[Any, ...]]:
    return set(features(layout).items()) | pairs(layout)


def covering(candidates: Iterable[L]) -> list[L]:
    """The smallest of ``candidates`` with each level and each (world, domain) pair of
    levels that any candidate has, smallest first (where every layout runs: none refused).

    >>> from harness.layouts import layouts
    >>> [x.row + (f" d{x.data_size}" if x.data_size > 1 else "")
    ...  for x in covering(layouts(4, mesh_dims=1))]
    ['1', '1 d2', '2', '3', '2 d2', '4']
    """
    walk = Covering()
    chosen = []
    for x in sorted(candidates, key=lambda x: x.order):
        if walk.wants(x):  # the first layout with a level or pair is its smallest
            chosen.append(x)
            walk.ran(x)
    return chosen
