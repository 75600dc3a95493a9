"""The first-divergence rule and the placement of a rank's tensors, on hand-made traces."""

from __future__ import annotations

import math

import pytest
import torch

from harness.divergence import (
    DEPART,
    Axis,
    Event,
    Positions,
    Trace,
    axes_of,
    first_divergence,
    place,
)
from harness.partition import CellPartition, LatLonPartition

F64 = torch.float64


def _idx(p):
    return [None if i is None else i.tolist() for i in p.index]


# ---------------------------------------------------------------------- placement


def test_a_lat_lon_block_is_placed_by_its_trailing_dims_and_other_dims_are_whole():
    axes = axes_of(LatLonPartition(4, 6, 2, 2), 3)  # rows 2:4, cols 3:6
    p = place((5, 2, 3), (5, 4, 6), axes)
    assert _idx(p) == [None, [2, 3], [3, 4, 5]]
    assert p.units == ("", "lat", "lon")


def test_a_tensor_of_the_global_extent_is_replicated():
    axes = axes_of(LatLonPartition(4, 6, 2, 2), 3)
    assert _idx(place((5, 4, 6), (5, 4, 6), axes)) == [None, None, None]


def test_latitudes_are_only_recognised_in_the_second_to_last_dim():
    axes = axes_of(LatLonPartition(4, 6, 2, 1), 1)  # rows 2:4, all 6 columns
    assert place((2, 6, 6), (4, 6, 6), axes) is None  # dim 0 has the lat sizes, not dim -2


def test_cells_are_recognised_at_any_dim_and_an_empty_rank_has_an_empty_block():
    part = CellPartition(1, (0, 5, 5, 12))
    assert _idx(place((2, 7, 3), (2, 12, 3), axes_of(part, 2))) == [None, list(range(5, 12)), None]
    assert _idx(place((2, 0, 3), (2, 12, 3), axes_of(part, 1))) == [None, [], None]


def test_a_block_plus_a_halo_is_placed_with_positions_off_the_globe_left_out():
    axis = Axis(8, torch.arange(0, 4), "position")
    assert _idx(place((6,), (8,), [axis])) == [[-1, 0, 1, 2, 3, 4]]  # unpadded reference
    assert _idx(place((6,), (10,), [axis])) == [[0, 1, 2, 3, 4, 5]]  # reference padded by 1


def test_a_data_groups_samples_are_its_share_of_dim_0():
    axes = [Axis(10, torch.arange(5, 10), "position")]
    assert _idx(place((2, 5), (4, 10), axes, data=(1, 2))) == [[2, 3], list(range(5, 10))]


def test_a_shape_no_declared_layout_explains_is_not_placed():
    axes = [Axis(10, torch.arange(5, 10), "position")]
    assert place((3,), (10,), axes) is None  # 3 of 10: not this rank's 5
    assert place((2, 5), (4, 10), axes) is None  # 2 of 4 samples with one data group
    assert place((5,), (10,), []) is None  # nothing declared


def test_positions_and_unknown_partitions():
    assert axes_of(Positions(10, range(2, 4)), 0)[0].positions.tolist() == [2, 3]
    with pytest.raises(TypeError, match="LatLonPartition, a CellPartition"):
        axes_of("rows 0:4", 0)


# ---------------------------------------------------------------------- the rule


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def ev(module, kind, tensor, *, call=0, slot="0", parent=None, through=False, type_="Lin"):
    return Event(module, type_, call, kind, slot, tensor, parent, through)


def _traces(ref_events, rank_events, noise=1e-15):
    """Reference, nudged reference (every value moved by ``noise`` relative) and one rank."""
    reference = Trace(0, list(ref_events))
    nudged = Trace(
        0,
        [
            Event(e.module, e.type, e.call, e.kind, e.slot, e.tensor * (1 + noise), e.parent)
            for e in ref_events
        ],
    )
    rank = Trace(0, list(rank_events))
    return reference, nudged, [rank]


