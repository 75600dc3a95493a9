"""Error maps: each writes a PNG, and the faulty rank's cells show up where that rank is."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.partition import CellPartition, LatLonPartition

plots = pytest.importorskip("harness.report.plots")
pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"
# Faulty cells get half the colour scale (one cell holds the maximum, so the colour bar is the
# same as for a map without errors, whose scale ends at 1): pixels of that colour that the
# error-free picture lacks locate the faulty region.
HALF = 0.5


def _pixels(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    return imread(path)[..., :3]


def _half_colour_mask(image: np.ndarray) -> np.ndarray:
    from matplotlib import colormaps

    colour = np.asarray(colormaps[plots._CMAP](HALF)[:3])
    return np.abs(image - colour).max(axis=-1) < 0.02


def _latlon_error(part: LatLonPartition, rank: int | None) -> np.ndarray:
    error = np.zeros((part.nlat, part.nlon))
    if rank is not None:
        lat, lon = part.slices(rank)
        error[lat, lon] = HALF
        error[lat.start, lon.start] = 1.0
    return error


def _healpix_error(part: CellPartition, rank: int | None) -> np.ndarray:
    error = np.zeros(part.npix)
    if rank is not None:
        cells = part.cells(rank)
        error[cells.start : cells.stop] = HALF
        error[cells.start] = 1.0
    return error


def _assert_png(path: Path, returned: Path) -> None:
    assert returned == path
    assert path.read_bytes()[:8] == PNG
    assert path.stat().st_size > 10_000  # a real picture, not an empty canvas


def test_latlon_error_map_is_saved_as_png_in_a_new_directory(tmp_path):
    part = LatLonPartition(19, 36, h=2, w=2)
    path = tmp_path / "plots" / "latlon.png"
    returned = plots.plot_latlon_error(
        _latlon_error(part, 1),
        path,
        lat_sizes=part.lat_sizes,
        lon_sizes=part.lon_sizes,
        title="field 'y' at step 0",
    )
    _assert_png(path, returned)


def test_healpix_error_map_is_saved_as_png_with_an_empty_rank(tmp_path):
    part = CellPartition(4, (0, 64, 64, 150, 192))
    path = tmp_path / "healpix.png"
    returned = plots.plot_healpix_error(
        _healpix_error(part, 2), str(path), bounds=part.bounds, title="field 'pred' at step 1"
    )
    _assert_png(path, returned)


@pytest.mark.parametrize(("rank", "right", "top"), [(2, True, True), (3, False, False)])
def test_latlon_error_map_shows_the_faulty_rank_block_where_that_rank_is(
    tmp_path, rank, right, top
):
    # h2 x w3: ranks 0 1 2 in the north row, 3 4 5 in the south row
    part = LatLonPartition(18, 36, h=2, w=3)
    kwargs = {"lat_sizes": part.lat_sizes, "lon_sizes": part.lon_sizes, "title": "t"}
    clean = plots.plot_latlon_error(_latlon_error(part, None), tmp_path / "clean.png", **kwargs)
    faulty = plots.plot_latlon_error(_latlon_error(part, rank), tmp_path / "faulty.png", **kwargs)

    mask = _half_colour_mask(_pixels(faulty)) & ~_half_colour_mask(_pixels(clean))
    rows, cols = np.nonzero(mask)
    assert mask.sum() > 2000, "the faulty block should cover a visible area"
    # the block is a sixth of the map: its pixels span about a third of the plot's width
    height, width = mask.shape
    assert (cols.mean() > 0.5 * width) == right
    assert (rows.mean() < 0.5 * height) == top


@pytest.mark.parametrize(
    ("latitudes", "top"),
    [(np.linspace(85, -85, 18), True), (np.linspace(-85, 85, 18), False), (None, True)],
    ids=["north-first", "south-first", "undeclared"],
)
def test_declared_latitudes_put_north_at_the_top_whichever_way_the_rows_run(
    tmp_path, latitudes, top
):
    # rank 0 owns rows 0-8: the north if the rows run north first, the south otherwise
    part = LatLonPartition(18, 36, h=2, w=1)
    kwargs = {
        "lat_sizes": part.lat_sizes,
        "lon_sizes": part.lon_sizes,
        "title": "t",
        "latitudes": latitudes,
    }
    clean = plots.plot_latlon_error(_latlon_error(part, None), tmp_path / "clean.png", **kwargs)
    faulty = plots.plot_latlon_error(_latlon_error(part, 0), tmp_path / "faulty.png", **kwargs)
    mask = _half_colour_mask(_pixels(faulty)) & ~_half_colour_mask(_pixels(clean))
    rows, _ = np.nonzero(mask)
    assert mask.sum() > 2000
    assert (rows.mean() < 0.5 * mask.shape[0]) == top


def test_latitudes_that_do_not_match_the_rows_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="3 latitudes for a grid of 8 rows"):
        plots.plot_latlon_error(
            np.zeros((8, 16)),
            tmp_path / "x.png",
            lat_sizes=[8],
            lon_sizes=[16],
            title="t",
            latitudes=[1, 2, 3],
        )


@pytest.mark.parametrize(("rank", "north"), [(0, True), (3, False)])
def test_healpix_error_map_shows_the_faulty_rank_cells_where_that_rank_is(tmp_path, rank, north):
    # nside 2, 4 ranks: rank 0 owns the northern base cells 0-2, rank 3 the southern 9-11
    part = CellPartition.even(nside=2, ranks=4)
    kwargs = {"bounds": part.bounds, "title": "t"}
    clean = plots.plot_healpix_error(_healpix_error(part, None), tmp_path / "clean.png", **kwargs)
    faulty = plots.plot_healpix_error(_healpix_error(part, rank), tmp_path / "faulty.png", **kwargs)

    mask = _half_colour_mask(_pixels(faulty)) & ~_half_colour_mask(_pixels(clean))
    assert mask.sum() > 2000
    rows, _ = np.nonzero(mask)
    # the error panel's ellipse is centred about half way down the image
    assert (rows.mean() < 0.5 * mask.shape[0]) == north


def test_non_finite_differences_are_drawn_not_dropped(tmp_path):
    part = LatLonPartition(8, 16, h=2, w=1)
    error = np.zeros((8, 16))
    error[1, 2] = np.nan
    kwargs = {"lat_sizes": part.lat_sizes, "lon_sizes": part.lon_sizes, "title": "t"}
    clean = _pixels(plots.plot_latlon_error(np.zeros((8, 16)), tmp_path / "a.png", **kwargs))
    marked = _pixels(plots.plot_latlon_error(error, tmp_path / "b.png", **kwargs))
    green = np.abs(marked - np.array([0.0, 0.75, 0.0])).max(axis=-1) < 0.02
    assert green.sum() > 50
    assert not (np.abs(clean - np.array([0.0, 0.75, 0.0])).max(axis=-1) < 0.02).any()


def test_latlon_error_map_names_a_shape_that_does_not_match_the_partition(tmp_path):
    with pytest.raises(ConfigError, match=r"shape \(8, 16\).*describe a 9x16 grid"):
        plots.plot_latlon_error(
            np.zeros((8, 16)), tmp_path / "x.png", lat_sizes=[5, 4], lon_sizes=[16], title="t"
        )


def test_healpix_error_map_rejects_a_map_that_is_not_healpix(tmp_path):
    with pytest.raises(ConfigError, match="13 values is not a HEALPix map"):
        plots.plot_healpix_error(np.zeros(13), tmp_path / "x.png", bounds=(0, 13), title="t")


def test_healpix_error_map_rejects_bounds_that_do_not_cover_the_cells(tmp_path):
    with pytest.raises(ConfigError, match="npix=48"):
        plots.plot_healpix_error(np.zeros(48), tmp_path / "x.png", bounds=(0, 20, 40), title="t")


def test_missing_matplotlib_is_a_config_error_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    says = r"pip install matplotlib \(or pytest-spatial-harness\[plots\]\)"
    with pytest.raises(ConfigError, match=says):
        plots.plot_latlon_error(
            np.zeros((2, 2)), tmp_path / "x.png", lat_sizes=[2], lon_sizes=[2], title="t"
        )
    assert not (tmp_path / "x.png").exists()


def test_a_field_whose_map_cannot_be_drawn_is_a_not_plotted_line_and_the_others_are_drawn(
    tmp_path,
):
    import torch

    from harness.compare import Tolerance
    from harness.plugin import write_error_maps
    from harness.report import EquivalenceReport, FieldError

    report = EquivalenceReport("case", 4, 4, "", 1, "float64", Tolerance.for_dtype(torch.float64))
    good = FieldError("t", 0, 0, torch.rand(12), torch.arange(12) // 3, (3, 4), "position")
    # a grid that does not hold the errors: the map raises, the report must not
    bad = FieldError("u", 0, 0, torch.rand(12), torch.arange(12) // 3, (5, 5), "position")
    paths = write_error_maps(report, str(tmp_path), "tests/x.py::test_maps")
    assert paths == []  # no field errors on the report yet
    report.field_errors = [bad, good]
    paths = write_error_maps(report, str(tmp_path), "tests/x.py::test_maps")
    assert paths[0].startswith("Not plotted: field 'u', step 0 (ValueError: "), paths
    assert paths[1].endswith(".t.step0.png") and Path(paths[1]).exists(), paths


def test_a_picture_that_cannot_be_drawn_is_a_not_plotted_line_not_an_exception():
    from harness.plugin.pictures import drawn

    assert drawn("the layout map", lambda: "maps/x.png") == "maps/x.png"
    said = drawn("the rollout error curve", lambda: str(1 / 0))
    assert said == "Not plotted: the rollout error curve (ZeroDivisionError: division by zero)"


def _report(spatial_size=4, ranks=4):
    import torch

    from harness.compare import Tolerance
    from harness.report import EquivalenceReport

    tol = Tolerance.for_dtype(torch.float64)
    return EquivalenceReport("case", ranks, spatial_size, "", 1, "float64", tol)


def test_a_multi_level_healpix_model_gets_a_map_per_level_whether_or_not_unit_is_cell(tmp_path):
    import torch

    from harness.plugin import write_error_maps
    from harness.report import FieldError

    fine, coarse = CellPartition.even(4, 4), CellPartition.even(2, 4)
    report = _report()
    # the fine level faulty on rank 0 (north), the coarse on rank 3 (south); the coarse
    # level is the newcomer's plain Shard, unit left at "position"
    for part, unit, rank in ((fine, "cell", 0), (coarse, "position", 3)):
        owners = torch.as_tensor(part.rank_of(np.arange(part.npix)))
        report.field_errors += [
            FieldError(f"n{part.nside}", step, 0, torch.as_tensor(error), owners, None, unit)
            for step, error in enumerate((_healpix_error(part, rank), _healpix_error(part, None)))
        ]
    paths = write_error_maps(report, str(tmp_path), "tests/x.py::test_levels")
    assert len(paths) == 4 and all(p.endswith(".png") for p in paths), paths
    for (faulty, clean), north in ((paths[0:2], True), (paths[2:4], False)):
        mask = _half_colour_mask(_pixels(Path(faulty))) & ~_half_colour_mask(_pixels(Path(clean)))
        rows, _ = np.nonzero(mask)
        assert rows.size > 1000 and (rows.mean() < 0.5 * mask.shape[0]) == north


def test_a_field_neither_on_a_grid_nor_in_cells_gets_an_error_per_position_map(tmp_path):
    import torch

    from harness.plugin import write_error_maps
    from harness.report import FieldError

    error = torch.zeros(10, dtype=torch.float64)
    error[7] = 1.0
    owners = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    report = _report()
    report.field_errors = [FieldError("h", 2, 0, error, owners, None, "position")]
    (path,) = write_error_maps(report, str(tmp_path), "tests/x.py::test_line")
    assert path.endswith(".h.step2.png")
    clean = plots.plot_positions_error(
        np.zeros(10), tmp_path / "clean.png", owners=owners, title="t"
    )
    # below the titles (which differ too) the error is the only change: a step at position
    # 7 of 10, right of the middle
    pixels, reference = _pixels(Path(path)), _pixels(clean)
    changed = np.abs(pixels - reference).sum(-1) > 0.5
    rows, cols = np.nonzero(changed[int(0.15 * changed.shape[0]) : int(0.65 * changed.shape[0])])
    assert rows.size > 200 and 0.65 < np.median(cols) / changed.shape[1] < 0.85


def test_a_data_group_s_cells_are_drawn_with_its_own_ranks_an_empty_first_one_included(
    tmp_path, monkeypatch
):
    import torch

    from harness.plugin import write_error_maps
    from harness.report import FieldError

    drawn = {}

    def record(error, path, *, bounds, title):
        drawn["bounds"] = list(bounds)
        return Path(path)

    monkeypatch.setattr(plots, "plot_healpix_error", record)
    part = CellPartition.with_empty_rank(2, 4, empty=0)  # spatial rank 0 owns no cell
    owners = torch.as_tensor(part.rank_of(np.arange(48))) + 4  # data group 1: ranks 4-7
    report = _report(spatial_size=4, ranks=8)
    report.field_errors = [FieldError("p", 0, 1, torch.rand(48), owners, None, "cell")]
    write_error_maps(report, str(tmp_path), "tests/x.py::test_group")
    assert drawn["bounds"] == list(part.bounds)


def test_cells_not_owned_in_rank_order_are_a_not_plotted_line_naming_the_cell(tmp_path):
    import torch

    from harness.plugin import write_error_maps
    from harness.report import FieldError

    owners = torch.arange(12) % 2  # ranks alternate cell by cell: no range per rank
    report = _report(spatial_size=2, ranks=2)
    report.field_errors = [FieldError("p", 0, 0, torch.rand(12), owners, None, "cell")]
    (line,) = write_error_maps(report, str(tmp_path), "tests/x.py::test_order")
    assert line.startswith(
        "Not plotted: field 'p', step 0 (ValueError: cell 2 belongs to rank 0 but cell 1 to rank 1"
    ), line


def test_a_plots_directory_that_cannot_be_made_is_a_not_plotted_line_per_field(tmp_path):
    import torch

    from harness.plugin import write_error_maps
    from harness.report import FieldError

    blocked = tmp_path / "maps"
    blocked.write_text("a file where the directory should be")
    report = _report()
    owners = torch.arange(12) // 3
    report.field_errors = [
        FieldError(n, 0, 0, torch.rand(12), owners, (3, 4), "position") for n in "tu"
    ]
    lines = write_error_maps(report, str(blocked), "tests/x.py::test_blocked")
    assert [line.split(" (")[0] for line in lines] == [
        "Not plotted: field 't', step 0",
        "Not plotted: field 'u', step 0",
    ]
