"""Where on the globe the partitioned run differs: error maps with the partition drawn on top.

Two pictures, one per partition family:

- ``plot_latlon_error``: an equirectangular image of ``|partitioned - reference|`` on the
  lat x lon grid (north at the top when the case declares its latitudes), the ranks' block
  boundaries drawn and each block labelled with its rank;
- ``plot_healpix_error``: the same for HEALPix cells (NESTED), in healpy's Mollweide
  projection, with the boundaries between the ranks' cell ranges drawn and a second panel
  showing which rank owns each cell;
- ``plot_positions_error``: any other one-dimensional field, the error per position over a
  strip of the rank owning each position.

``plot_field_error`` picks one for a failing field of a report (``FieldError``): every field
gets a map, whatever its layout, each level of a multi-level model at its own nside.

Both draw on a ``matplotlib.figure.Figure`` with the Agg canvas: no display, no pyplot, and
the process's matplotlib backend is left alone (a notebook or a test session keeps its own).
matplotlib is imported only when a plot is made (``pip install matplotlib``, or
``pytest-spatial-harness[plots]``). Both save a PNG and return its path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from itertools import accumulate
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from harness.errors import ConfigError
from harness.partition import CellPartition

if TYPE_CHECKING:
    from healpy.projector import MollweideProj
    from matplotlib.axes import Axes
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

    from harness._records.run import FieldError

__all__ = ["plot_field_error", "plot_healpix_error", "plot_latlon_error", "plot_positions_error"]

_CMAP = "magma_r"  # zero error is pale yellow; the larger the error, the darker
_NONFINITE = "#00c000"  # NaN or inf differences: a colour the error colormap never uses
_BOUNDARY = "#1f77b4"


def new_figure(width: float, height: float) -> Figure:
    """A Figure on the Agg canvas (no pyplot, no global backend switch)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            "error maps need matplotlib, which is not installed: "
            "pip install matplotlib (or pytest-spatial-harness[plots])"
        ) from exc
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _sizes(name: str, sizes: Iterable[float]) -> list[int]:
    try:
        values = [int(s) for s in sizes]
        exact = all(int(s) == s and s >= 0 for s in sizes)
    except (TypeError, ValueError):
        values, exact = [], False
    if not values or not exact:
        raise ConfigError(
            f"{name} must be a non-empty list of non-negative integers (rows or columns per "
            f"rank), got {sizes!r}; e.g. LatLonPartition(...).{name}"
        )
    return values


def _scale(values: np.ndarray) -> tuple[float, str]:
    """(colour scale maximum, a note on the values) for an error array."""
    finite = values[np.isfinite(values)]
    vmax = float(finite.max()) if finite.size else 0.0
    bad = int(values.size - finite.size)
    note = f"max |Δ| {vmax:.3g}"
    if bad:
        note += f", {bad} non-finite (green)"
    return (vmax if vmax > 0 else 1.0), note


def _colormap() -> Colormap:
    from matplotlib import colormaps

    return colormaps[_CMAP].with_extremes(bad=_NONFINITE)


def _rank_label(ax: Axes, x: float, y: float, rank: int, *, fontsize: int) -> None:
    """A boxed "rank N" at (x, y), in the colour of the rank boundaries."""
    ax.text(
        x,
        y,
        f"rank {rank}",
        ha="center",
        va="center",
        fontsize=fontsize,
        color=_BOUNDARY,
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": _BOUNDARY, "alpha": 0.8},
    )