def model_events(
    *,
    enc_out=None,
    dec_in=None,
    dec_out=None,
    g_dec_out=None,
    g_dec_in=None,
    g_enc_out=None,
    g_w=None,
    loss=None,
    field=None,
):
    """A model '' calling 'enc' then 'dec'; keyword arguments replace one tensor."""
    root = ("", 0)
    return [
        ev("", "input", t(1, 2)),
        ev("enc", "input", t(1, 2), parent=root),
        ev("enc", "output", t(3, 4) if enc_out is None else enc_out, parent=root),
        ev("dec", "input", t(3, 4) if dec_in is None else dec_in, parent=root),
        ev("dec", "output", t(5, 6) if dec_out is None else dec_out, parent=root, through=True),
        ev("", "output", t(5, 6) if dec_out is None else dec_out),
        ev("", "loss", t(7) if loss is None else loss, slot="loss"),
        ev("", "grad_output", t(1, 1)),
        ev("dec", "grad_output", t(1, 1) if g_dec_out is None else g_dec_out),
        ev("dec", "grad_input", t(2, 2) if g_dec_in is None else g_dec_in),
        ev("enc", "grad_output", t(2, 2) if g_enc_out is None else g_enc_out),
        ev("dec", "param_grad", t(9, 9) if g_w is None else g_w, slot="dec.weight"),
        ev("", "field", t(5, 6) if field is None else field, slot="out"),
    ]


def test_nothing_departs_when_every_quantity_matches_within_its_noise():
    ref, nudged, ranks = _traces(model_events(), model_events(dec_out=t(5, 6 * (1 + 1e-14))))
    found = first_divergence(ref, nudged, ranks)
    assert found.first is None
    assert found.compared == len(model_events())
    assert 0 < found.worst_multiple < DEPART  # the 1e-14 is ~10x the 1e-15 noise


def test_a_module_whose_output_departs_while_its_inputs_match_is_the_forward_divergence():
    ref, nudged, ranks = _traces(model_events(), model_events(dec_out=t(5, 7)))
    d = first_divergence(ref, nudged, ranks).first
    assert d is not None
    assert (d.direction, d.module, d.quantity, d.rank) == ("forward", "dec", "output", 0)
    assert d.upstream_rel == 0.0 and math.isclose(d.max_rel, 1 / 6)
    assert d.multiple > 1e12
    line = d.line()
    assert line.startswith("First divergence: forward of 'dec' (Lin), step 0: inputs match")
    assert "on rank 0" in line and "float64 noise" in line


def test_an_input_that_departs_first_points_at_the_enclosing_modules_own_code():
    ref, nudged, ranks = _traces(model_events(), model_events(dec_in=t(3, 5), dec_out=t(5, 7)))
    d = first_divergence(ref, nudged, ranks).first
    assert d is not None and (d.direction, d.module, d.quantity) == (
        "forward",
        "",
        "input of 'dec'",
    )


def test_a_departing_model_input_is_the_batch():
    events = model_events()
    events[0] = ev("", "input", t(1, 3))
    d = first_divergence(*_traces(model_events(), events)).first
    assert d is not None and d.module is None and "batch" in d.located


def test_a_loss_that_departs_while_every_module_matched_is_the_loss():
    d = first_divergence(*_traces(model_events(), model_events(loss=t(8)))).first
    assert d is not None and d.module is None and d.located == "forward of the loss"


def test_a_gradient_into_the_inputs_that_departs_while_the_output_gradient_matched_is_backward():
    d = first_divergence(*_traces(model_events(), model_events(g_dec_in=t(2, 3)))).first
    assert d is not None and (d.direction, d.module, d.quantity) == (
        "backward",
        "dec",
        "grad_input",
    )
    assert d.line().startswith("First divergence: backward of 'dec' (Lin), step 0: gradient at")


def test_an_output_gradient_that_departs_first_points_at_the_code_that_consumed_the_output():
    d = first_divergence(*_traces(model_events(), model_events(g_enc_out=t(2, 9)))).first
    assert d is not None and (d.direction, d.module) == ("backward", "")


def test_an_output_gradient_handed_on_by_its_parent_climbs_to_the_loss():
    # 'dec' is the model's last call: its output is the model's, so the loss consumed it
    events = model_events(g_dec_out=t(1, 2))
    d = first_divergence(*_traces(model_events(), events)).first
    assert d is not None and d.module is None and d.located == "backward of the loss"


