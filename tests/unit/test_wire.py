"""The pool's pipes (``harness._base.wire``): a plain CPU tensor travels as its bytes and
arrives the same tensor; anything the bytes cannot carry goes through torch's pickling."""

from __future__ import annotations

import pickle

import pytest
import torch

from harness._base import wire
from tests.unit._dtensor_like import Distributed

PLAIN = {
    "float64": torch.linspace(-3, 3, 12, dtype=torch.float64).reshape(3, 4),
    "float32 0-dim": torch.tensor(-0.0),
    "bfloat16": torch.tensor([1.5, -2.25, float("inf")], dtype=torch.bfloat16),
    "float16 nan": torch.tensor([float("nan"), 65504.0], dtype=torch.float16),
    "complex64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    "complex128": torch.tensor([[1e300 + 1j]], dtype=torch.complex128),
    "int64 big": torch.tensor([2**62 + 1, -(2**63)], dtype=torch.int64),
    "int8": torch.tensor([-128, 127], dtype=torch.int8),
    "bool": torch.tensor([True, False, True]),
    "empty": torch.zeros(0, 3),
    "empty int64, inner dimension 0": torch.zeros(4, 0, dtype=torch.int64),
    "int64 expanded to one entry (stride 0)": torch.tensor(7).expand(1),
}


def _trip(obj):
    return pickle.loads(wire.dumps(obj))


def _same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = lambda t: t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(flat(a), flat(b))


@pytest.fixture
def no_torch_load(monkeypatch):
    """torch's own tensor pickling reads every storage back with ``torch.load``."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("went through torch.load")

    monkeypatch.setattr(torch.storage, "_load_from_bytes", refuse)


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_plain_tensor_arrives_with_its_dtype_shape_and_bits_without_torch_load(
    name, no_torch_load
):
    sent = PLAIN[name]
    got = _trip({"x": [sent]})["x"][0]
    assert type(got) is torch.Tensor and _same_bits(got, sent)
    if got.numel():
        got.view(-1)[0] = got.view(-1)[-1]  # its own, writable storage (no read-only buffer)
        assert _same_bits(sent, PLAIN[name])  # and not the sender's


def test_a_contiguous_view_travels_as_its_own_values(no_torch_load):
    whole = torch.arange(6.0)
    a, b = _trip((whole, whole[2:]))
    assert torch.equal(b, whole[2:]) and b.untyped_storage().nbytes() == 4 * 4
    a[3] = 99.0  # as with torch's pickling, two views of one storage arrive as two
    assert b[1] == 3.0


@pytest.mark.parametrize(
    ("make", "by_torch"),
    [
        pytest.param(lambda: torch.nn.Parameter(torch.ones(2)), False, id="parameter"),
        pytest.param(lambda: torch.ones(2, requires_grad=True), True, id="requires grad"),
        pytest.param(lambda: torch.tensor([1 + 1j]).conj(), True, id="conjugate bit"),
        pytest.param(lambda: torch._neg_view(torch.tensor([1.0, 2.0])), True, id="negative bit"),
        pytest.param(lambda: torch.ones(3, 2).t(), True, id="transposed"),
        pytest.param(lambda: torch.arange(6.0).reshape(2, 3)[:, 1:2], True, id="a column"),
        pytest.param(
            lambda: Distributed(torch.ones(4), torch.ones(2), placements=("Shard(0)",)),
            True,
            id="subclass",
        ),
    ],
)
def test_other_tensors_arrive_as_they_were_sent(make, by_torch):
    sent = make()
    data = wire.dumps(sent)
    assert (b"_load_from_bytes" in data) == by_torch  # torch's own pickling of a storage
    got = pickle.loads(data)
    assert type(got) is type(sent) and got.requires_grad == sent.requires_grad
    assert got.is_conj() == sent.is_conj() and got.stride() == sent.stride()
    assert torch.equal(got.detach().resolve_conj(), sent.detach().resolve_conj())


def test_a_tensor_with_python_attributes_keeps_them():
    sent = torch.ones(2)
    sent.label = "kept"
    assert _trip(sent).label == "kept"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_arrives_whole():
    """Strided and "contiguous", but its storage holds several tensors: torch's own pickling
    carries it (its flat buffer inside travels as bytes)."""
    sent = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    got = _trip(sent)
    assert got.is_nested and [t.tolist() for t in got.unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
