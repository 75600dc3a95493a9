"""Which floating dtypes a run's values went through: the evidence a precision hint needs.

A float64 run whose errors are the size of float32 rounding is only *probably* rounding: a
logic bug that moves values a little looks the same. ``OutputDtypes`` watches the outputs
of every module during a run (a forward hook per call: one ``isinstance`` and a dtype
compare) and remembers where a floating dtype other than the run's default first came out;
the rank's interceptor does the same for the tensors of every torch.distributed operation
(``harness._rank.intercept``). ``run_case`` puts both in ``RunRecord.dtypes``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch

#: dtype -> the dtypes that are "the same precision" as a run in it (a complex value is two
#: numbers of its real dtype)
_SAME = {
    torch.float64: (torch.float64, torch.complex128),
    torch.float32: (torch.float32, torch.complex64),
    torch.float16: (torch.float16, torch.complex32),
}


def autocast_context(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` on the CPU at ``dtype``, or nothing: what a check's runs compute
    at (``CheckSpec.autocast``), the same on the ranks and in the serial runs."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")


class OutputDtypes:
    """Counts the module outputs whose dtype is floating but not the default's precision.

    Installed (a global forward hook) for the steps of one run, after ``build`` set the
    default dtype; ``close()`` removes it, ``seen()`` says per dtype where it came out first:
    ``{"float32": "the output of 'mixer' (GlobalMean) was float32 (3 calls)"}``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        default = torch.get_default_dtype()
        self.usual = _SAME.get(default, (default,))
        self.names = {id(m): n for n, m in model.named_modules()}
        self.first: dict[torch.dtype, str] = {}
        self.count: Counter[torch.dtype] = Counter()
        hooks = torch.nn.modules.module
        self.handle = hooks.register_module_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
        t = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(t, torch.Tensor):
            return
        dtype = t.dtype
        if dtype in self.usual or not (dtype.is_floating_point or dtype.is_complex):
            return
        self.count[dtype] += 1
        if dtype not in self.first:
            name, what = self.names.get(id(module)), type(module).__name__
            if name is None:  # a module made outside the model
                self.first[dtype] = f"the output of a {what}"
            else:
                self.first[dtype] = (
                    f"the output of '{name}' ({what})" if name else (f"the model's output ({what})")
                )

    def close(self) -> None:
        self.handle.remove()

    def seen(self) -> dict[str, str]:
        out = {}
        for dtype, where in self.first.items():
            n = self.count[dtype]
            calls = f" ({n} module calls)" if n > 1 else ""
            out[dtype_name(dtype)] = f"{where} was {dtype_name(dtype)}{calls}"
        return out


def collective_dtypes(default: torch.dtype) -> dict[str, str]:
    """What this rank's interceptor saw go through torch.distributed in floating dtypes
    other than ``default``'s precision (``{}`` where nothing watches: the reference, or
    under torchrun)."""
    from harness._rank.intercept import TRACKER

    if not TRACKER.active:
        return {}
    usual = {dtype_name(d) for d in _SAME.get(default, (default,))}
    return {d: where for d, where in TRACKER.dtypes.items() if d not in usual}
