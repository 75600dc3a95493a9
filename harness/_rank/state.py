"""Process-wide state a run changes, saved before it and put back after it.

``CallerState`` is what ``run_case`` changes in whatever process runs it (the reference's
caller included): RNG states, the default dtype and what it adopted through ``harness.adopt``
(undone down to where the run began). ``RankState`` adds what a rank of a
pool must also hand the next run unchanged: grad mode, anomaly detection, deterministic
algorithms, thread count, working directory, environment variables and torch-harmonics'
process-group globals. torch, numpy and ``random`` are imported at first use: a rank saves
state only after it has set its threads up.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

#: what ``numpy.random.get_state`` returns (the legacy tuple, or the generator's dict)
_NumpyState = dict[str, object] | tuple[str, "npt.NDArray[np.uint32]", int, int, float]


class _Rngs(TypedDict):
    torch_rng: torch.Tensor
    np_rng: _NumpyState
    py_rng: tuple[object, ...]
    dtype: torch.dtype
    undo_depth: int


@dataclass
class CallerState:
    torch_rng: torch.Tensor
    np_rng: _NumpyState
    py_rng: tuple[object, ...]
    dtype: torch.dtype
    undo_depth: int  # harness.adopt's undo stack when the run began: what the run adopted

    @classmethod
    def save(cls) -> CallerState:
        return cls(**_rngs())

    def restore(self) -> None:
        import random

        import numpy as np
        import torch

        from harness.adopt import undo

        try:
            # what the run adopted and its teardown left in place, never what its caller had
            undo(self.undo_depth)
        finally:
            torch.set_rng_state(self.torch_rng)
            np.random.set_state(self.np_rng)
            random.setstate(self.py_rng)
            torch.set_default_dtype(self.dtype)


@dataclass
class RankState(CallerState):
    grad: bool
    anomaly: bool
    deterministic: bool
    threads: int
    cwd: str
    environ: dict[str, str]

    @classmethod
    def save(cls) -> RankState:
        import torch

        return cls(
            **_rngs(),
            grad=torch.is_grad_enabled(),
            anomaly=torch.is_anomaly_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            threads=torch.get_num_threads(),
            cwd=os.getcwd(),
            environ=dict(os.environ),
        )

    def restore(self) -> None:
        import torch

        from harness._base.compat import reset_torch_harmonics_groups

        super().restore()
        torch.set_grad_enabled(self.grad)
        torch.autograd.set_detect_anomaly(self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_num_threads(self.threads)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        if os.environ != self.environ:  # what a run set, unset or changed goes back
            os.environ.clear()
            os.environ.update(self.environ)
        reset_torch_harmonics_groups()


def _rngs() -> _Rngs:
    import random

    import numpy as np
    import torch

    from harness.adopt import pending

    return {
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.get_state(),
        "py_rng": random.getstate(),
        "dtype": torch.get_default_dtype(),
        "undo_depth": pending(),
    }
