"""What a rollout golden stores of the reference's rollout: a few steps, each field strided.

Beside the rollout's record (``harness.rollout.RolloutRecord.samples``) and read by the
golden policy (``harness.goldens``), which imports it: so the rollout needs nothing of the
goldens, and the goldens' report, which names the rollout's record, closes no circle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness._records.run import FieldRecord

ROLLOUT_PREFIX = "rollout/"
#: At most this many values of each field at each stored step. A rollout golden pins the
#: reference's trajectory, not its every value: a bug that moves a field moves it over
#: many positions (a wrong halo, a wrong mean), so a strided sample of 1024 sees it, and
#: 10 stored steps x 1024 float32 values keep one field's share of a golden at ~40 kB
#: (the training golden of the test SFNO case is ~100 kB), small enough to review and
#: commit.
ROLLOUT_ELEMENTS = 1024
_ROLLOUT_NAME = re.compile(r"^rollout/step(?P<step>\d+)/(?P<field>.+)$")


def rollout_golden_steps(steps: int) -> list[int]:
    """The steps of an ``steps``-step rollout a golden stores: 0, 1, 2, 4, 8, ... (the
    powers of two below ``steps``) and the last, ``steps - 1``.

    Why these: an inference bug shows at the step where it enters, mostly the first few
    (0 or 1 for every inference fault of FAULTS.md), and rounding grows exponentially
    in a chaotic rollout, so steps doubling apart sample its growth evenly; the last step
    pins where the rollout ends. 150 steps store 10, 1000 store 11.

    >>> rollout_golden_steps(150)
    [0, 1, 2, 4, 8, 16, 32, 64, 128, 149]
    >>> rollout_golden_steps(3)
    [0, 1, 2]
    """
    if steps < 1:
        return []
    picked = {0, steps - 1}
    k = 1
    while k < steps:
        picked.add(k)
        k *= 2
    return sorted(picked)


def sample_stride(shape: Sequence[int], cap: int = ROLLOUT_ELEMENTS) -> int:
    """The stride of a field's strided sample (every ``stride``-th value of it flattened):
    the smallest that keeps at most ``cap`` values, made coprime with the field's last
    dimension, so that the samples walk across its columns (longitudes, cells) instead of
    falling down the same few (a stride of 20 over 20 longitudes would sample one).

    >>> sample_stride((2, 3, 12, 20))  # 1440 values: 2 would do, 3 is coprime with 20
    3
    >>> sample_stride((4, 8))  # small enough: every value
    1
    """
    numel = math.prod(shape)
    stride = max(1, -(-numel // cap))
    last = shape[-1] if shape else 1
    while stride > 1 and math.gcd(stride, last) != 1:
        stride += 1
    return stride


def rollout_name(step: int, field: str) -> str:
    """The golden's name of ``field`` at rollout step ``step``: ``rollout/step3/state``."""
    return f"{ROLLOUT_PREFIX}step{step}/{field}"


def parse_rollout_name(name: str) -> tuple[int, str] | None:
    """``(step, field)`` of a rollout golden's tensor name; ``None`` for any other name."""
    m = _ROLLOUT_NAME.match(name)
    return None if m is None else (int(m["step"]), m["field"])


def rollout_length(names: Iterable[str]) -> int:
    """The rollout steps a set of golden names holds (its last stored step is the last)."""
    steps = [s for s, _ in filter(None, map(parse_rollout_name, names))]
    return max(steps) + 1 if steps else 0


def in_golden_order(names: Iterable[str]) -> list[str]:
    """Names sorted, a rollout's by step (``step2`` before ``step16``), after the rest."""

    def key(name: str) -> tuple[int, int, str]:
        parsed = parse_rollout_name(name)
        return (0, 0, name) if parsed is None else (1, parsed[0], parsed[1])

    return sorted(names, key=key)


@dataclass(frozen=True)
class RolloutSamples:
    """The reference's rollout as a golden stores it: the fields of the steps
    ``rollout_golden_steps`` picks, each flattened and strided to at most ``cap`` values
    when larger (``sample_stride``), else whole in its own shape. Keyed fields
    (``Shard.keyed``) are left out, as the rollout check leaves them out."""

    steps: int
    tensors: dict[str, torch.Tensor]
    #: one line per field: its shape, dtype and how it was sampled (for the provenance)
    sampling: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, reference: Sequence[Mapping[str, FieldRecord]], cap: int = ROLLOUT_ELEMENTS
    ) -> RolloutSamples:
        tensors: dict[str, torch.Tensor] = {}
        sampling: dict[str, str] = {}
        for k in rollout_golden_steps(len(reference)):
            for name, rec in reference[k].items():
                if rec.keyed:
                    continue
                v = rec.values.detach()
                stride = sample_stride(tuple(v.shape), cap)
                if stride > 1:
                    v = v.reshape(-1)[::stride]
                    how = f"flattened, one value in {stride} ({v.numel()} of {rec.values.numel()})"
                else:
                    how = "every value"
                tensors[rollout_name(k, name)] = v.to("cpu").clone()
                sampling.setdefault(
                    name, f"{name}: {tuple(rec.values.shape)} {_dtype(v.dtype)}, {how}"
                )
        return cls(len(reference), tensors, tuple(sampling.values()))

    def provenance(self) -> dict[str, Any]:
        """What a golden records of its rollout: the steps rolled out and stored, and how
        each field was sampled."""
        return {
            "rollout_steps": self.steps,
            "rollout_stored_steps": rollout_golden_steps(self.steps),
            "rollout_sampling": list(self.sampling),
        }


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
