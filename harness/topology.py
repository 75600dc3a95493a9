"""Who is who in a partitioned run: world, spatial and data ranks and their groups.

Ranks of one spatial group are consecutive: spatial group ``g`` holds global ranks
``[g*S, (g+1)*S)``. Data group ``j`` holds the ranks with spatial rank ``j``, one from each
spatial group. Every rank creates every group, in the same order (gloo silently pairs the
wrong ranks otherwise), and groups are cached for the life of the default process group.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from harness.errors import ConfigError

# (id of the default group, key) -> groups. Cleared when the default group is destroyed,
# so a cached group can never outlive the process group it was made from.
_GROUP_CACHE: dict[tuple[int, tuple[Hashable, ...]], list[ProcessGroup]] = {}


def clear_group_cache() -> None:
    """Forget cached subgroups (the rank pool calls this when it destroys the default group)."""
    _GROUP_CACHE.clear()


def _default_group_id() -> int:
    return id(dist.group.WORLD)


def cached_groups(
    key: tuple[Hashable, ...], rank_lists: list[list[int]], *, sort_ranks: bool = True
) -> list[ProcessGroup]:
    """Create (once) one process group per list of global ranks, in list order, on every rank.

    Every rank of the world must call this with the same ``key`` and ``rank_lists`` in the
    same order. Returns the groups in the order given; a rank uses the ones it belongs to.
    With ``sort_ranks=False`` a group's ranks are numbered in list order, not sorted.
    """
    full_key = (_default_group_id(), key)
    groups = _GROUP_CACHE.get(full_key)
    if groups is None:
        groups = [dist.new_group(ranks=list(ranks), sort_ranks=sort_ranks) for ranks in rank_lists]
        _GROUP_CACHE[full_key] = groups
    return groups


def validate_sizes(world_size: int, spatial_size: int | None) -> int:
    """Return the spatial size to use for ``world_size`` ranks, or raise a ``ConfigError``.

    >>> validate_sizes(4, None)
    4
    >>> validate_sizes(4, 2)
    2
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an integer >= 1, got {world_size!r}")
    if spatial_size is None:
        return world_size
    if not isinstance(spatial_size, int) or spatial_size < 1:
        raise ConfigError(
            f"spatial_size must be an integer >= 1, got {spatial_size!r}; "
            f"use None for one spatial group over all {world_size} ranks"
        )
    if world_size % spatial_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"spatial_size={spatial_size} does not divide the world of {world_size} ranks; "
            f"choose one of {divisors}"
        )
    return spatial_size


def check_mesh(mesh: object, spatial_size: int) -> tuple[int, ...]:
    """``mesh`` as a tuple of ints whose product is ``spatial_size`` (``()`` for ``None``),
    or one ``ConfigError`` naming the problem and the fix.

    >>> check_mesh([2, 2], 4)
    (2, 2)
    """
    if mesh is None or (isinstance(mesh, tuple | list) and len(mesh) == 0):
        return ()
    given: tuple[object, ...] = tuple(mesh) if isinstance(mesh, tuple | list) else (mesh,)
    sizes = tuple(n for n in given if isinstance(n, int) and not isinstance(n, bool) and n >= 1)
    if len(sizes) != len(given):
        raise ConfigError(
            f"mesh={mesh!r}: a process grid is a tuple of integers >= 1, one per grid axis; "
            f"e.g. mesh=({spatial_size},) or mesh=(2, {spatial_size // 2}) "
            "when 2 divides the spatial group"
        )
    product = 1
    for n in sizes:
        product *= n
    if product != spatial_size:
        example = (spatial_size,) + (1,) * (len(sizes) - 1)
        raise ConfigError(
            f"mesh={sizes} holds {product} ranks but the spatial group has {spatial_size}; "
            f"give sizes whose product is {spatial_size}, e.g. mesh={example}"
        )
    return sizes


