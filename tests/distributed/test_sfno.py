"""The SFNO stepper split over lat x lon computes what its single-process reference computes."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Bound, ConfigError, Tolerance, Topology, check_equivalence
from harness.steppers.sfno import GRIDS, SFNOCase, SFNOConfig, SFNOStepper
from harness.strategies import latlon_partitions

# ---------------------------------------------------------------- rank functions


def train_once(config: SFNOConfig, partitioned: bool, dtype: torch.dtype, batch_size: int = 2):
    """One train_on_batch + backward from fixed seeds; everything this rank sees, detached."""
    with default_dtype(dtype):  # also called in the test process: leave its dtype alone
        return _train_once(config, partitioned, batch_size)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _train_once(config: SFNOConfig, partitioned: bool, batch_size: int):
    topo = Topology.create() if partitioned else Topology.single()
    torch.manual_seed(0)
    model = SFNOStepper(config, topo)
    torch.manual_seed(1)
    state = torch.randn(
        batch_size, config.forward_steps + 1, config.channels, config.nlat, config.nlon
    )
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    out = model.train_on_batch({"state": model.scatter(state)})
    out.loss.backward()
    rollout = model.predict(model.scatter(state[:, 0]), 3)
    return {
        "loss": out.loss.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "prediction": out.prediction.detach(),
        "rollout": rollout,
        "blocks": (model.lat_slice, model.lon_slice),
        "buffers_unchanged": all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()),
    }


def assemble(results: list[dict], key: str, like: torch.Tensor) -> torch.Tensor:
    """Put every rank's block of field ``key`` back into a global tensor shaped ``like``."""
    out = torch.full_like(like, float("nan"))
    for r in results:
        lats, lons = r["blocks"]
        out[..., lats, lons] = r[key]
    return out


# ---------------------------------------------------------------- model level


@pytest.mark.parametrize(
    ("h", "w", "nlat", "nlon", "grid"),
    [
        (2, 2, 16, 32, "equiangular"),
        (4, 1, 30, 62, "equiangular"),
        (1, 4, 30, 62, "legendre-gauss"),
        (2, 2, 30, 62, "legendre-gauss"),
    ],
    ids=["h2w2", "h4w1_uneven", "h1w4_uneven_gauss", "h2w2_uneven_gauss"],
)
def test_partitioned_model_matches_the_reference_in_loss_grads_and_fields(
    spatial, h, w, nlat, nlon, grid
):
    config = SFNOConfig(nlat=nlat, nlon=nlon, grid=grid, h=h, w=w, embed=8, noise=1)
    ref = train_once(config, False, torch.float64)
    results = spatial.run(train_once, config, True, torch.float64, ranks=h * w)
    # float64: the partitioned run only reorders sums (FFT and Legendre contractions over
    # gathered shards, all-reduces of partial sums), so everything agrees to ~1e-14; 1e-11
    # leaves a wide margin and still catches any logic bug, which moves values by >1e-3.
    tight = {"rtol": 1e-11, "atol": 1e-12}
    for r in results:
        torch.testing.assert_close(r["loss"], ref["loss"], **tight)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, **tight, msg=name)
        assert r["buffers_unchanged"]
    for key in ("prediction", "rollout"):
        torch.testing.assert_close(assemble(results, key, ref[key]), ref[key], **tight)


def sht_tables_after_optimizer_steps(config: SFNOConfig, partitioned: bool, steps: int):
    """Whether the Legendre tables keep their values and versions over ``steps`` train steps."""
    with default_dtype(torch.float64):
        return _sht_tables_after_optimizer_steps(config, partitioned, steps)


