"""Pickling for the pool's pipes: a plain CPU tensor travels as its bytes.

Python's pickle writes a tensor through ``torch.save`` and reads it back through
``torch.load``, once per tensor: ~0.1 ms each way, and a check's results are a hundred
tensors (every gradient, parameter and field of every step of every rank), so on a small
model the pipes cost more than the judging. A contiguous, dense CPU tensor of class
``torch.Tensor`` itself, not requiring grad and with nothing else attached (no names, no
Python attributes, no conjugate or negative bit) is the same tensor when rebuilt from its
dtype, shape and bytes; it travels so (a view: only its own bytes, where torch's pickling
sends its whole storage). Anything else (a strided view, a nested tensor, a DTensor or other
subclass, a tensor requiring grad) goes through torch's own pickling, as before; a ``Parameter``'s
data travels as bytes inside torch's parameter pickling. Neither way keeps two tensors that
shared a storage sharing it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


def dumps(obj: object) -> bytes:
    """``pickle.dumps(obj)``, plain CPU tensors as their bytes (``WirePickler``)."""
    buffer = io.BytesIO()
    WirePickler(buffer).dump(obj)
    return buffer.getvalue()


class WirePickler(pickle.Pickler):
    """A pickler (highest protocol) that writes a plain CPU tensor as dtype, shape and bytes;
    read back by ``pickle.loads`` (``tensor_from_bytes``)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor or not _plain(obj):
            return NotImplemented
        try:
            # contiguous: its entries lie one after another from its offset, whatever the
            # strides of dimensions of size 1 say (an expanded one has 0)
            flat = obj.detach().as_strided((obj.numel(),), (1,))
            data = flat.view(torch.uint8).numpy().tobytes() if obj.numel() else b""
        except Exception:  # noqa: BLE001 - a kind of tensor not foreseen: torch's pickling
            return NotImplemented
        return tensor_from_bytes, (data, obj.dtype, tuple(obj.shape))


#: whether this torch build has named tensors at all (some builds leave them out)
_NAMED = hasattr(torch.Tensor, "names")


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is rebuilt exactly from its dtype, shape and bytes."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_nested  # strided layout, but its storage holds several tensors
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and not (_NAMED and any(t.names))  # type: ignore[attr-defined]  # names per dim
        and not t.__dict__
        and t.is_contiguous()
    )


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``WirePickler`` wrote: its own writable storage."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
