"""Who hears of a check as it ends: the plugin's summary rows for checks a test ran without
the ``spatial`` fixture's help (``check_equivalence(..., pool=spatial.pool())`` inside a
Hypothesis test, a bare ``check_layouts``).

``observed`` wraps ``check_equivalence`` and ``check_layouts``: when one returns, each
listener in the context (``listening``) is told its report, unless the call ran inside
another observed call or a ``quiet`` block (a sweep's layouts, the fixture's own check,
which makes its row itself). Outside a listener nothing happens: the library pays one
context-variable read per check.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: told each outermost report (an ``EquivalenceReport`` or a ``LayoutsReport``)
Listener = Callable[[object], None]

_listeners: ContextVar[tuple[Listener, ...]] = ContextVar("harness_listeners", default=())
_depth: ContextVar[int] = ContextVar("harness_observed_depth", default=0)


def observed(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``'s report told to the listeners, when ``fn`` is the outermost observed call."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        token = _depth.set(_depth.get() + 1)
        try:
            result = fn(*args, **kwargs)
        finally:
            _depth.reset(token)
        if _depth.get() == 0:
            for listener in _listeners.get():
                listener(result)
        return result

    return wrapper


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Checks inside are nobody's news (the caller reports them itself)."""
    token = _depth.set(_depth.get() + 1)
    try:
        yield
    finally:
        _depth.reset(token)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """``listener`` hears of every outermost check that ends inside."""
    token = _listeners.set((*_listeners.get(), listener))
    try:
        yield
    finally:
        _listeners.reset(token)