def _synced(g_w, before, functions=()):
    """The model's traces whose rank's gradient of 'dec.weight' is ``g_w`` after its
    synchronisation and ``before`` before it (``None``: not recorded)."""
    ref, nudged, ranks = _traces(model_events(), model_events(g_w=g_w))
    if before is not None:
        ranks[0].presync = {"dec.weight": ev("dec", "param_grad", before, slot="dec.weight")}
    ranks[0].functions = {"dec.weight": tuple(functions)}
    return ref, nudged, ranks


def test_a_parameter_gradient_right_before_its_sync_and_wrong_after_is_the_synchronisation():
    d = first_divergence(*_synced(t(4.5, 4.5), before=t(9, 9))).first
    assert d is not None and (d.direction, d.module, d.quantity) == (
        "backward",
        "dec",  # the module owning it: context, its own gradients matched
        "grad 'dec.weight'",
    )
    assert (d.cause, d.name) == ("synchronisation", "dec.weight")
    assert d.located == "gradient synchronisation of 'dec.weight'"
    assert d.line().startswith(
        "First divergence: gradient synchronisation of 'dec.weight' (backward, owner 'dec' "
        "(Lin)), step 0: the gradient of 'dec.weight' departs after its synchronisation: the "
        "ranks' gradients before it add up to the reference's; max rel 0.5 at [0] on rank 0"
    )


def test_a_parameter_gradient_already_wrong_before_its_sync_is_its_modules_backward():
    d = first_divergence(*_synced(t(4.5, 4.5), before=t(4.5, 4.5), functions=["_Ring"])).first
    assert d is not None and (d.cause, d.module, d.function) == ("backward", "dec", ("_Ring",))
    assert d.located == "backward of 'dec' (Lin) through _Ring"
    assert d.line().startswith(
        "First divergence: backward of 'dec' (Lin) through _Ring, step 0: the gradient of "
        "'dec.weight' departs before any synchronisation: the ranks' gradients as their "
        "backward made them do not add up to the reference's; max rel 0.5"
    )
    assert "synchronisation of" not in d.line()


def test_without_a_gradient_from_before_the_sync_both_suspects_are_named():
    d = first_divergence(*_synced(t(4.5, 4.5), before=None, functions=["_Ring"])).first
    assert d is not None and d.cause == "undecided"
    assert (
        d.located
        == "gradient synchronisation of 'dec.weight' or backward of 'dec' (Lin) through _Ring"
    )
    assert "no gradient before its synchronisation was recorded to tell the two apart" in d.line()


def test_gradients_before_the_sync_that_sum_to_the_reference_over_the_ranks_are_right():
    # two ranks, each with its share of the reference's gradient before the (wrong) sync
    ref, nudged, _ = _traces(model_events(), model_events())
    ranks = []
    for share in (t(4, 2), t(5, 7)):
        rank = Trace(0, model_events(g_w=t(4.5, 4.5)))
        rank.presync = {"dec.weight": ev("dec", "param_grad", share, slot="dec.weight")}
        ranks.append(rank)
    d = first_divergence(ref, nudged, ranks).first
    assert d is not None and d.cause == "synchronisation"
    ranks[1].presync["dec.weight"] = ev("dec", "param_grad", t(5, 8), slot="dec.weight")
    d = first_divergence(ref, nudged, ranks).first
    assert d is not None and d.cause == "backward"


def test_a_parameter_gradient_departing_before_an_activation_gradient_blames_the_module():
    # the parameter's gradient is judged first, but an activation gradient departs after
    # it: a module's backward is wrong, which no synchronisation explains
    events = model_events(g_w=t(4.5, 4.5), g_enc_out=t(2, 9))
    ref = model_events()
    ref.insert(9, ref.pop(11))  # dec.weight's gradient accumulated before dec's grad_input
    events.insert(9, events.pop(11))
    d = first_divergence(*_traces(ref, events)).first
    assert d is not None and d.cause == "" and d.quantity == "grad_output of 'enc'"
    assert "synchronisation" not in d.line()


def test_without_activation_gradients_a_parameter_gradient_is_its_modules_backward():
    # forward hooks only (the model broke under the backward ones): no activation
    # gradient was seen, so nothing shows they matched
    ref, nudged, ranks = _traces(model_events(), model_events(g_w=t(4.5, 4.5)))
    ranks[0].forward_only = True
    d = first_divergence(ref, nudged, ranks).first
    assert d is not None and d.cause == "" and d.located == "backward of 'dec' (Lin)"