def _sht_tables_after_optimizer_steps(config: SFNOConfig, partitioned: bool, steps: int):
    topo = Topology.create() if partitioned else Topology.single()
    torch.manual_seed(0)
    model = SFNOStepper(config, topo)
    tables = {"sht.weights": model.sht.weights, "isht.pct": model.isht.pct}
    before = {n: (t.clone(), t._version) for n, t in tables.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        state = torch.randn(2, config.forward_steps + 1, config.channels, config.nlat, config.nlon)
        model.train_on_batch({"state": model.scatter(state)}, optimizer)
    return {
        n: (torch.equal(t, before[n][0]), t._version == before[n][1]) for n, t in tables.items()
    }


@pytest.mark.parametrize("partitioned", [False, True], ids=["reference", "h2w2"])
def test_a_train_step_leaves_the_sht_legendre_tables_untouched(request, partitioned):
    config = SFNOConfig(nlat=12, nlon=20, h=2, w=2, embed=4)
    if partitioned:  # only this variant uses the ranks (else: SpatialUnusedWarning, rightly)
        spatial = request.getfixturevalue("spatial")
        results = spatial.run(sht_tables_after_optimizer_steps, config, True, 2, ranks=4)
    else:
        results = [sht_tables_after_optimizer_steps(config, False, 2)]
    for r in results:
        assert r == {"sht.weights": (True, True), "isht.pct": (True, True)}


def transforms_under_bf16_autocast(config: SFNOConfig, partitioned: bool):
    """One float32 train step under bf16 autocast, recording what each SHT / inverse SHT call
    got and gave and whether autocast was on in it and in the pointwise layers; then each
    call redone outside autocast on the same input (same order on every rank: the
    distributed transforms communicate)."""
    topo = Topology.create() if partitioned else Topology.single()
    torch.manual_seed(0)
    model = SFNOStepper(config, topo)
    calls, pointwise = [], []
    for transform in (model.sht, model.isht):
        transform.register_forward_hook(
            lambda m, args, out: calls.append((m, args[0], out, torch.is_autocast_enabled("cpu")))
        )
    for layer in (model.encoder, *model.mlps, model.decoder):
        layer.register_forward_hook(
            lambda m, args, out: pointwise.append(torch.is_autocast_enabled("cpu"))
        )
    torch.manual_seed(1)
    state = torch.randn(2, config.forward_steps + 1, config.channels, config.nlat, config.nlon)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train_on_batch({"state": model.scatter(state)})
    seen = []
    with torch.no_grad():
        for m, x, out, autocast in calls:
            again = m.forward(x)  # autocast off here; forward: not the hook again
            seen.append((x.dtype, autocast, torch.equal(out, again)))
    return {"transforms": seen, "pointwise_autocast": pointwise}


@pytest.mark.parametrize("partitioned", [False, True], ids=["reference", "h2w2"])
def test_under_bf16_autocast_the_shts_run_in_float32_and_the_pointwise_layers_in_bf16(
    request, partitioned
):
    # as makani's and fme's SFNOs do: their transforms are quadratures over every latitude,
    # which bf16 would round (torch-harmonics 0.8) or cannot run at all (0.9 raises)
    config = SFNOConfig(nlat=12, nlon=20, h=2, w=2, embed=4)
    if partitioned:  # only this variant uses the ranks (else: SpatialUnusedWarning, rightly)
        spatial = request.getfixturevalue("spatial")
        results = spatial.run(transforms_under_bf16_autocast, config, True, ranks=4)
    else:
        results = [transforms_under_bf16_autocast(config, False)]
    for r in results:
        # 2 forward steps x 2 blocks x (SHT, inverse SHT); each bit-equal to float32's
        assert r["transforms"] == [(torch.float32, False, True), (torch.complex64, False, True)] * 4
        assert r["pointwise_autocast"] == [True] * 2 * (1 + config.blocks + 1)


def test_under_autocast_a_bf16_field_enters_the_sht_as_float32_and_a_float64_one_as_is():
    import torch_harmonics as th

    from harness.steppers.sfno import _untouched_by_autocast

    sht = th.RealSHT(12, 20, lmax=11, mmax=11)
    field = torch.randn(2, 12, 20)
    for x, expected in ((field.bfloat16(), torch.complex64), (field.double(), torch.complex128)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _untouched_by_autocast(sht, x)
        assert out.dtype == expected
        assert torch.equal(out, sht(x.to(torch.promote_types(x.dtype, torch.float32))))


# ---------------------------------------------------------------- check_equivalence

LAYOUTS = [
    # (ranks, spatial_size, case kwargs)
    (1, None, {"h": 1, "w": 1}),
    (2, None, {"h": 2, "w": 1}),
    (2, None, {"h": 1, "w": 2}),
    (4, None, {"h": 2, "w": 2}),
    (4, None, {"h": 4, "w": 1}),
    (4, None, {"h": 1, "w": 4}),
    (4, None, {"nlat": 30, "nlon": 62, "h": 4, "w": 1}),
    (4, None, {"nlat": 30, "nlon": 62, "h": 1, "w": 4}),
    (4, None, {"nlat": 30, "nlon": 62, "h": 2, "w": 2, "grid": "legendre-gauss", "noise": 1}),
    (4, 2, {"h": 2, "w": 1, "batch_size": 4, "noise": 1}),
    (4, 2, {"h": 1, "w": 2, "batch_size": 4}),
    (4, 1, {"batch_size": 4, "noise": 1}),
]
LAYOUT_IDS = [
    "h1w1",
    "h2w1",
    "h1w2",
    "h2w2",
    "h4w1",
    "h1w4",
    "h4w1_uneven_lat",
    "h1w4_uneven_lon",
    "h2w2_uneven_gauss_noise",
    "h2w1_x_data2",
    "h1w2_x_data2",
    "data4",
]


@pytest.mark.parametrize(("ranks", "spatial_size", "kwargs"), LAYOUTS, ids=LAYOUT_IDS)
def test_the_stepper_is_equivalent_to_its_reference_on_every_process_grid(
    spatial, ranks, spatial_size, kwargs
):
    case = SFNOCase(**{"nlat": 16, "nlon": 32, **kwargs})
    report = check_equivalence(
        case, ranks=ranks, spatial_size=spatial_size, pool=spatial.pool(ranks)
    )
    assert report.ok, str(report)
    # float64: the default bounds (rtol 1e-10, atol 1e-12, see Tolerance.for_dtype) hold
    # with room to spare; the worst absolute error measured is ~1e-13.
    assert max(report.stats[q].max_abs for q in ("loss", "grad", "field", "param")) < 1e-11


# float32: the partitioned run reorders sums, so results differ from the reference by a few
# eps (1.2e-7) of the values' magnitude. Measured on these layouts: fields up to 6e-7
# absolute (|values| up to ~5), gradients up to 5e-7 (entries up to ~8; many near 0, where
# only an absolute bound can hold), loss 2.4e-7 of ~2.6, parameters 6e-8. rtol alone fails
# for entries near zero, so each bound has an atol ~5x above the worst measured absolute
# error of small entries, and an rtol of ~100 eps for the large ones.
FLOAT32 = Tolerance(
    loss=Bound(rtol=1e-6, atol=1e-7),
    grad=Bound(rtol=1e-5, atol=2e-6),
    field=Bound(rtol=1e-5, atol=3e-6),
    param=Bound(rtol=1e-5, atol=5e-7),
)


@pytest.mark.parametrize(
    "kwargs",
    [{"h": 2, "w": 2}, {"nlat": 30, "nlon": 62, "h": 1, "w": 4, "noise": 1}],
    ids=["h2w2", "h1w4_uneven_noise"],
)
def test_in_float32_the_stepper_agrees_to_a_few_eps(spatial, kwargs):
    case = SFNOCase(**kwargs, dtype=torch.float32)
    report = check_equivalence(case, ranks=4, tolerance=FLOAT32, pool=spatial.pool(4))
    assert report.ok, str(report)
    assert report.dtype == "float32"


@settings(
    max_examples=6,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    part=st.sampled_from([2, 4]).flatmap(
        lambda r: latlon_partitions(ranks=r, min_nlat=5, max_nlat=24, min_nlon=8, max_nlon=40)
    ),
    grid=st.sampled_from(GRIDS),
)
def test_any_drawn_grid_and_process_grid_is_equivalent(spatial, part, grid):
    case = SFNOCase(part.nlat, part.nlon, part.h, part.w, grid=grid, embed=4, blocks=2)
    report = check_equivalence(case, ranks=part.ranks, pool=spatial.pool(part.ranks))
    assert report.ok, str(report)


# ---------------------------------------------------------------- configuration


def test_too_few_channels_for_the_process_grid_are_refused_with_the_reason():
    config = SFNOConfig(nlat=16, nlon=32, h=1, w=4, embed=2)
    with pytest.raises(ConfigError, match=r"embed=2 channels .* use embed >= 4"):
        config.process_grid(_spatial_topology(4))


def test_a_process_grid_that_does_not_fit_the_spatial_group_is_refused():
    with pytest.raises(ConfigError, match=r"h \* w == 4"):
        SFNOConfig(h=3, w=1).process_grid(_spatial_topology(4))
    assert SFNOConfig().process_grid(_spatial_topology(4)) == (4, 1)
    assert SFNOConfig(w=2).process_grid(_spatial_topology(4)) == (2, 2)
    assert SFNOConfig(h=2, w=2).process_grid(Topology.single()) == (1, 1)


def _defaults() -> dict[str, object]:
    """Every field ``SFNOConfig`` takes, with its default: read from the dataclass, so a
    field added there is checked here without a word changed."""
    return {
        f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(SFNOConfig)
        if f.init
    }


@pytest.mark.parametrize("name", list(_defaults()))
def test_every_keyword_sfno_config_takes_is_taken_by_sfno_case_with_the_same_default(name):
    default = _defaults()[name]
    assert getattr(SFNOCase().config, name) == default
    assert SFNOCase(**{name: default}).config == SFNOConfig(**{name: default}) == SFNOConfig()


def test_sfno_case_takes_the_grid_by_position_and_a_config_to_start_from():
    assert SFNOCase(12, 20, 1, 2).config == SFNOConfig(nlat=12, nlon=20, h=1, w=2)
    assert SFNOCase(12, 20, embed=4).config == SFNOConfig(nlat=12, nlon=20, embed=4)
    base = SFNOConfig(nlat=8, nlon=16, embed=4, faults=frozenset({"grad-sync-mean"}))
    assert SFNOCase(config=base, h=2).config == dataclasses.replace(base, h=2)
    assert SFNOCase(config=base).config == base


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {"embd": 4}, r"unknown option 'embd'; did you mean 'embed'\?"),
        ((), {"nlat": "16"}, r"SFNOConfig.nlat must be a positive integer"),
        ((16, 32, 2, 2, 1), {}, r"at most 4 positional arguments \(nlat, nlon, h, w\)"),
        ((16,), {"nlat": 32}, r"\['nlat'\] both by position and by keyword"),
    ],
    ids=["misspelt", "invalid", "too-many-positional", "twice"],
)
def test_sfno_case_options_are_refused_with_what_to_do_instead(args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SFNOCase(*args, **kwargs)


def _spatial_topology(size: int) -> Topology:
    """A topology that claims a spatial group of ``size`` (enough for argument checks)."""
    return Topology(size, 0, size, 0, object(), 1, 0, None)


# ---------------------------------------------------------------- goldens


@pytest.mark.parametrize(
    "kwargs",
    [{"h": 2, "w": 2}, {"grid": "legendre-gauss", "noise": 1, "h": 1, "w": 4}],
    ids=["equiangular_h2w2", "gauss_noise_h1w4"],
)
def test_the_reference_run_still_matches_its_golden(spatial, kwargs):
    # the golden holds the reference's loss, grads, fields and params; the partitioned run
    # is compared with the reference in the same call (regenerate: --update-goldens)
    # small sizes keep each golden file ~100 kB
    spatial.check(SFNOCase(nlat=12, nlon=20, embed=4, **kwargs), golden=True, ranks=4)


def transpose_in_use() -> str:
    from torch_harmonics.distributed import primitives

    fn = getattr(primitives, "_transpose", None)  # torch-harmonics 0.8 (0.9 has its own)
    return f"{fn.__module__}.{fn.__name__}" if fn else "-"


def test_the_harness_transposes_are_undone_after_each_run(spatial):
    # A warm rank serves the next test, whose model (fme) may bring its own gloo transposes:
    # it must find torch-harmonics as installed, not with the harness's patch left in.
    before = spatial.run(transpose_in_use, ranks=4)
    report = spatial.check(SFNOCase(nlat=12, nlon=20, embed=4, h=1, w=4), ranks=4)
    assert report.ok, report
    assert spatial.run(transpose_in_use, ranks=4) == before
    assert not any(name.startswith("harness") for name in before)