def plot_latlon_error(
    error: npt.ArrayLike,
    path: str | os.PathLike[str],
    *,
    lat_sizes: list[int],
    lon_sizes: list[int],
    title: str,
    latitudes: npt.ArrayLike | None = None,
) -> Path:
    # long: one figure drawn top to bottom; split, its layout would scatter over helpers
    """Save an equirectangular map of ``error`` with the ranks' blocks drawn; return the path.

    ``error`` is a (nlat, nlon) array of ``|partitioned - reference|``. ``lat_sizes`` and
    ``lon_sizes`` are the rows and columns per polar and azimuth rank
    (``LatLonPartition.lat_sizes`` / ``.lon_sizes``); block ``(p, a)`` is spatial rank
    ``p * len(lon_sizes) + a``. Non-finite differences are drawn in green. ``latitudes``
    (degrees, one per row) puts north at the top whichever way the rows run and labels the
    axis in degrees; without them row 0 is drawn at the top and the axis says so.
    """
    values = np.abs(np.asarray(error, dtype=np.float64))
    lats, lons = _sizes("lat_sizes", lat_sizes), _sizes("lon_sizes", lon_sizes)
    nlat, nlon = sum(lats), sum(lons)
    if values.shape != (nlat, nlon):
        raise ConfigError(
            f"plot_latlon_error: error has shape {values.shape} but lat_sizes {lats} and "
            f"lon_sizes {lons} describe a {nlat}x{nlon} grid; pass the (nlat, nlon) field "
            "(one sample and channel) of the partition that produced it"
        )
    lat_off, lon_off = [0, *accumulate(lats)], [0, *accumulate(lons)]
    vmax, note = _scale(values)

    width = 10.0
    fig = new_figure(width, max(3.0, 0.85 * width * nlat / nlon + 1.2))
    ax = fig.add_subplot()
    # cell (i, j) covers [j, j+1] x [i, i+1]: rank boundaries fall on cell edges
    image = ax.imshow(
        np.ma.masked_invalid(values),
        cmap=_colormap(),
        vmin=0.0,
        vmax=vmax,
        extent=(0, nlon, nlat, 0),
        interpolation="nearest",
        aspect="auto" if nlon > 4 * nlat or nlat > 4 * nlon else "equal",
    )
    for y in lat_off[1:-1]:
        ax.axhline(y, color=_BOUNDARY, linewidth=1.5)
    for x in lon_off[1:-1]:
        ax.axvline(x, color=_BOUNDARY, linewidth=1.5)
    for p in range(len(lats)):
        for a in range(len(lons)):
            if not (lats[p] and lons[a]):
                continue
            _rank_label(
                ax,
                (lon_off[a] + lon_off[a + 1]) / 2,
                (lat_off[p] + lat_off[p + 1]) / 2,
                p * len(lons) + a,
                fontsize=9,
            )
    worst = _worst(values)
    if worst is not None:
        i, j = np.unravel_index(worst, values.shape)
        p = int(np.searchsorted(lat_off, i, side="right") - 1)
        a = int(np.searchsorted(lon_off, j, side="right") - 1)
        ax.plot(j + 0.5, i + 0.5, marker="x", color="#00a0ff", markersize=10, mew=2)
        note += f" at (lat {i}, lon {j}) on rank {p * len(lons) + a}"
    ax.set_xlim(0, nlon)
    _orient(ax, nlat, latitudes)
    ax.set_xlabel("longitude index")
    ax.set_title(f"{title}\n{note}", fontsize=11)
    fig.colorbar(image, ax=ax, label="|partitioned − reference|", shrink=0.9)
    return save_figure(fig, path)