def test_a_field_that_departs_while_every_module_matched_is_named():
    d = first_divergence(*_traces(model_events(), model_events(field=t(6, 5)))).first
    assert d is not None and d.located == "field 'out'"
    assert d.line().startswith("First divergence: field 'out', step 0:")


def test_a_departure_is_judged_against_the_quantitys_own_noise():
    # the nudge moves dec's output by 1e-6 relative (an ill-conditioned module): an error of
    # 1e-4 is 100x that noise, not a divergence; 1e-2 is 10000x, a divergence
    ref_events = model_events()
    reference = Trace(0, ref_events)
    nudged = Trace(0, model_events(dec_out=t(5, 6 * (1 + 1e-6))))
    off = model_events(dec_out=t(5, 6 * (1 + 1e-4)))
    assert first_divergence(reference, nudged, [Trace(0, off)]).first is None
    far = model_events(dec_out=t(5, 6 * (1 + 1e-2)))
    d = first_divergence(reference, nudged, [Trace(0, far)]).first
    assert d is not None and d.module == "dec" and 5e3 < d.multiple < 2e4


def test_a_tensor_that_cannot_be_placed_is_listed_and_never_taken_as_matching():
    ref_events = model_events()
    rank_events = model_events()
    rank_events[2] = ev("enc", "output", t(3, 4, 0), parent=("", 0))  # 3 values for 2: no layout
    rank_events[3] = ev("dec", "input", t(3, 4, 0), parent=("", 0))
    rank_events[4] = ev("dec", "output", t(5, 7), parent=("", 0))  # departs
    found = first_divergence(*_traces(ref_events, rank_events))
    assert found.not_compared == {"enc": ["output (3,)"], "dec": ["input (3,)"]}
    assert found.first is not None and found.first.module == "dec"
    assert found.first.upstream_rel is None  # its inputs were not compared: not "inputs match"
    assert "inputs match" not in found.first.line()
    assert "Not compared" in found.lines()[1] and "'enc' output (3,)" in found.lines()[1]


def test_the_worst_rank_and_the_global_position_are_reported():
    axes = [Axis(4, torch.arange(2, 4), "position")]
    ref = [ev("m", "output", t(1, 2, 3, 4))]
    rank0 = Trace(0, [ev("m", "output", t(1, 2))], axes=[Axis(4, torch.arange(0, 2), "position")])
    rank1 = Trace(0, [ev("m", "output", t(3, 9))], spatial_rank=1, axes=axes)
    d = first_divergence(Trace(0, ref), None, [rank0, rank1]).first
    assert d is not None and d.rank == 1 and d.where == "[position 3]"


def test_a_nan_on_a_rank_departs_and_matching_nans_do_not():
    ref = [ev("m", "output", t(1, math.nan))]
    same = first_divergence(Trace(0, ref), None, [Trace(0, [ev("m", "output", t(1, math.nan))])])
    assert same.first is None
    d = first_divergence(
        Trace(0, [ev("m", "output", t(1, 2))]),
        None,
        [Trace(0, [ev("m", "output", t(1, math.nan))])],
    ).first
    assert d is not None and math.isinf(d.multiple)
    assert d.line().endswith(
        "output a NaN or inf where the reference differs at [1] on rank 0 (float64)"
    )


def test_integers_that_differ_are_named_as_differing_not_as_an_infinite_error():
    ref = [ev("m", "output", torch.tensor([1, 2]))]
    rank = Trace(0, [ev("m", "output", torch.tensor([1, 3]))])
    d = first_divergence(Trace(0, ref), None, [rank]).first
    assert d is not None and d.line().endswith("output values differ at [1] on rank 0 (int64)")


def test_a_module_call_one_rank_never_made_departs_in_words():
    ref = [ev("m", "output", t(1, 2))]
    ranks = [Trace(0, [ev("m", "output", t(1, 2))]), Trace(0, [], spatial_rank=1)]
    d = first_divergence(Trace(0, ref), None, ranks).first
    assert d is not None and (d.cause, d.rank) == ("absent", 1)
    assert d.line() == (
        "First divergence: forward of 'm' (Lin), step 0: output never computed on rank 1, "
        "where the reference (and other ranks) computed it"
    )


