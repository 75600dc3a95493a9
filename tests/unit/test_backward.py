"""The evidence locating records about a backward: a parameter's gradient before the hooks
a case put on it, and the autograd Functions between a module's output and its parameters."""

from __future__ import annotations

from typing import Any

import torch

from harness.equivalence._backward import first_hook, functions_to


def test_the_first_hook_sees_the_gradient_before_a_hook_registered_earlier_changes_it():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    p.register_hook(lambda g: g * 2)  # a case's synchronisation, registered in build
    seen: list[torch.Tensor] = []
    handle = first_hook(p, lambda g: seen.append(g.clone()))
    assert handle is not None
    (3 * p).sum().backward()
    assert seen[0].tolist() == [3.0, 3.0, 3.0]  # as the backward made it
    assert p.grad is not None and p.grad.tolist() == [6.0, 6.0, 6.0]  # the case's hook ran
    handle.remove()
    p.grad = None
    (3 * p).sum().backward()
    assert len(seen) == 1 and p.grad.tolist() == [6.0, 6.0, 6.0]  # removed; the case's kept


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


class _Shift(_Scale):
    pass


def test_the_functions_between_an_output_and_a_parameter_are_named_nearest_first():
    w, b, v = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    before = _Shift.apply(torch.ones(2) * v)  # v is used before the call, not in it
    tapped = before * 1  # stands in for the call's input tap: the walk never goes below it
    out = _Scale.apply(_Shift.apply(tapped * w)) + b
    params = {id(w): "w", id(b): "b", id(v): "v"}
    assert functions_to([out], params, [tapped.grad_fn]) == {"w": ("_Shift", "_Scale")}
    assert functions_to([out], params, [])["v"] == ("_Shift", "_Scale")  # below the input
    assert functions_to([out], {id(w): "w"}, [], (_Shift,)) == {"w": ("_Scale",)}
