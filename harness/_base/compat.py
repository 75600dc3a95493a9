"""Every place the harness touches another library's private internals, and why.

Written for CPython 3.10-3.13, torch 2.13-2.14 and torch-harmonics 0.8.0-0.9.3. Each
function says what it touches and what happens when the internal is gone: the next release
of a library should break this module, and only this module, and degrade gracefully.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

# ---------------------------------------------------------------------- multiprocessing


def stop_forkserver() -> None:
    """Stop this process's multiprocessing fork server now.

    Private: ``multiprocessing.forkserver._forkserver._stop()`` (CPython 3.8+). The server
    would exit by itself once this process is gone (it watches a pipe we hold), but "gone"
    includes interpreter teardown; stopping it at exit leaves nothing of ours running after
    we return. Without the internal, it exits on its own a moment later.
    """
    from multiprocessing import forkserver

    with contextlib.suppress(Exception):
        forkserver._forkserver._stop()  # type: ignore[attr-defined]


def exit_fast_at_exit() -> None:
    """Make this process skip interpreter teardown when it exits (``os._exit`` at exit).

    For the fork server, which imports torch: when its owner dies (even by SIGKILL) it sees
    EOF on its pipe and raises ``SystemExit``; tearing down torch's modules then took 6-10 s
    on a loaded machine, during which it outlived the session. Its rank children never run
    ``atexit`` handlers (multiprocessing ends them with ``os._exit``), and the pid check
    keeps the handler to the process that registered it. Public API only.
    """
    import atexit

    pid = os.getpid()

    def _exit() -> None:
        if os.getpid() == pid:
            os._exit(0)

    atexit.register(_exit)


def inside_forkserver_start() -> bool:
    """True while multiprocessing's fork server runs its preload (its ``main`` is on the
    stack): what tells ``harness._rank.preload`` it is in the server, not in a user's process.
    Public API only (the stack and the module's file name)."""
    target = os.path.join("multiprocessing", "forkserver.py")
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(target):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


# ---------------------------------------------------------------------- torch.distributed


def group_sequence_numbers() -> dict[str, tuple[int, tuple[int, ...]]]:
    """Every process group this rank belongs to: name -> (operations issued, global ranks).

    Private: ``ProcessGroup._get_sequence_number_for_group`` (counts every collective and
    point-to-point operation this rank issued on the group) and
    ``distributed_c10d._world.pg_names`` (every group, also those user code made with
    ``new_group``). Group names are given in creation order, the same on every rank.
    Without them: the default group only, or nothing (the caller then cannot prove a
    group clean and starts afresh).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    try:
        from torch.distributed import distributed_c10d as c10d

        names: dict[ProcessGroup | None, object] = {g: n for g, n in c10d._world.pg_names.items()}
    except Exception:  # noqa: BLE001 - the internal moved: fall back to the default group
        names = {dist.group.WORLD: "default"}
    out = {}
    for pg, name in names.items():
        try:
            seq = int(cast(_Sequenced, pg)._get_sequence_number_for_group())
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group without a sequence number: skip it
            continue
        out[str(name)] = (seq, ranks)
    return out


class _Sequenced(Protocol):
    """A process group's private counter, which torch's stubs do not list."""

    def _get_sequence_number_for_group(self) -> int: ...


def group_name(pg: ProcessGroup) -> str:
    """The name torch gave a process group (``"0"`` for the default one), the same on every
    rank. Private: ``distributed_c10d._world.pg_names``; without it, ``pg.group_name``."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return str(c10d._world.pg_names[pg])
    except Exception:  # noqa: BLE001 - the internal moved
        return str(getattr(pg, "group_name", "?"))


def sequence_number(pg: ProcessGroup) -> int:
    """How many operations this rank has issued on ``pg`` (collectives and point-to-point,
    from Python or C++). Private: ``ProcessGroup._get_sequence_number_for_group``."""
    return int(cast(_Sequenced, pg)._get_sequence_number_for_group())


def operations_issued() -> int | None:
    """How many operations this rank has issued on all its groups together (a progress
    counter: it moves with every collective and send/recv, whoever issues it, Python code,
    DDP's reducer or a bound function alike). ``None`` if it cannot be read right now."""
    try:
        return sum(seq for seq, _ in group_sequence_numbers().values())
    except Exception:  # noqa: BLE001 - e.g. groups being created by the main thread
        return None


def current_frame(thread_id: int) -> FrameType | None:
    """The Python frame thread ``thread_id`` is executing now, or ``None``.

    ``sys._current_frames`` (CPython; documented, underscore-named "for specialized
    purposes"): read from another thread while the main thread waits inside a collective.
    """
    return sys._current_frames().get(thread_id)


# ---------------------------------------------------------------------- torch RNG


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)`` for this process, without its cost where nothing needs it.

    ``torch.manual_seed`` also seeds every accelerator kind torch was built for; for a kind
    not initialised yet (CUDA, XPU, MTIA) it queues the seed for later, each with a
    formatted stack of the caller: 0.1 ms a call from a shallow stack, more from pytest's,
    three calls a training run, on every rank and in the reference, even where no such
    device exists or ever can. Where none of them is
    available and no custom device is registered (``torch._C._get_privateuse1_backend_name``:
    private; read defensively), seeding the CPU generator is all ``torch.manual_seed`` does
    that can ever matter (MPS seeds itself only where it exists). Anywhere else:
    ``torch.manual_seed`` itself.
    """
    import torch

    if _accelerators_possible():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


_ACCELERATORS: list[bool] = []  # computed once a process: availability does not change


def _accelerators_possible() -> bool:
    if not _ACCELERATORS:
        import torch

        kinds = [getattr(torch, kind, None) for kind in ("cuda", "xpu", "mtia")]
        available = any(k is not None and k.is_available() for k in kinds)
        mps = getattr(torch.backends, "mps", None)
        available = available or (mps is not None and mps.is_available())
        try:
            custom = torch._C._get_privateuse1_backend_name() != "privateuseone"
        except Exception:  # noqa: BLE001 - the internal is gone: assume a custom device
            custom = True
        _ACCELERATORS.append(available or custom)
    return _ACCELERATORS[0]


# ---------------------------------------------------------------------- torch-harmonics


def reset_torch_harmonics_groups() -> None:
    """Forget the polar/azimuth groups torch-harmonics keeps in module globals.

    Private: ``torch_harmonics.distributed.utils._POLAR_PARALLEL_GROUP``,
    ``_AZIMUTH_PARALLEL_GROUP`` and ``_IS_INITIALIZED`` (0.8.0-0.9.3). ``thd.init`` sets
    them and nothing public unsets them; a later run on a warm rank must not find the
    previous run's destroyed groups there. A no-op where the module or names are absent.
    """
    th = sys.modules.get("torch_harmonics.distributed.utils")
    if th is None:
        return
    for name, value in (
        ("_POLAR_PARALLEL_GROUP", None),
        ("_AZIMUTH_PARALLEL_GROUP", None),
        ("_IS_INITIALIZED", False),
    ):
        if hasattr(th, name):
            setattr(th, name, value)


def use_uneven_transposes() -> None:
    """Route torch-harmonics 0.8's SHT transposes through ``all_to_all_single`` (idempotent).

    Private: ``torch_harmonics.distributed.primitives._transpose`` (0.8.x). 0.8.0 exchanges a
    list of chunks with ``dist.all_to_all``, which gloo only accepts when every chunk has the
    same shape, so any uneven split (``mmax = nlon // 2 + 1`` is odd, so even a 2-way azimuth
    split) fails there. The replacement computes the same numbers; only the transport
    differs. 0.9 pads uneven gloo transposes itself (and its ``_transpose`` may have another
    contract), so it is left alone.
    """
    import torch_harmonics
    from torch_harmonics.distributed import primitives

    version = tuple(int(p) for p in torch_harmonics.__version__.split(".")[:2] if p.isdigit())
    original = getattr(primitives, "_transpose", None)
    if version < (0, 9) and original is not None and original is not _transpose_uneven:
        _ORIGINAL_TRANSPOSE[:] = [original]
        primitives._transpose = _transpose_uneven


_ORIGINAL_TRANSPOSE: list[Callable[..., object]] = []


def restore_transposes() -> None:
    """Undo ``use_uneven_transposes`` (a no-op if it was not applied): a model that brings
    its own answer to gloo's uneven all_to_all (fme's ``patch_gloo_alltoall``) must be
    tested on it, not on the harness's."""
    primitives = sys.modules.get("torch_harmonics.distributed.primitives")
    if primitives is not None and _ORIGINAL_TRANSPOSE:
        setattr(primitives, "_transpose", _ORIGINAL_TRANSPOSE.pop())  # noqa: B010