def test_a_module_no_rank_calls_is_skipped_and_listed_not_taken_as_departing():
    # the ranks call F.linear with the module's parameters (as DTensor's local_map does):
    # the module's own events never happen there; the bug is in the loss
    ref = [
        ev("", "input", t(1, 2)),
        ev("proj", "input", t(1, 2), parent=("", 0)),
        ev("proj", "output", t(3, 4), parent=("", 0)),
        ev("", "output", t(3, 4)),
        ev("", "loss", t(7), slot="loss"),
        ev("proj", "param_grad", t(1, 1), slot="proj.weight"),
    ]
    rank = [ref[0], ref[3], ev("", "loss", t(8), slot="loss"), ref[5]]
    found = first_divergence(Trace(0, ref), None, [Trace(0, rank)])
    assert found.first is not None and found.first.located == "forward of the loss"
    assert found.not_run == ["'proj' (Lin)"]
    assert found.lines()[1].startswith(
        "Not compared (called in the reference, on no rank: the ranks compute it another way"
    )
    assert "inf" not in found.lines()[0]


def test_with_data_groups_the_loss_is_their_mean_and_gradients_are_per_group():
    ref = [ev("", "loss", t(2.0), slot="loss"), ev("m", "grad_output", t(1, 1, 1, 1))]
    groups = [
        Trace(
            0,
            [ev("", "loss", t(1.0), slot="loss"), ev("m", "grad_output", t(2, 2))],
            data_rank=g,
            data_size=2,
        )
        for g in range(2)
    ]
    groups[1].events[0] = ev("", "loss", t(3.0), slot="loss")
    assert first_divergence(Trace(0, ref), None, groups).first is None


def test_gradients_of_a_replicated_tensor_may_be_whole_on_each_rank_or_parts_of_the_groups():
    # upstream of reduce_loss each rank back-propagates its own part of the loss: the ranks'
    # gradients of a replicated activation (a gathered latent) sum to the reference's;
    # downstream of it (the loss itself) every rank holds the whole gradient
    ref = [ev("mix", "grad_output", t(1, 1))]

    def two(a, b):
        return [
            Trace(0, [ev("mix", "grad_output", a)]),
            Trace(0, [ev("mix", "grad_output", b)], spatial_rank=1),
        ]

    assert first_divergence(Trace(0, ref), None, two(t(1, 0), t(0, 1))).first is None
    assert first_divergence(Trace(0, ref), None, two(t(1, 1), t(1, 1))).first is None
    d = first_divergence(Trace(0, ref), None, two(t(2, 0), t(0, 0))).first  # neither
    assert d is not None and math.isclose(d.max_rel, 1.0)


def test_with_data_groups_a_replicated_forward_value_may_be_the_mean_of_the_groups():
    ref = [ev("", "output", t(2.0))]  # the model's own loss, over every sample
    groups = [
        Trace(0, [ev("", "output", t(v))], data_rank=g, data_size=2)
        for g, v in enumerate((1.0, 3.0))
    ]
    assert first_divergence(Trace(0, ref), None, groups).first is None
    groups[1].events[0] = ev("", "output", t(4.0))
    assert first_divergence(Trace(0, ref), None, groups).first is not None


def test_the_dtypes_on_the_path_to_the_divergence_are_kept_for_the_hints():
    ref = [ev("a", "output", t(1, 2)), ev("b", "output", t(3, 4)), ev("c", "output", t(5, 6))]
    rank = [
        ev("a", "output", t(1, 2)),
        ev("b", "output", t(3, 5)),  # departs here
        ev("c", "output", torch.tensor([5, 6], dtype=torch.float32)),
    ]
    found = first_divergence(Trace(0, ref), None, [Trace(0, rank)])
    assert found.first is not None and found.first.module == "b"
    assert found.path_dtypes == ("float64",)  # the float32 after it is not on the path
    assert found.dtypes == ("float64", "float32")


