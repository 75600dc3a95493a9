"""run_case in one process (the reference's way): what it records, restores and refuses."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from harness import ConfigError, Outputs, Shard, SpatialCase, Topology
from harness._rank.run import _step_seed, run_case
from harness.steppers.mlp import CoupledMLPCase

SINGLE = Topology.single()


class Configurable(SpatialCase):
    """A tiny case whose every answer can be broken from outside."""

    dtype = torch.float64

    def __init__(self, **overrides):
        self.overrides = overrides

    def build(self, topo):
        if "build" in self.overrides:
            return self.overrides["build"]
        return torch.nn.Linear(2, 1)

    def batch(self, topo, step):
        if "batch" in self.overrides:
            return self.overrides["batch"]
        return torch.randn(3, 2)

    def forward(self, model, batch, topo):
        if "raise_in" in self.overrides and self.overrides["raise_in"] == "forward":
            raise RuntimeError("boom in forward")
        y = model(batch)
        loss = self.overrides.get("loss", lambda y: (y**2).mean())(y)
        fields = self.overrides.get("fields", {"y": y})
        return self.overrides.get("outputs", Outputs(loss, fields))


def test_run_case_leaves_the_callers_rng_and_dtype_as_it_found_them():
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(3)
    expected = (torch.rand(1).item(), np.random.rand(), random.random())
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(3)
    run_case(CoupledMLPCase(npos=5), SINGLE, steps=2, lr=0.1, seed=0)
    assert (torch.rand(1).item(), np.random.rand(), random.random()) == expected
    assert torch.get_default_dtype() == torch.float32


def test_run_case_records_every_step():
    record = run_case(CoupledMLPCase(npos=5), SINGLE, steps=3, lr=0.1, seed=0)
    assert len(record.steps) == 3
    assert set(record.init) == {"encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"}
    assert record.steps[0].grads.keys() == record.init.keys()
    assert record.steps[0].loss.shape == ()
    assert "out" in record.steps[0].fields
    # SGD: params after step 0 = init - lr * grad
    w0, g0 = record.init["encoder.weight"], record.steps[0].grads["encoder.weight"]
    assert torch.equal(record.steps[0].params["encoder.weight"], torch.add(w0, g0, alpha=-0.1))


def test_the_same_seed_gives_the_same_run():
    a = run_case(CoupledMLPCase(npos=5), SINGLE, steps=1, lr=0.1, seed=4)
    b = run_case(CoupledMLPCase(npos=5), SINGLE, steps=1, lr=0.1, seed=4)
    assert torch.equal(a.steps[0].loss, b.steps[0].loss)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"build": None}, "build returned None; it must return the torch.nn.Module"),
        ({"build": "model"}, "build returned a str; it must return a torch.nn.Module"),
        ({"loss": lambda y: y}, "Outputs.loss has shape (3, 1); it must be a scalar"),
        ({"loss": lambda y: 1.5}, "Outputs.loss is a float; it must be a scalar torch.Tensor"),
        (
            {"loss": lambda y: (y**2).mean().detach()},
            "Outputs.loss does not depend on any trainable parameter",
        ),
        ({"outputs": (1, 2)}, "forward must return harness.Outputs(loss, fields), got tuple"),
        ({"fields": {"y": [1, 2]}}, "Outputs.fields['y'] is a list; give a torch.Tensor"),
    ],
    ids=[
        "none",
        "not-a-module",
        "not-scalar",
        "not-a-tensor",
        "detached",
        "not-outputs",
        "bad-field",
    ],
)
def test_a_bad_answer_from_the_case_is_one_clear_error(overrides, says):
    with pytest.raises(ConfigError) as info:
        run_case(Configurable(**overrides), SINGLE, steps=1, lr=0.1, seed=0)
    assert says in str(info.value)
    assert str(info.value).startswith("Configurable")


def _shard(index, dim=0):
    return {"fields": {"y": Shard(torch.zeros(3, 1), index, dim)}}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            {"batch": None},
            "Configurable.batch returned None for step 0; it must return this rank's share of "
            "the step's batch (a tensor, or a dict, tuple or dataclass of tensors) for forward "
            "to use (a missing `return`?)",
        ),
        (
            {"batch": "samples.nc"},
            "Configurable.batch returned a str for step 0; it must return this rank's share of "
            "the step's batch (a tensor, or a dict, tuple or dataclass of tensors) for forward "
            "to use (a missing `return`?)",
        ),
        (
            _shard(torch.tensor([[0, 1, 2]])),
            "Configurable.forward: Shard of field 'y' has an index of shape (1, 3); it must be "
            "1-D (positions along one dim). For a 2-D block of a lat x lon grid use "
            "Shard.grid(values, rows, cols, nrows, ncols); for items named by several keys, "
            "Shard.keyed",
        ),
        (
            _shard(torch.tensor([0.0, 1.5, 2.0])),
            "Configurable.forward: Shard of field 'y' has a float32 index; positions must be "
            "integers (torch.long): a float index would be truncated, silently moving values",
        ),
        (
            _shard(torch.tensor([True, False, True])),
            "Configurable.forward: Shard of field 'y' has a bool index (a mask); give the "
            "positions themselves: mask.nonzero().flatten() (or torch.arange(n)[mask])",
        ),
        (
            _shard(torch.tensor([0, 1])),
            "Configurable.forward: Shard of field 'y' has 2 positions in its index but 3 values "
            "along dim 0 (values of shape (3, 1)); one position per value",
        ),
        (
            _shard(torch.tensor([0, -1, 2])),
            "Configurable.forward: Shard of field 'y' has a negative position (-1) in its "
            "index; positions are global and count from 0",
        ),
        (
            _shard([0, 1, 2], dim=5),
            "Configurable.forward: Shard of field 'y': dim=5 but its values have 2 dimension(s)",
        ),
        (
            _shard("0:3"),
            "Configurable.forward: Shard of field 'y' has an index of type str; give a 1-D "
            "LongTensor of global positions, or a slice",
        ),
    ],
    ids=[
        "batch-none",
        "batch-str",
        "index-2d",
        "index-float",
        "index-bool",
        "index-length",
        "index-negative",
        "dim",
        "index-str",
    ],
)
def test_a_bad_batch_or_shard_index_is_one_clear_error_naming_it(overrides, says):
    with pytest.raises(ConfigError) as info:
        run_case(Configurable(**overrides), SINGLE, steps=1, lr=0.1, seed=0)
    assert str(info.value) == says


def test_a_shard_index_given_as_a_list_of_ints_is_taken_as_positions():
    record = run_case(Configurable(**_shard([2, 0, 1])), SINGLE, steps=1, lr=0.1, seed=0)
    assert record.steps[0].fields["y"].index.tolist() == [2, 0, 1]
    assert record.steps[0].fields["y"].index.dtype == torch.long


def test_a_model_without_parameters_is_compared_on_loss_and_fields():
    class NoParams(torch.nn.Module):
        def forward(self, x):
            return x * 2

    record = run_case(Configurable(build=NoParams()), SINGLE, steps=2, lr=0.1, seed=0)
    assert record.init == {} and record.steps[1].grads == {} and record.steps[1].params == {}
    torch.manual_seed(_step_seed(0, 1))  # what the harness seeds before step 1's batch
    x = torch.randn(3, 2, dtype=torch.float64)
    assert torch.equal(record.steps[1].fields["y"].values, 2 * x)
    assert torch.equal(record.steps[1].loss, ((2 * x) ** 2).mean())


def test_an_exception_says_which_phase_of_which_step_raised_it():
    with pytest.raises(RuntimeError, match="boom in forward") as info:
        run_case(Configurable(raise_in="forward"), SINGLE, steps=1, lr=0.1, seed=0)
    assert info.value.harness_phase == "step 0 forward"


def test_progress_reports_every_phase_in_order():
    seen = []
    run_case(
        Configurable(),
        SINGLE,
        steps=2,
        lr=0.1,
        seed=0,
        progress=lambda phase, step: seen.append((phase, step)),
    )
    assert seen == [
        ("build", None),
        ("step 0 batch", 0),
        ("step 0 forward", 0),
        ("step 0 backward", 0),
        ("step 0 optimizer step", 0),
        ("step 1 batch", 1),
        ("step 1 forward", 1),
        ("step 1 backward", 1),
        ("step 1 optimizer step", 1),
        ("teardown", None),
    ]


class Patching(Configurable):
    """Patches a library function in build, as an adapter for a real model might."""

    def build(self, topo):
        import json

        self.saved = json.dumps
        json.dumps = lambda obj: "patched"  # the patch
        return super().build(topo)

    def teardown(self, model, topo):
        import json

        json.dumps = self.saved


@pytest.mark.parametrize("raise_in", [None, "forward"])
def test_teardown_undoes_what_build_patched_even_when_the_run_fails(raise_in):
    import json

    real = json.dumps
    overrides = {"raise_in": raise_in} if raise_in else {}
    try:
        run_case(Patching(**overrides), SINGLE, steps=1, lr=0.1, seed=0)
    except RuntimeError:
        assert raise_in == "forward"
    assert json.dumps is real