def _transpose_uneven(
    tensor: torch.Tensor,
    dim0: int,
    dim1: int,
    dim1_split_sizes: list[int],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> tuple[list[torch.Tensor], list[int], None]:
    """torch-harmonics 0.8's ``primitives._transpose`` on ``all_to_all_single``: same contract.

    ``all_to_all_single`` takes uneven split sizes on every backend, so the chunks travel
    flattened and are reshaped on arrival.
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch_harmonics.distributed import split_tensor_along_dim

    size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    send = [c.contiguous() for c in split_tensor_along_dim(tensor, dim=dim0, num_chunks=size)]
    dim0_split_sizes = [c.shape[dim0] for c in send]
    recv_shapes = []
    for n in dim1_split_sizes:  # from each rank: my chunk of dim0, its part of dim1
        shape = list(send[rank].shape)
        shape[dim1] = n
        recv_shapes.append(shape)
    flat = [torch.view_as_real(c) if c.is_complex() else c for c in send]
    pair = 2 if tensor.is_complex() else 1
    recv_numels = [int(np.prod(s)) * pair for s in recv_shapes]
    recv = torch.empty(sum(recv_numels), dtype=flat[0].dtype, device=tensor.device)
    dist.all_to_all_single(
        recv,
        torch.cat([c.reshape(-1) for c in flat]),
        output_split_sizes=recv_numels,
        input_split_sizes=[c.numel() for c in flat],
        group=group,
    )
    out = []
    for chunk, shape in zip(recv.split(recv_numels), recv_shapes):
        if tensor.is_complex():
            out.append(torch.view_as_complex(chunk.view(*shape, 2)))
        else:
            out.append(chunk.view(shape))
    return out, dim0_split_sizes, None