@dataclass(frozen=True, eq=False)
class Topology:
    """Where this process sits: world, spatial group and data group.

    The reference's topology (``Topology.single()``) has sizes 1, ranks 0 and groups
    ``None``; collectives treat a ``None`` group as "nothing to communicate".

    Fields (``S`` = ``spatial_size``, ``D`` = ``data_size``, world = ``S * D`` ranks):

    - ``world_size``, ``rank``: the whole run, and this process's global rank in it.
    - ``spatial_size``, ``spatial_rank``: ranks that split one sample's domain between them,
      and this rank's place among them (``rank % S``); the piece of the domain it owns.
    - ``spatial_group``: the process group of those ``S`` ranks (global ranks
      ``[g*S, (g+1)*S)``, listed by ``spatial_ranks``); collectives over the domain use it.
    - ``data_size``, ``data_rank``: how many spatial groups run side by side on different
      samples (data parallelism), and which one this rank's is (``rank // S``).
    - ``data_group``: the ``D`` ranks with this ``spatial_rank``, one from each spatial group
      (global ranks ``spatial_rank, spatial_rank + S, ...``): the group a gradient is
      averaged over after its sum over the spatial group, as DDP would (``sync_gradients``).
    - ``mesh``: the spatial group's process grid the harness asks for (``check_layouts``,
      ``check_equivalence(mesh=...)``), a tuple of ``SpatialCase.mesh_dims`` sizes whose
      product is ``S`` (``(2, 2)``: 2 polar x 2 azimuth ranks). ``()`` when none was asked
      for: the case chooses its own grid (a hard-coded ``h x w``). The reference's is ``()``
      too (it runs the whole domain on one process); ``mesh_shape(dims)`` answers
      ``(1,) * dims`` there.
    """

    world_size: int
    rank: int
    spatial_size: int
    spatial_rank: int
    spatial_group: ProcessGroup | None
    data_size: int
    data_rank: int
    data_group: ProcessGroup | None
    mesh: tuple[int, ...] = ()

    @classmethod
    def single(cls) -> Topology:
        """The reference's topology: one process, no groups."""
        return cls(1, 0, 1, 0, None, 1, 0, None)

    @classmethod
    def create(
        cls, spatial_size: int | None = None, mesh: tuple[int, ...] | None = None
    ) -> Topology:
        """This rank's topology inside an initialised default process group.

        ``spatial_size`` ranks form each spatial group (default: all ranks one group); the
        ``world_size / spatial_size`` spatial groups are data-parallel to each other.
        ``mesh``: the spatial group's process grid handed to the case (``Topology.mesh``).
        Must be called on every rank with the same arguments.
        """
        if not dist.is_initialized():
            raise ConfigError(
                "Topology.create() needs an initialised default process group; it runs on "
                "the ranks of a RankPool (spatial.run) or under torchrun. "
                "For the single-process reference use Topology.single()."
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        s = validate_sizes(world, spatial_size)
        grid = check_mesh(mesh, s)
        d = world // s
        spatial_lists = [list(range(g * s, (g + 1) * s)) for g in range(d)]
        data_lists = [list(range(j, world, s)) for j in range(s)]
        groups = cached_groups(("topology", world, s), spatial_lists + data_lists)
        return cls(
            world_size=world,
            rank=rank,
            spatial_size=s,
            spatial_rank=rank % s,
            spatial_group=groups[rank // s],
            data_size=d,
            data_rank=rank // s,
            data_group=groups[d + rank % s],
            mesh=grid,
        )

    def mesh_shape(self, dims: int) -> tuple[int, ...]:
        """The process grid in ``dims`` axes: ``mesh`` when the harness handed one, else
        all ranks on the first axis; ``(1,) * dims`` for the reference.

        >>> Topology.single().mesh_shape(2)
        (1, 1)
        """
        if self.mesh:
            if len(self.mesh) != dims:
                raise ConfigError(
                    f"the harness handed a {len(self.mesh)}-axis mesh {self.mesh} but the "
                    f"case asked for {dims} axes; set SpatialCase.mesh_dims = {dims}"
                )
            return self.mesh
        return (self.spatial_size,) + (1,) * (dims - 1)  # the reference's: (1, ..., 1)

    @property
    def is_reference(self) -> bool:
        """The single-process reference's topology (``Topology.single()``): no groups."""
        return self.spatial_group is None and self.world_size == 1

    @property
    def spatial_ranks(self) -> list[int]:
        """Global ranks of this rank's spatial group, in spatial-rank order."""
        start = self.data_rank * self.spatial_size
        return list(range(start, start + self.spatial_size))

    @property
    def data_ranks(self) -> list[int]:
        """Global ranks of this rank's data group, in data-rank order (one per spatial group)."""
        return list(range(self.spatial_rank, self.world_size, self.spatial_size))

    def grid(self, h: int, w: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
        """Split the spatial group into an ``h`` (polar) x ``w`` (azimuth) process grid.

        Spatial rank ``s`` sits at polar index ``s // w`` and azimuth index ``s % w``.
        Returns ``(polar_group, azimuth_group)`` of this rank; ``(None, None)`` for the
        reference, whatever ``h`` and ``w`` (it runs the whole grid on one process), so one
        ``build`` serves both.

        >>> Topology.single().grid(2, 2)
        (None, None)
        """
        if h < 1 or w < 1:
            raise ConfigError(f"process grid {h}x{w}: h and w must be >= 1")
        if self.spatial_group is None and self.spatial_size == 1:
            return None, None
        if h * w != self.spatial_size:
            raise ConfigError(
                f"process grid {h}x{w} has {h * w} ranks but the spatial group has "
                f"{self.spatial_size}; choose h*w == {self.spatial_size}"
            )
        if self.spatial_group is None:
            return None, None
        s = self.spatial_size
        polar_lists, azimuth_lists = [], []
        for g in range(self.data_size):
            base = g * s
            polar_lists += [[base + p * w + a for p in range(h)] for a in range(w)]
            azimuth_lists += [[base + p * w + a for a in range(w)] for p in range(h)]
        groups = cached_groups(("grid", self.world_size, s, h, w), polar_lists + azimuth_lists)
        p_idx, a_idx = divmod(self.spatial_rank, w)
        polar = groups[self.data_rank * w + a_idx]
        azimuth = groups[len(polar_lists) + self.data_rank * h + p_idx]
        return polar, azimuth

    def grid_position(self, h: int, w: int) -> tuple[int, int]:
        """(polar index, azimuth index) of this rank in an ``h`` x ``w`` grid."""
        return divmod(self.spatial_rank, w) if self.spatial_group is not None else (0, 0)
