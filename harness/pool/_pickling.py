"""A call on its way to the ranks: pickled, with every module it refers to.

A rank function must be importable by module and name; one that is not, or arguments that
cannot be pickled, turn into a ``PicklingProblem`` that says what to change.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from harness._base.wire import WirePickler
from harness.errors import PicklingProblem


def dump_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle a call for the ranks, turning pickling failures into advice."""
    if not callable(fn):
        raise PicklingProblem(f"pool.run needs a callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise PicklingProblem(
            f"rank function {qualname!r} is defined inside a function (or is a lambda), so "
            f"rank processes cannot import it. Move it to module level of {module!r} "
            "(rank processes import functions by module and name)."
        )
    modules: set[str] = set()
    try:
        buffer = io.BytesIO()
        _RecordingPickler(buffer, modules).dump((fn, args, kwargs))
        call = buffer.getvalue()
    except Exception as exc:
        raise PicklingProblem(
            f"cannot send {qualname or fn!r} and its arguments to the ranks: {exc}. "
            "Rank functions must be module-level and their arguments picklable "
            "(tensors, numbers, dataclasses; not open files, locks or lambdas)."
        ) from exc
    # Every module the call refers to (the function's, and the classes of its arguments,
    # e.g. a SpatialCase defined in a script's __main__), with the file the parent loaded it
    # from: the ranks load the same file where the module name alone would not find it.
    where = [(m, getattr(sys.modules.get(m), "__file__", None)) for m in sorted(modules)]
    return pickle.dumps((where, call))


class _RecordingPickler(WirePickler):
    """A pickler that notes the module of every class and function it pickles by name
    (plain CPU tensors travel as their bytes: ``harness._base.wire``)."""

    def __init__(self, file: io.BytesIO, modules: set[str]) -> None:
        super().__init__(file)
        self.modules = modules

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            module = getattr(obj, "__module__", None)
            if module:
                self.modules.add(module)
        return super().reducer_override(obj)