def _orient(ax: Axes, nlat: int, latitudes: npt.ArrayLike | None) -> None:
    """North at the top when the latitudes say where north is; row 0 at the top otherwise."""
    if latitudes is None:
        ax.set_ylim(nlat, 0)
        ax.set_ylabel("latitude row (row 0 at the top; declare SpatialCase.latitudes to orient)")
        return
    lat = np.asarray(latitudes, dtype=np.float64).reshape(-1)
    if lat.shape != (nlat,):
        raise ConfigError(
            f"plot_latlon_error: {lat.size} latitudes for a grid of {nlat} rows; give one "
            "latitude (degrees) per row"
        )
    north_first = lat[0] >= lat[-1]
    ax.set_ylim(*((nlat, 0) if north_first else (0, nlat)))
    ticks = sorted({0, nlat // 2, nlat - 1})
    ax.set_yticks([t + 0.5 for t in ticks])
    ax.set_yticklabels([f"{lat[t]:.0f}°" for t in ticks])
    ax.set_ylabel("latitude (north at the top)")


def _worst(values: np.ndarray) -> int | None:
    """Flat index of the largest error (a non-finite one first); None if all are zero."""
    bad = ~np.isfinite(values)
    if bad.any():
        return int(np.flatnonzero(bad)[0])
    if not values.size or values.max() <= 0:
        return None
    return int(values.argmax())


def plot_healpix_error(
    error: npt.ArrayLike,
    path: str | os.PathLike[str],
    *,
    bounds: Sequence[int],
    title: str,
) -> Path:
    # long: one figure, two panels (error, owning rank), drawn top to bottom
    """Save a Mollweide map of ``error`` with the ranks' cell ranges drawn; return the path.

    ``error`` is a (npix,) array of ``|partitioned - reference|`` per HEALPix cell in NESTED
    order; ``bounds`` the ``ranks + 1`` range bounds (``CellPartition.bounds``: rank ``r``
    owns cells ``bounds[r]:bounds[r+1]``, empty ranges allowed). Left: the error, with the
    boundaries between ranks drawn and each rank labelled; right: the owning rank per cell.
    Non-finite differences are drawn in green.
    """
    import healpy as hp
    from healpy.projector import MollweideProj

    values = np.abs(np.asarray(error, dtype=np.float64))
    if values.ndim != 1:
        raise ConfigError(
            f"plot_healpix_error: error must be 1-D (one value per cell), got shape "
            f"{values.shape}; pass one sample and channel of the field"
        )
    try:
        nside = int(hp.npix2nside(values.size))
    except ValueError:
        nside = 0
    if nside < 1:
        raise ConfigError(
            f"plot_healpix_error: {values.size} values is not a HEALPix map "
            "(12 * nside**2 cells); pass one value per cell"
        )
    part = CellPartition(nside, tuple(bounds))  # validates bounds against npix
    vmax, note = _scale(values)
    empty = [r for r, n in enumerate(part.sizes) if n == 0]
    fig = new_figure(15.0, 4.8)  # before any other matplotlib import: a clear error if missing
    from matplotlib.colors import BoundaryNorm, ListedColormap, to_rgba

    # healpy's Mollweide projection, geographic convention (east to the right)
    proj = MollweideProj(xsize=800, flipconv="geo")
    cells = proj.projmap(
        np.arange(part.npix, dtype=np.float64),
        lambda x, y, z: hp.vec2pix(nside, x, y, z, nest=True),
    )
    inside = np.isfinite(cells)
    cell_img = np.where(inside, cells, 0).astype(np.int64)
    owner = np.asarray(part.rank_of(np.arange(part.npix)))
    rank_img = np.where(inside, owner[cell_img], np.nan)
    extent = proj.get_extent()

    ax_err, ax_rank = fig.subplots(1, 2, width_ratios=[1.25, 1])
    # outside the ellipse: white; a non-finite error: green, drawn over it
    err_img = np.where(inside, values[cell_img], np.nan)
    image = ax_err.imshow(
        np.ma.masked_invalid(err_img),
        cmap=_colormap().with_extremes(bad="white"),
        vmin=0.0,
        vmax=vmax,
        extent=extent,
        origin="lower",
        interpolation="nearest",
    )
    bad = inside & ~np.isfinite(err_img)
    if bad.any():
        overlay = np.zeros((*bad.shape, 4))
        overlay[bad] = to_rgba(_NONFINITE)
        ax_err.imshow(overlay, extent=extent, origin="lower", interpolation="nearest")

    palette = [_rank_colour(r) for r in range(part.ranks)]
    rank_cmap = ListedColormap(palette).with_extremes(bad="white")
    ax_rank.imshow(
        np.ma.masked_invalid(rank_img),
        cmap=rank_cmap,
        norm=BoundaryNorm(np.arange(part.ranks + 1) - 0.5, part.ranks),
        extent=extent,
        origin="lower",
        interpolation="nearest",
    )

    if part.ranks > 1:
        levels = np.arange(part.ranks - 1) + 0.5
        grid = np.ma.masked_invalid(rank_img)  # no contour along the ellipse's edge
        for ax, colour in ((ax_err, _BOUNDARY), (ax_rank, "black")):
            ax.contour(
                grid,
                levels=levels,
                colors=colour,
                linewidths=1.2,
                extent=extent,
                origin="lower",
            )
    for ax in (ax_err, ax_rank):
        _ellipse(ax)
        for r in range(part.ranks):
            if part.sizes[r] == 0:
                continue
            x, y = _label_xy(proj, hp, nside, part, r)
            _rank_label(ax, x, y, r, fontsize=8)
        ax.set_xlim(extent[0] - 0.02, extent[1] + 0.02)
        ax.set_ylim(extent[2] - 0.02, extent[3] + 0.02)
        ax.set_aspect("equal")
        ax.axis("off")

    worst = _worst(values)
    if worst is not None:
        x, y = proj.vec2xy(*hp.pix2vec(nside, worst, nest=True))
        ax_err.plot(x, y, marker="x", color="#00a0ff", markersize=10, mew=2)
        note += f" at cell {worst} on rank {part.rank_of(worst)}"
    ax_err.set_title(f"{title}\n{note}", fontsize=11)
    shown_ranks = [r for r in range(part.ranks) if part.sizes[r]][:6]
    ranges = ", ".join(f"{r}: {part.bounds[r]}:{part.bounds[r + 1]}" for r in shown_ranks)
    more = ", ..." if part.ranks - len(empty) > len(shown_ranks) else ""
    gaps = f"; empty: {', '.join(map(str, empty[:8]))}" if empty else ""
    ax_rank.set_title(
        f"owning rank per cell (nside {nside}, NESTED)\n{ranges}{more}{gaps}", fontsize=10
    )
    fig.colorbar(image, ax=ax_err, label="|partitioned − reference|", shrink=0.8)
    return save_figure(fig, path)


def _rank_colour(rank: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    # dark shades first, then their light partners: neighbouring ranks stay distinct
    return colormaps["tab20"](int(rank * 2 % 20 + rank // 10 % 2))


def _label_xy(
    proj: MollweideProj, hp: ModuleType, nside: int, part: CellPartition, rank: int
) -> tuple[float, float]:
    """Projected position of the rank's middle cell: a point inside its (compact) region."""
    lo, hi = part.bounds[rank], part.bounds[rank + 1]
    x, y = proj.vec2xy(*hp.pix2vec(nside, (lo + hi - 1) // 2, nest=True))
    return float(x), float(y)


def _ellipse(ax: Axes) -> None:
    t = np.linspace(0, 2 * np.pi, 361)
    ax.plot(2 * np.cos(t), np.sin(t), color="0.3", linewidth=0.8)


def plot_field_error(
    fe: FieldError,
    path: str | os.PathLike[str],
    *,
    title: str,
    spatial_size: int,
    latitudes: npt.ArrayLike | None = None,
) -> Path:
    """Save the map of one failing field of a report, whatever its layout; return the path.

    A ``Shard.grid`` field: ``plot_latlon_error``. Cells (``Shard(..., unit="cell")``), or
    positions whose count is a HEALPix map's (``12 * nside**2``, said in the title, since
    ``unit="cell"`` was not): ``plot_healpix_error`` at that field's own nside, so each level
    of a multi-level model gets its own map. Anything else: ``plot_positions_error``. Ranks
    are numbered within the field's spatial group (``fe.data_group``).
    """
    err, owners = fe.error.numpy(), fe.owners.numpy()
    if fe.grid is not None:
        rows, cols = fe.grid
        grid = owners.reshape(rows, cols)
        return plot_latlon_error(
            err.reshape(rows, cols),
            path,
            lat_sizes=_run_lengths(grid[:, 0]),
            lon_sizes=_run_lengths(grid[0, :]),
            title=title,
            latitudes=latitudes,
        )
    # owners are global ranks; a data group's spatial ranks start at this one
    local = owners - fe.data_group * spatial_size
    nside = _healpix_nside(err.size)
    if fe.unit == "cell" or nside:
        bounds = _cell_bounds(local, spatial_size)
        if fe.unit != "cell":
            title += f"\n(its {err.size} positions read as HEALPix cells: nside {nside}, NESTED)"
        return plot_healpix_error(err, path, bounds=bounds, title=title)
    return plot_positions_error(err, path, owners=local, title=title, unit=fe.unit)


def _healpix_nside(size: int) -> int:
    """The nside of a HEALPix map of ``size`` cells (``12 * nside**2``); 0 for any other."""
    nside = round((size / 12) ** 0.5) if size >= 12 else 0
    return nside if nside and 12 * nside * nside == size else 0


def _cell_bounds(owners: np.ndarray, ranks: int) -> list[int]:
    """The ``CellPartition`` bounds of cells owned rank by rank in contiguous ranges."""
    if owners.size and (owners.min() < 0 or owners.max() >= ranks):
        raise ValueError(
            f"cells owned by ranks {sorted(set(owners.tolist()))[:8]} outside 0..{ranks - 1}"
        )
    steps = np.flatnonzero(np.diff(owners) < 0)
    if steps.size:
        c = int(steps[0]) + 1
        raise ValueError(
            f"cell {c} belongs to rank {int(owners[c])} but cell {c - 1} to rank "
            f"{int(owners[c - 1])}: the ranks' cells are not contiguous NESTED ranges in rank "
            "order, which the map's rank panel draws"
        )
    return [0, *np.cumsum(np.bincount(owners, minlength=ranks)).tolist()]


def _run_lengths(values: np.ndarray) -> list[int]:
    """Lengths of the runs of equal values: ``[0, 0, 1, 1, 1] -> [2, 3]``."""
    lengths: list[int] = []
    for i, v in enumerate(values):
        if i and v == values[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def plot_positions_error(
    error: npt.ArrayLike,
    path: str | os.PathLike[str],
    *,
    owners: npt.ArrayLike,
    title: str,
    unit: str = "position",
) -> Path:
    # long: one figure, two panels (error, owning rank), drawn top to bottom
    """Save the error per position of a one-dimensional field over a strip of the rank
    owning each position; return the path.

    ``error`` is a (n,) array of ``|partitioned - reference|``, ``owners`` the spatial rank
    of each position (any order: a rank may own several runs). Non-finite differences are
    drawn in green.
    """
    values = np.abs(np.asarray(error, dtype=np.float64)).reshape(-1)
    owner = np.asarray(owners, dtype=np.int64).reshape(-1)
    if owner.shape != values.shape:
        raise ConfigError(
            f"plot_positions_error: {values.size} errors but {owner.size} owners; give the "
            "owning rank of every position"
        )
    vmax, note = _scale(values)
    fig = new_figure(10.0, 3.6)
    from matplotlib.colors import BoundaryNorm, ListedColormap

    ax, strip = fig.subplots(2, 1, sharex=True, height_ratios=[4, 1])
    shown = np.where(np.isfinite(values), values, np.nan)
    ax.stairs(shown, np.arange(values.size + 1), color="black", linewidth=1.5)
    for p in np.flatnonzero(~np.isfinite(values)):
        ax.axvspan(p, p + 1, color=_NONFINITE, alpha=0.6)
    worst = _worst(values)
    if worst is not None:
        ax.plot(
            worst + 0.5,
            vmax if not np.isfinite(values[worst]) else values[worst],
            "x",
            color="#00a0ff",
            markersize=10,
            mew=2,
        )
        note += f" at {unit} {worst} on rank {int(owner[worst])}"
    ax.set_ylim(0, vmax * 1.1)
    ax.set_ylabel("|partitioned − reference|")
    ax.set_title(f"{title}\n{note}", fontsize=11)
    ranks = int(owner.max(initial=0)) + 1
    strip.imshow(
        owner[None, :],
        cmap=ListedColormap([_rank_colour(r) for r in range(ranks)]),
        norm=BoundaryNorm(np.arange(ranks + 1) - 0.5, ranks),
        extent=(0, values.size, 0, 1),
        aspect="auto",
        interpolation="nearest",
    )
    runs = np.flatnonzero(np.diff(owner)) + 1
    for start, stop in zip([0, *runs], [*runs, values.size], strict=True):
        _rank_label(strip, (start + stop) / 2, 0.5, int(owner[start]), fontsize=8)
    for b in runs:
        ax.axvline(b, color=_BOUNDARY, linewidth=1.2)
    strip.set_yticks([])
    strip.set_xlim(0, values.size)
    strip.set_xlabel(f"{unit} (owning rank below)")
    return save_figure(fig, path)
