"""Every place the harness touches another library's private internals, and why.

Written for CPython 3.10-3.13, torch 2.13-2.14 and torch-harmonics 0.8.0-0.9.3. Each
function says what it touches and what happens when the internal is gone: the next release
of a library should break this module, and only this module, and degrade gracefully.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

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
    stack): what tells ``harness._preload`` it is in the server, not in a user's process.
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

        names: dict[Any, str] = dict(c10d._world.pg_names)
    except Exception:  # noqa: BLE001 - the internal moved: fall back to the default group
        names = {dist.group.WORLD: "default"}
    out = {}
    for pg, name in names.items():
        try:
            seq = int(pg._get_sequence_number_for_group())
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group without a sequence number: skip it
            continue
        out[str(name)] = (seq, ranks)
    return out


def group_name(pg: Any) -> str:
    """The name torch gave a process group (``"0"`` for the default one), the same on every
    rank. Private: ``distributed_c10d._world.pg_names``; without it, ``pg.group_name``."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return str(c10d._world.pg_names[pg])
    except Exception:  # noqa: BLE001 - the internal moved
        return str(getattr(pg, "group_name", "?"))


def sequence_number(pg: Any) -> int:
    """How many operations this rank has issued on ``pg`` (collectives and point-to-point,
    from Python or C++). Private: ``ProcessGroup._get_sequence_number_for_group``."""
    return int(pg._get_sequence_number_for_group())


def operations_issued() -> int | None:
    """How many operations this rank has issued on all its groups together (a progress
    counter: it moves with every collective and send/recv, whoever issues it, Python code,
    DDP's reducer or a bound function alike). ``None`` if it cannot be read right now."""
    try:
        return sum(seq for seq, _ in group_sequence_numbers().values())
    except Exception:  # noqa: BLE001 - e.g. groups being created by the main thread
        return None


def current_frame(thread_id: int) -> Any:
    """The Python frame thread ``thread_id`` is executing now, or ``None``.

    ``sys._current_frames`` (CPython; documented, underscore-named "for specialized
    purposes"): read from another thread while the main thread waits inside a collective.
    """
    return sys._current_frames().get(thread_id)


#: torch.distributed functions that can leave an operation in flight after they return:
#: those with ``async_op=`` and the point-to-point ones that always return a work.
_ASYNC = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


class WorkTracker:
    """Remembers every operation a rank started asynchronously, to find those left pending.

    Wraps the public ``torch.distributed`` functions of ``_ASYNC`` (module attributes, so
    every caller that looks them up as ``dist.all_reduce`` is seen; code that bound the
    function itself at import is not, and then only the sequence-number check of the fence
    guards it). The wrapper costs one Python call and returns what the function returned.
    """

    def __init__(self) -> None:
        self.works: list[tuple[Any, str]] = []
        self._ids: set[int] = set()
        self._installed: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in _ASYNC:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._installed:
                self._installed[name] = fn
                setattr(dist, name, self._wrap(fn, name))

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._installed.items():
            setattr(dist, name, fn)
        self._installed.clear()

    def clear(self) -> None:
        self.works.clear()
        self._ids.clear()

    def _wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if result is not None:
                works = result if isinstance(result, list) else [result]
                for work in works:
                    if hasattr(work, "is_completed") and id(work) not in self._ids:
                        self._ids.add(id(work))
                        self.works.append((work, _describe(name, args, kwargs)))
            return result

        return tracked

    def pending(self, grace: float) -> list[str]:
        """The operations still in flight after waiting up to ``grace`` seconds for them."""
        deadline = time.monotonic() + grace
        left = list(self.works)
        while left:
            left = [(w, what) for w, what in left if not _completed(w)]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        return [what for _, what in left]


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a failed work is not pending
        return True


def _describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``"isend to rank 1 (tag 0) at model.py:12 in halo"``."""
    text = name
    if name in ("isend", "irecv"):
        peer_key = "dst" if name == "isend" else "src"
        peer = kwargs.get(peer_key, args[1] if len(args) > 1 else None)
        tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
        text += f" {'to' if name == 'isend' else 'from'} rank {peer} (tag {tag})"
    elif name != "batch_isend_irecv":
        text += "(async_op=True)"
    return f"{text}, issued at {_call_site()}"


def _call_site() -> str:
    """The innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    here = os.path.dirname(os.path.dirname(__file__))
    while frame is not None:
        path = frame.f_code.co_filename
        in_torch = f"{os.sep}torch{os.sep}" in path
        if not in_torch and path != __file__:
            short = os.path.relpath(path, here) if path.startswith(here) else path
            return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "(unknown)"


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


_ORIGINAL_TRANSPOSE: list[Any] = []


def restore_transposes() -> None:
    """Undo ``use_uneven_transposes`` (a no-op if it was not applied): a model that brings
    its own answer to gloo's uneven all_to_all (fme's ``patch_gloo_alltoall``) must be
    tested on it, not on the harness's."""
    primitives = sys.modules.get("torch_harmonics.distributed.primitives")
    if primitives is not None and _ORIGINAL_TRANSPOSE:
        setattr(primitives, "_transpose", _ORIGINAL_TRANSPOSE.pop())  # noqa: B010


def _transpose_uneven(
    tensor: Any,
    dim0: int,
    dim1: int,
    dim1_split_sizes: list[int],
    group: Any = None,
    async_op: bool = False,
) -> tuple[list[Any], list[int], None]:
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