def test_calibration_keeps_each_quantitys_noise_and_error_and_the_rtol_they_support():
    ref = [ev("", "loss", t(2.0), slot="loss"), ev("m", "param_grad", t(10, 1), slot="m.w")]
    nudged = Trace(
        0,
        [ev("", "loss", t(2.0), slot="loss"), ev("m", "param_grad", t(10 + 1e-12, 1), slot="m.w")],
    )
    rank = Trace(
        0,
        [ev("", "loss", t(2.0), slot="loss"), ev("m", "param_grad", t(10, 1 + 1e-11), slot="m.w")],
    )
    found = first_divergence(Trace(0, ref), nudged, [rank])
    grad = found.calibration["grad"]
    assert math.isclose(grad.noise, 1e-13, rel_tol=1e-3) and math.isclose(
        grad.error, 1e-12, rel_tol=1e-3
    )
    assert math.isclose(grad.supports(), 1e-11, rel_tol=1e-3)
    assert found.calibration["loss"].error == 0.0
    lines = found.calibration_lines({"loss": 1e-10, "grad": 1e-10})
    assert lines[1] == (
        "grad: rounding noise 1.0e-13, partitioned run 1.0e-12 (relative to the largest "
        "value) -> supports rtol 1e-11 (now 1e-10)"
    )


# ---------------------------------------------------------------------- zeros, names, subclasses


def c(*values: complex) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.complex128)


def test_a_rank_whose_part_of_a_complex_tensor_is_exactly_zero_is_judged_at_the_tensors_scale():
    # spectral modes: rank 1 holds the modes above the truncation, exactly zero in the
    # reference; rounding of 1e-17 there is no departure, and nothing reads "inf"
    ref = [ev("sht", "output", c(1 + 1j, 2, 0, 0))]
    axes = [Axis(4, torch.arange(0, 2), "m"), Axis(4, torch.arange(2, 4), "m")]
    ranks = [
        Trace(0, [ev("sht", "output", c(1 + 1j, 2))], axes=[axes[0]]),
        Trace(0, [ev("sht", "output", c(1e-17j, 0))], spatial_rank=1, axes=[axes[1]]),
    ]
    found = first_divergence(Trace(0, ref), None, ranks)
    assert found.first is None and found.worst_multiple < 1
    ranks[1].events[0] = ev("sht", "output", c(0, 0.5))  # a real departure there
    d = first_divergence(Trace(0, ref), None, ranks).first
    assert d is not None and d.where == "[m 3]" and d.dtype == "complex128"
    assert math.isclose(d.max_rel, 0.25)  # relative to the tensor's largest magnitude, 2


def test_a_reference_that_is_exactly_zero_everywhere_is_judged_by_the_absolute_term():
    # float64's absolute term is 1e-12: 1e-14 is rounding, 1e-9 departs, as an absolute error
    ref = [ev("m", "output", t(0, 0))]
    quiet = first_divergence(Trace(0, ref), None, [Trace(0, [ev("m", "output", t(0, 1e-14))])])
    assert quiet.first is None
    d = first_divergence(Trace(0, ref), None, [Trace(0, [ev("m", "output", t(0, 1e-9))])]).first
    assert d is not None and d.zero and math.isfinite(d.max_rel) and math.isfinite(d.multiple)
    assert "max abs 1e-09 where the reference is exactly zero at [1] on rank 0 (1e+06x its" in (
        d.line()
    )
    assert "inf" not in d.line()


def test_positions_are_named_by_the_partition_that_explains_the_tensor():
    # a grid (16 x 24) and its spectral modes split the same way (16 l x 13 m): the modes'
    # l count equals the latitude count, yet their positions are l and m, not lat and m
    grid = LatLonPartition(16, 24, 2, 1)
    modes = LatLonPartition(16, 13, 2, 1, axes=("l", "m"))
    axes = axes_of([grid, modes], 1)
    assert place((2, 8, 13), (2, 16, 13), axes).units == ("", "l", "m")
    assert place((2, 8, 24), (2, 16, 24), axes).units == ("", "lat", "lon")
    ref = [ev("sht", "output", torch.zeros(16, 13, dtype=F64).index_fill(0, torch.tensor(9), 1))]
    rank = Trace(0, [ev("sht", "output", torch.zeros(8, 13, dtype=F64))], axes=axes)
    d = first_divergence(Trace(0, ref), None, [rank]).first
    assert d is not None and d.where == "[l 9, m 0]"


def test_a_partitions_axis_names_must_be_two_names():
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match=r'axes=\("l", "m"\)'):
        LatLonPartition(4, 4, axes=("l",))


