"""One ``CheckSpec`` per check: built and checked once from ``check_equivalence``'s
arguments, then handed whole, with the case, to every rank entry (training, rollout,
locating) instead of a list of values by position."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any, ClassVar

import pytest
import torch

from harness import ConfigError, Outputs, SpatialCase, check_equivalence
from harness._rank.predict import rollout_entry
from harness._rank.run import rank_entry
from harness.case.declared import CheckSpec
from harness.equivalence._locating import _locate_entry
from harness.equivalence._locating_rollout import _rollout_trace_entry


class Drawn(SpatialCase):
    """A linear layer on a batch drawn from the seed (so a rank given another seed, or
    another learning rate, than the reference computes something else); ``builds`` counts
    every build, in any process of the test."""

    dtype = torch.float64  # the check is about what crosses, not rounding: float64, exact
    builds: ClassVar[list[str]] = []

    def build(self, topo):
        Drawn.builds.append("build")
        return torch.nn.Linear(4, 4)

    def batch(self, topo, step):
        return torch.randn(3, 4)

    def forward(self, model, batch, topo):
        out = model(batch)
        return Outputs(out.square().mean(), {"out": out})

    def predict(self, model, batch, topo, steps):
        x, out = batch, []
        for _ in range(steps):
            x = torch.tanh(model(x))
            out.append({"x": x})
        return out


class NoPredict(Drawn):
    predict = SpatialCase.predict  # type: ignore[assignment]


class Recording:
    """A runner of one rank in this process that keeps every call it was given and hands
    the rank its arguments through pickle, as a pool's rank receives them."""

    world_size = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any], float | None]] = []

    def run(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        self.calls.append((fn.__name__, args, kwargs, timeout))
        return [fn(*pickle.loads(pickle.dumps(args)), **kwargs)]


def test_one_spec_crosses_to_the_ranks_for_training_rollout_and_locating(in_process):
    case, pool = Drawn(), Recording()
    report = check_equivalence(
        case, ranks=1, pool=pool, steps=3, lr=0.05, seed=7, rollout=2, timeout=30.0, locate=True
    )
    assert report.ok, report
    asked = CheckSpec(1, 1, steps=3, lr=0.05, seed=7, rollout=2, timeout=30.0, locate=True)
    assert [c[0] for c in pool.calls] == ["rank_entry", "rollout_entry", "_locate_entry"]
    for _, args, kwargs, timeout in pool.calls:
        assert args[0] == asked and args[1] is case  # the spec whole, then the case
        assert kwargs == {} and timeout == 30.0  # nothing beside it by keyword
    assert len(pool.calls[0][1]) == 3  # and the reference's initial values (None here)
    assert pickle.loads(pickle.dumps(asked)) == asked


def test_every_rank_entry_takes_the_spec_first_and_the_case_second():
    for entry in (rank_entry, rollout_entry, _locate_entry, _rollout_trace_entry):
        params = list(inspect.signature(entry).parameters.values())
        assert [p.name for p in params[:2]] == ["spec", "case"], entry.__name__
        assert params[0].annotation == "CheckSpec", entry.__name__


class Refusing:
    """A runner that fails the test if any rank is ever asked to run."""

    world_size = 4

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        raise AssertionError(f"{fn.__name__} ran although the check's arguments were bad")


@pytest.mark.parametrize(
    ("case", "bad", "message"),
    [
        (Drawn(), {"steps": 0}, "steps must be >= 1, got 0"),
        (Drawn(), {"spatial_size": 3}, "spatial_size=3 does not divide the world of 4 ranks"),
        (Drawn(), {"mesh": (3,)}, r"mesh=\(3,\) holds 3 ranks but the spatial group has 4"),
        (Drawn(), {"mesh": (2, 2)}, r"has 2 axes but Drawn.mesh_dims is 1"),
        (Drawn(), {"rollout": -1}, "rollout=-1 for Drawn: give the number of steps"),
        (NoPredict(), {"rollout": 2}, "NoPredict has no predict"),
        (Drawn(), {"autocast": torch.float32}, "autocast=torch.float32: give torch.bfloat16"),
    ],
    ids=["steps", "spatial_size", "mesh", "mesh_dims", "rollout", "predict", "autocast"],
)
def test_a_bad_value_is_one_config_error_before_the_reference_or_any_rank_runs(case, bad, message):
    Drawn.builds.clear()
    with pytest.raises(ConfigError, match=message):
        check_equivalence(case, ranks=4, pool=Refusing(), **bad)
    assert Drawn.builds == []  # not even the reference was built


def test_the_spec_is_frozen_and_holds_its_mesh_as_a_tuple_of_ints():
    spec = CheckSpec(4, 4, [2, 2])  # type: ignore[arg-type]  # a list, as a user may give it
    assert spec.mesh == (2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1  # type: ignore[misc]
