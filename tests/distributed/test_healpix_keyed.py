"""The HEALPix stepper's tokens as a keyed field: a varying number of tokens per (sample, cell),
packed per rank as WeatherGenerator's decoder packs them, checked item by item by key."""

from __future__ import annotations

import re

import pytest
import torch

from harness import ConfigError, Shard, Topology, check_equivalence
from harness._judges import key_text
from harness._rank.run import _step_seed
from harness.steppers.healpix import TOKENS2, HealpixCase, token_keys

RANKS = 4
EVEN_TOKENS = {"nside": 2, "tokens": 3}

# (spatial_size, case kwargs) on 4 ranks, so one warm pool serves them all
LAYOUTS = {
    "even": (None, EVEN_TOKENS),
    # rank 1 owns no cell, rank 3 owns cells but sees no observation and holds no token
    "empty_domains": (None, {**EVEN_TOKENS, "bounds": (0, 20, 20, 30, 48), "empty_ranks": (3,)}),
    "spatial2_x_data2": (2, TOKENS2),
    "shuffled": (None, {**EVEN_TOKENS, "token_order": "shuffled"}),
    "spatial2_x_data2_shuffled": (2, {**TOKENS2, "token_order": "shuffled"}),
}


@pytest.mark.parametrize(("spatial_size", "kwargs"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_ragged_tokens_are_equivalent_item_by_item_in_any_packing_order(
    spatial, spatial_size, kwargs
):
    report = check_equivalence(
        HealpixCase(**kwargs), ranks=RANKS, spatial_size=spatial_size, pool=spatial.pool(RANKS)
    )
    assert report.ok, str(report)
    assert "0..3 tokens per cell" in report.partition
    # float64, as the per-cell forecast: only reordered sums (measured a few 1e-13)
    assert report.stats["field"].compared and report.stats["field"].max_abs < 1e-11


class Tampered(HealpixCase):
    """Rank 2 drops, duplicates or corrupts the first token it packed (after the check
    recorded nothing else: the model and its gradients are untouched)."""

    def __init__(self, tamper: str, **kwargs):
        super().__init__(**kwargs)
        self.tamper = tamper

    def forward(self, model, batch, topo):
        out = super().forward(model, batch, topo)
        if topo.spatial_group is None or topo.rank != 2:
            return out
        shard = out.fields["prediction"]
        assert isinstance(shard, Shard)
        values, keys = shard.values, shard.keys
        if self.tamper == "drop":
            values, keys = values[1:], keys[1:]
        elif self.tamper == "duplicate":
            values, keys = torch.cat([values, values[:1]]), torch.cat([keys, keys[:1]])
        else:
            values = values.clone()
            values[0, 1] += 1.0
        out.fields["prediction"] = Shard.keyed(values, keys, cell_column=1)
        return out


def _first_token_of_rank_2(case: HealpixCase, step: int) -> tuple[list[int], int, int]:
    """The key rank 2 packs first at ``step``, the tokens of its (sample, cell) and of its
    cell, from the rank's batch drawn as the harness draws it."""
    topo = Topology(RANKS, 2, RANKS, 2, object(), 1, 0, None)
    torch.manual_seed(_step_seed(0, step))
    batch = case.batch(topo, step)
    lo = case.partition(topo).bounds[2]
    key = token_keys(batch["tokens"], lo, int(batch["first_sample"]))[0].tolist()
    cell = batch["tokens"][:, key[1] - lo]
    return key, int(cell[key[0]]), int(cell.sum())


def _tampered(spatial, tamper):
    case = Tampered(tamper, **EVEN_TOKENS)
    report = check_equivalence(case, ranks=RANKS, pool=spatial.pool(RANKS))
    return report, [_first_token_of_rank_2(case, s) for s in range(2)]


def test_a_dropped_token_is_a_coverage_finding_naming_its_key_and_rank(spatial):
    report, firsts = _tampered(spatial, "drop")
    assert report.quantities == {"coverage"}, str(report)
    expected = []
    for s, (key, tokens, in_cell) in enumerate(firsts):
        missing = f"{key_text(key, 1)} of the reference missing: this rank holds the"
        if tokens > 1:  # rank 2 still holds the other tokens of the (sample, cell)
            expected.append((s, 2, f"{missing} rest of ({key[0]}, {key[1]}, *)"))
        elif in_cell > 1:  # or the other sample's tokens of the cell
            expected.append((s, 2, f"{missing} other items of cell {key[1]}"))
        else:
            expected.append((s, None, f"{key_text(key, 1)} of the reference held by no rank"))
    assert [(m.step, m.rank, m.where) for m in report.mismatches] == expected


def test_a_duplicated_token_is_a_coverage_finding_naming_its_key_and_rank(spatial):
    report, firsts = _tampered(spatial, "duplicate")
    keys = [key_text(key, 1) for key, _, _ in firsts]
    assert report.quantities == {"coverage"}, str(report)
    assert [(m.step, m.rank, m.where) for m in report.mismatches] == [
        (s, 2, f"{keys[s]} held 2 times here") for s in range(2)
    ]


def test_a_corrupted_token_is_a_field_finding_naming_its_key_cell_and_owner(spatial, tmp_path):
    report, firsts = _tampered(spatial, "corrupt")
    keys = [key_text(key, 1) for key, _, _ in firsts]
    assert report.quantities == {"field"}, str(report)
    assert [(m.step, m.rank, m.where, m.count) for m in report.mismatches] == [
        (s, None, f"[1] {keys[s]} on rank 2", 1) for s in range(2)
    ]
    assert "[1] " + keys[0] + " on rank 2" in str(report)
    # the error map: per cell, owners in nested ranges (a cell without a token is drawn as
    # its predecessor's), the corrupted token's cell the worst
    (first, *_) = report.field_errors
    cell = firsts[0][0][1]
    owners = first.owners.tolist()
    assert (first.unit, first.error.shape, owners, int(first.error.argmax())) == (
        "cell",
        (48,),
        sorted(owners),
        cell,
    )
    assert owners[cell] == 2 and float(first.error[cell]) == pytest.approx(1.0, abs=1e-12)
    pytest.importorskip("matplotlib")
    from harness.plugin import write_error_maps

    paths = write_error_maps(report, str(tmp_path), "tests/x.py::test_keyed")
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        f"tests.x.test_keyed.prediction.step{s}.png" for s in range(2)
    ]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"tokens": -1}, "tokens=-1: give the most tokens per (sample, cell) as an int >= 1"),
        ({"tokens": 2.5}, "tokens=2.5: give the most tokens per (sample, cell) as an int >= 1"),
        ({"tokens": 2, "token_order": "random"}, "token_order='random': use 'packed' or"),
    ],
    ids=["negative", "float", "order"],
)
def test_a_bad_token_setting_is_refused_with_the_fix(kwargs, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        HealpixCase(**kwargs)


def test_token_keys_name_every_token_of_every_sample_and_cell_once():
    counts = torch.tensor([[0, 3, 1], [2, 0, 0]])
    keys = token_keys(counts, lo=10, first_sample=4)
    assert keys.tolist() == [[4, 11, 0], [4, 11, 1], [4, 11, 2], [4, 12, 0], [5, 10, 0], [5, 10, 1]]
    assert token_keys(torch.zeros(2, 0, dtype=torch.long), 5, 0).shape == (0, 3)


def test_ranks_pack_sample_major_or_shuffled_and_the_reference_cell_major():
    from types import SimpleNamespace

    def packed(order, topo, lo):
        case = HealpixCase(**EVEN_TOKENS, token_order=order)
        torch.manual_seed(_step_seed(0, 0))
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            batch = case.batch(topo, 0)
        finally:
            torch.set_default_dtype(old)
        full = torch.zeros(2, 48, 2, dtype=torch.float64)
        return case.token_prediction(full, batch, SimpleNamespace(lo=lo), topo).keys

    rank2 = Topology(RANKS, 2, RANKS, 2, object(), 1, 0, None)
    keys = packed("packed", rank2, 24)
    shuffled = packed("shuffled", rank2, 24)
    assert keys.tolist() == sorted(keys.tolist())  # sample, cell, token
    assert shuffled.tolist() != keys.tolist() and sorted(shuffled.tolist()) == keys.tolist()
    ref = packed("packed", Topology.single(), 0)
    assert ref[:, 1].tolist() == sorted(ref[:, 1].tolist())  # cell by cell
    assert ref.tolist() != sorted(ref.tolist())