class Opaque(torch.Tensor):
    """A tensor subclass whose arithmetic refuses plain tensors (as DTensor's does)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__):
            raise RuntimeError("aten.sub.Tensor got mixed torch.Tensor and Opaque")
        return super().__torch_function__(func, types, args, kwargs or {})


class Sharded(Opaque):
    """One with a local shard to read, as a DTensor or a ShardTensor has."""

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def test_a_value_locating_cannot_read_is_listed_and_the_rest_is_still_located():
    ref = [ev("a", "output", t(1, 2)), ev("b", "output", t(3, 4))]
    rank = [ev("a", "output", t(1, 2).as_subclass(Opaque)), ev("b", "output", t(3, 5))]
    found = first_divergence(Trace(0, ref), None, [Trace(0, rank)])
    assert found.first is not None and found.first.module == "b"
    assert found.unreadable == {"a": ["output: a Opaque"]}
    assert found.lines()[1] == (
        "Not compared (values locating cannot read; return plain tensors, or "
        "SpatialCase.activation_shard a Shard of them): 'a' output: a Opaque"
    )


def test_a_value_with_a_local_shard_is_read_through_it():
    ref = [ev("a", "output", t(1, 2)), ev("b", "output", t(3, 4))]
    rank = [ev("a", "output", t(1, 3).as_subclass(Sharded)), ev("b", "output", t(3, 5))]
    d = first_divergence(Trace(0, ref), None, [Trace(0, rank)]).first
    assert d is not None and d.module == "a"


# ---------------------------------------------------------------------- what to do


MODEL_WORDS = ("reduce_loss", "area weight", "SHT", "HEALPix", "SFNO", "sync_gradients")


def test_what_to_do_speaks_of_the_located_module_and_of_no_particular_model():
    from harness.compare import Mismatch
    from harness.report import REMEDIES, EquivalenceReport

    # a pencil model's transpose, located in the forward of the module that does it
    ref, nudged, ranks = _traces(model_events(), model_events(dec_out=t(5, 7)))
    found = first_divergence(ref, nudged, ranks).first
    assert found is not None
    report = EquivalenceReport("pencil", 4, 4, "", 1, "float64", None)
    report.mismatches = [
        Mismatch(q, "x", 0, 0, 1.0, 1.0) for q in ("loss", "grad", "field", "param")
    ]
    report.first_divergence = found
    todo = str(report).split("What to do:\n")[1].splitlines()
    assert todo[0].startswith("  forward of 'dec' (Lin): what it consumed matches and its")
    assert not any(w in line for w in MODEL_WORDS for line in todo), todo
    assert not any(w in text for w in MODEL_WORDS for text in REMEDIES.values())


def test_what_to_do_about_a_synchronisation_names_the_parameter():
    from harness.report import located_remedy

    found = first_divergence(*_synced(t(4.5, 4.5), before=t(9, 9))).first
    assert found is not None
    assert located_remedy(found).startswith(
        "the ranks' gradients of 'dec.weight' add up to the reference's before its "
        "synchronisation and depart after it: look where it is synchronised"
    )
    found = first_divergence(*_synced(t(4.5, 4.5), before=t(4.5, 4.5), functions=["_R"])).first
    assert found is not None
    assert located_remedy(found).startswith(
        "the gradient of 'dec.weight' departs: look at the backward of 'dec' (_R's backward)"
    )


def test_a_value_whose_arithmetic_raises_is_listed_and_the_rest_is_still_located():
    # a sparse tensor reads as a plain one, but subtracting the reference from it raises
    ref = [ev("a", "output", t(1, 2)), ev("b", "output", t(3, 4))]
    rank = [ev("a", "output", t(1, 3).to_sparse()), ev("b", "output", t(3, 5))]
    found = first_divergence(Trace(0, ref), None, [Trace(0, rank)])
    assert found.first is not None and found.first.module == "b"
    assert list(found.unreadable) == ["a"] and found.unreadable["a"][0].startswith(
        "output: RuntimeError: "
    )


def test_a_parameter_gradient_is_not_blamed_on_its_sync_when_no_activation_gradient_was_compared():
    # the backward hooks saw no activation gradient anywhere (a model computing on the
    # local blocks of its own tensor type): nothing shows they matched, so the sync is
    # not blamed; the gradient is its module's backward, as without backward hooks
    def drop(events):
        return [e for e in events if e.kind not in ("grad_output", "grad_input")]

    d = first_divergence(*_traces(drop(model_events()), drop(model_events(g_w=t(4.5, 4.5)))))
    assert (
        d.first is not None and d.first.cause == "" and d.first.located == "backward of 'dec' (Lin)"
    )


def test_a_module_the_ranks_run_as_another_class_is_named_with_both_classes():
    ranks_events = model_events(dec_out=t(5, 7))
    for e in ranks_events:
        if e.module == "dec":
            e.type = "DistributedLin"
    d = first_divergence(*_traces(model_events(), ranks_events)).first
    assert d is not None and d.located == (
        "forward of 'dec' (DistributedLin on the ranks, Lin in the reference)"
    )
    same = first_divergence(*_traces(model_events(), model_events(dec_out=t(5, 7)))).first
    assert same is not None and same.located == "forward of 'dec' (Lin)"


def _field_traces(blocks):
    """A field of 8 positions on two ranks holding 0:4 and 4:8; ``blocks``: the positions
    each rank says it holds."""
    from harness.divergence import shard_placement

    values = t(*range(10, 18))
    ref = Trace(0, [ev("", "field", values, slot="y")])
    ranks = []
    for r, said in enumerate(blocks):
        mine = ev("", "field", values[4 * r : 4 * r + 4], slot="y")
        mine.placement = shard_placement(torch.arange(*said), 0, 1, None)
        own = torch.arange(4 * r, 4 * r + 4)
        ranks.append(Trace(0, [mine], spatial_rank=r, axes=[Axis(8, own, "position")]))
    return ref, ref, ranks


def test_a_field_block_said_to_be_at_other_positions_is_named_with_where_it_belongs():
    d = first_divergence(*_field_traces([(4, 8), (0, 4)])).first  # the two blocks swapped
    assert d is not None and (d.cause, d.rank, d.located) == ("misplaced", 0, "field 'y'")
    assert (d.belongs, d.said) == ("(position 0:4)", "(position 4:8)")
    assert d.line().startswith(
        "First divergence: field 'y', step 0: rank 0's values are the reference's at "
        "(position 0:4), not at (position 4:8) where it puts them; at (position 4:8): max rel"
    )


def test_a_misplacement_search_that_raises_keeps_the_field_line_and_says_not_located(
    monkeypatch,
):
    import harness.divergence as divergence

    def unreadable(*args, **kwargs):  # a value the search cannot read
        raise TypeError("not a tensor it knows")

    monkeypatch.setattr(divergence, "_elsewhere", unreadable)
    location = first_divergence(*_field_traces([(4, 8), (0, 4)]))
    assert location.first is not None and location.first.cause == ""
    assert location.first.located == "field 'y'"
    assert (
        "Not located: where the values of field 'y' belong (TypeError: not a tensor it knows)"
        in (location.lines())
    )


def test_a_field_block_that_matches_nowhere_is_a_field_divergence_without_a_place():
    ref, _, ranks = _field_traces([(0, 4), (4, 8)])
    ranks[1].events[0].tensor = ranks[1].events[0].tensor + 1  # wrong values, not a block
    d = first_divergence(ref, ref, ranks).first
    assert d is not None and (d.cause, d.rank, d.located) == ("", 1, "field 'y'")
    assert "values are the reference's at" not in d.line()


def test_positions_are_named_as_ranges_or_their_first_few():
    from harness.divergence._place import Placement, span

    grid = Placement((None, torch.tensor([4, 5, 20, 21])), ("", "position"), flatten=(4, 16))
    assert span(grid) == "(lat 0:2, lon 4:6)"
    scattered = Placement((torch.tensor([1, 5, 9, 13]),), ("cell",))
    assert span(scattered) == "(cell 1, 5, 9, ... (4))"


def test_a_misplacement_check_that_raises_leaves_the_field_divergence_standing(monkeypatch):
    import harness.divergence

    def broken(*args, **kwargs):
        raise RuntimeError("a partition it cannot read")

    monkeypatch.setattr(harness.divergence, "block_of", broken)
    d = first_divergence(*_field_traces([(4, 8), (0, 4)])).first
    assert d is not None and (d.located, d.cause) == ("field 'y'", "")
