"""The evidence locating records about a rank's backward beside the hooked trace: each
parameter's gradient before any synchronisation, and the autograd Functions a module's
backward runs through.

A parameter's gradient that departs may be wrong because the synchronisation (a hook
summing it over the group, DDP's reducer, a hook after accumulation) is wrong, or because
the backward that made it is. What the rank's backward handed the parameter, before any of
that ran, tells them apart: ``first_hook`` puts a hook on the parameter ahead of every hook
the case registered (tensor hooks run in registration order, before accumulation; DDP's
reducer and ``register_post_accumulate_grad_hook`` run after it).

``functions_to`` walks the graph of one module call, from its output down to its own
parameters (never past the call's inputs), and names the user's ``torch.autograd.Function``
classes on the way: where a module's backward is its own code (a ring attention's), that is
where its bug lives.

Rank-side code: imports no pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils.hooks import RemovableHandle

#: the most graph nodes one module call's walk visits: a graph that reaches further (a
#: tensor with history kept on the module, outside its inputs) is not named, never slowed on
WALK_LIMIT = 20_000


def first_hook(p: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle | None:
    """``hook`` on ``p``'s incoming gradient, run before every hook already on it (those a
    case registered in ``build``: a synchronisation); ``None`` where it cannot be put first.

    Autograd reads a leaf's hooks from ``p._backward_hooks`` in the dict's own order (not
    an ``OrderedDict``'s ``move_to_end`` order), so the dict is rebuilt with ``hook`` first.
    """
    try:
        handle: RemovableHandle = p.register_hook(hook)
        hooks = p._backward_hooks
        if not isinstance(hooks, dict):
            handle.remove()
            return None
        others = [(k, v) for k, v in hooks.items() if k != handle.id]
        hooks.clear()
        hooks[handle.id] = hook
        hooks.update(others)
        return handle
    except (AttributeError, RuntimeError, TypeError):  # a subclass, an older torch
        return None


def functions_to(
    outputs: Iterable[torch.Tensor],
    params: dict[int, str],
    inputs: Iterable[Any],
    skip: tuple[type, ...] = (),
) -> dict[str, tuple[str, ...]]:
    """For each parameter (``id`` of the tensor -> name), the user's autograd Function
    classes on the graph from ``outputs`` down to it, the nearest to the parameter first;
    the walk stops at ``inputs`` (the grad_fn nodes of the call's inputs) and at
    ``WALK_LIMIT`` nodes (then nothing is named). ``skip``: Function classes not named (the
    harness's own taps)."""
    nodes: dict[int, Any] = {}  # id -> node, kept alive so ids stay unique
    reach: dict[int, frozenset[str]] = {}
    order: list[Any] = []  # post-order: a node after everything below it
    stop = {id(n) for n in inputs if n is not None}
    stack: list[tuple[Any, bool]] = [(t.grad_fn, False) for t in outputs if t.grad_fn is not None]
    while stack:
        node, done = stack.pop()
        if done:
            found: set[str] = set()
            if id(node) not in stop:
                variable = getattr(node, "variable", None)  # an AccumulateGrad
                if variable is not None and id(variable) in params:
                    found.add(params[id(variable)])
                for child, _ in node.next_functions:
                    if child is not None:
                        found |= reach.get(id(child), frozenset())
            reach[id(node)] = frozenset(found)
            order.append(node)
            continue
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        if len(nodes) > WALK_LIMIT:
            return {}
        stack.append((node, True))
        if id(node) in stop:
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) not in nodes:
                stack.append((child, False))
    out: dict[str, list[str]] = {}
    for node in order:
        cls = getattr(node, "_forward_cls", None)
        if not isinstance(node, BackwardCFunction) or cls is None or issubclass(cls, skip):
            continue
        for name in reach[id(node)]:
            names = out.setdefault(name, [])
            if cls.__name__ not in names:
                names.append(cls.__name__)
    return {name: tuple(v) for name, v in out.items()}
