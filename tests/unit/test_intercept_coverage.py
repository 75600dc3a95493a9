"""Every public torch.distributed operation is seen by the deadlock proof, the mutants and the
dtype watch, on the torch installed.

The harness sees a rank's operations by watching ``ProcessGroup``'s methods
(``harness._rank.intercept._METHODS``), and torch renames them between releases (2.13 routes
``all_to_all_single``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through new
``*_single`` methods). So nothing here is written from a list of methods: the public
functions are read from ``torch.distributed.distributed_c10d.__all__``, each is called on a
real two-rank gloo group under the interceptor with a recorder beneath it, and the test fails
on any ``ProcessGroup`` method a call reaches that the harness does not watch, on a call the
interceptor noted nothing for, on a method no mutant applies to, and on floating data whose
dtype the watch did not see. A function torch adds fails the first test until it is placed
in ``CALLS`` (how to call it) or ``QUIET`` (why it does not communicate).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

#: public functions that issue no operation on a process group, and why
QUIET = {
    "destroy_process_group": "group management",
    "init_process_group": "group management (its barrier is the store's)",
    "new_group": "group management (its barrier is the store's)",
    "new_subgroups": "group management",
    "new_subgroups_by_enumeration": "group management",
    "split_group": "group management",
    "shrink_group": "group management",
    "get_backend": "a query",
    "get_backend_config": "a query",
    "get_backend_impl": "a query (torch 2.14)",
    "set_timeout": "group configuration (torch 2.14)",
    "get_default_backend_for_device": "a query",
    "get_debug_level": "a query",
    "get_global_rank": "a query",
    "get_group_rank": "a query",
    "get_node_local_rank": "a query",
    "get_pg_count": "a query",
    "get_process_group_ranks": "a query",
    "get_rank": "a query",
    "get_world_size": "a query",
    "is_backend_available": "a query",
    "is_gloo_available": "a query",
    "is_initialized": "a query",
    "is_mpi_available": "a query",
    "is_nccl_available": "a query",
    "is_torchelastic_launched": "a query",
    "is_ucc_available": "a query",
    "is_xccl_available": "a query",
    "supports_complex": "a query",
    "record_comm": "a profiling label",
    "GroupName": "a type (a NewType of str)",
}

#: ProcessGroup methods that are no operation (queries, bookkeeping)
NOT_OPERATIONS = frozenset(
    {
        "rank", "size", "name", "abort", "shutdown", "set_timeout", "boxed", "unbox",
        "get_group_store", "merge_remote_group", "split_group", "use_pg_for_symm_mem_rendezvous",
    }
)  # fmt: skip

#: public functions that move no floating data of the caller's (sizes, pickled bytes)
NO_FLOATS = frozenset(
    {
        "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
        "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
    }
)  # fmt: skip


def _f(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.float32)


#: public functions gloo cannot run (so no gloo rank can call them here), and the
#: ProcessGroup method each reaches: watched all the same, for NCCL under a launcher
GLOO_CANNOT = {
    # torch 2.14: "RuntimeError: Backend gloo does not support gather_single"
    "gather_single": "gather_single",
    "gather_into_tensor": "gather_single",  # deprecated, forwards to gather_single
}


def test_what_gloo_cannot_run_is_watched_all_the_same():
    from harness._rank.intercept import _METHODS

    assert set(GLOO_CANNOT.values()) <= set(_METHODS)


def _calls(rank: int) -> dict[str, Callable[[], Any]]:
    """How rank ``rank`` of 2 calls each public function (on rank 0: the function itself;
    on rank 1, for point-to-point: its counterpart)."""
    import datetime

    other = 1 - rank
    zero = rank == 0
    return {
        "all_reduce": lambda: dist.all_reduce(_f(3)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([_f(3), _f(2)]),
        "broadcast": lambda: dist.broadcast(_f(3), 0),
        "reduce": lambda: dist.reduce(_f(3), 0),
        "all_gather": lambda: dist.all_gather([_f(2), _f(2)], _f(2)),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([[_f(2)], [_f(2)]], [_f(2)]),
        "all_gather_single": lambda: dist.all_gather_single(_f(4), _f(2)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(_f(4), _f(2)),
        "gather": lambda: dist.gather(_f(2), [_f(2), _f(2)] if zero else None, 0),
        "scatter": lambda: dist.scatter(_f(2), [_f(2), _f(2)] if zero else None, 0),
        "reduce_scatter": lambda: dist.reduce_scatter(_f(2), [_f(2), _f(2)]),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(_f(2), _f(4)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(_f(2), _f(4)),
        "all_to_all": lambda: dist.all_to_all([_f(2), _f(2)], [_f(2), _f(2)]),
        # uneven: rank 0 sends 1 and 2 elements and receives 1 and 1; rank 1 the transpose
        "all_to_all_single": lambda: (
            dist.all_to_all_single(_f(2), _f(3), [1, 1], [1, 2])
            if zero
            else dist.all_to_all_single(_f(3), _f(2), [2, 1], [1, 1])
        ),
        "barrier": lambda: dist.barrier(),
        "monitored_barrier": lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=60)),
        "all_gather_object": lambda: dist.all_gather_object([None, None], {"r": rank}),
        "broadcast_object_list": lambda: dist.broadcast_object_list([{"r": rank}], 0),
        "gather_object": lambda: dist.gather_object({"r": rank}, [None, None] if zero else None),
        "scatter_object_list": lambda: dist.scatter_object_list(
            [None], [{"r": 0}, {"r": 1}] if zero else None, 0
        ),
        "send": lambda: dist.send(_f(2), 1) if zero else dist.recv(_f(2), 0),
        "recv": lambda: dist.recv(_f(2), 1) if zero else dist.send(_f(2), 0),
        "recv from any source": lambda: dist.recv(_f(2)) if zero else dist.send(_f(2), 0),
        "isend": lambda: (dist.isend(_f(2), 1) if zero else dist.irecv(_f(2), 0)).wait(),
        "irecv": lambda: (dist.irecv(_f(2), 1) if zero else dist.isend(_f(2), 0)).wait(),
        "batch_isend_irecv": lambda: [
            w.wait()
            for w in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, _f(2), other), dist.P2POp(dist.irecv, _f(2), other)]
            )
        ],
        "send_object_list": lambda: (
            dist.send_object_list([{"r": 0}], 1) if zero else dist.recv_object_list([None], 0)
        ),
        "recv_object_list": lambda: (
            dist.recv_object_list([None], 1) if zero else dist.send_object_list([{"r": 1}], 0)
        ),
    }


CALLED = set(_calls(0))


def _public() -> list[str]:
    """The public functions of torch.distributed's collectives module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return sorted(
            n
            for n in distributed_c10d.__all__
            if callable(getattr(distributed_c10d, n, None))
            and not inspect.isclass(getattr(distributed_c10d, n))
        )


def test_every_public_function_of_torch_distributed_is_called_here_or_said_quiet():
    public = set(_public())
    unplaced = sorted(public - CALLED - set(QUIET) - set(GLOO_CANNOT))
    assert not unplaced, (
        f"torch {torch.__version__} has public torch.distributed functions this test does not "
        f"know: {unplaced}. Add each to CALLS (how to call it on 2 ranks; it is then checked "
        "to be seen by the deadlock proof, the mutants and the dtype watch) or to QUIET (why "
        "it issues no operation on a process group)."
    )
    assert {n for n in CALLED if " " not in n} <= public, "CALLS names a function torch lacks"


# ---------------------------------------------------------------------- the two ranks


def _rank_main(rank: int, store: str, out: str) -> None:
    """Run every call of ``_calls`` under the interceptor, recording what each reached."""
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from torch.distributed import ProcessGroup

    from harness._mutation.catalogue import _BY_METHOD
    from harness._mutation.inject import INJECTOR
    from harness._mutation.mode import RECORD
    from harness._rank import intercept as _intercept

    reached: list[str] = []

    def recorder(name: str, original: Any) -> Any:
        def method(pg: Any, *args: Any, **kwargs: Any) -> Any:
            reached.append(name)
            return original(pg, *args, **kwargs)

        return method

    for name, attr in list(vars(ProcessGroup).items()):
        if name.startswith("__") or inspect.isclass(attr) or not callable(attr):
            continue
        setattr(ProcessGroup, name, recorder(name, attr))
    tracker = _intercept.install()
    tracker.begin(RECORD)
    results = {}
    for fn, call in _calls(rank).items():
        reached.clear()
        INJECTOR.sites.clear()
        tracker.dtypes.clear()
        before = sum(tracker.seen.values()) + tracker.p2p.total()
        call()
        noted = sum(tracker.seen.values()) + tracker.p2p.total() - before
        methods = sorted({m for m in reached if m not in NOT_OPERATIONS and m[0] != "_"})
        methods += sorted({m for m in reached if m in _intercept._METHODS and m[0] == "_"})
        results[fn] = {
            "methods": methods,
            "private": sorted({m for m in reached if m[0] == "_"} - set(_intercept._METHODS)),
            "noted": noted,
            "names": sorted({s.op for s in INJECTOR.sites.values()}),
            "mutable": sorted(
                {s.method for s in INJECTOR.sites.values() if s.method in _BY_METHOD}
            ),
            "sites": sorted({s.method for s in INJECTOR.sites.values()}),
            "dtypes": sorted(tracker.dtypes),
            "files": sorted({w.rsplit(":", 1)[0] for w in INJECTOR.sites}),
        }
    tracker.end()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reached(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What each call reached on rank 0 (the caller of the function under test)."""
    out = tmp_path_factory.mktemp("coverage")
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, torch.multiprocessing as mp\n"
        "from tests.unit.test_intercept_coverage import _rank_main\n"
        f"mp.spawn(_rank_main, args=({str(out / 'store')!r}, {str(out)!r}), nprocs=2)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads((out / "rank0.json").read_text()))


@pytest.mark.parametrize("fn", sorted(CALLED))
def test_every_process_group_method_a_public_function_reaches_is_watched(reached, fn):
    from harness._rank.intercept import _METHODS

    got = reached[fn]
    assert got["methods"], f"dist.{fn} reached no ProcessGroup method: {got}"
    unwatched = [m for m in got["methods"] if m not in _METHODS]
    assert not unwatched, (
        f"dist.{fn} reaches ProcessGroup.{unwatched} on torch {torch.__version__}, which "
        "harness._rank.intercept._METHODS does not watch: a rank that skips it is no proven "
        "deadlock, no mutant reaches it, the dtype watch misses its data"
    )
    assert got["noted"] >= 1, f"the interceptor noted nothing for dist.{fn}: {got}"


@pytest.mark.parametrize("fn", sorted(CALLED))
def test_every_public_function_is_mutated_and_named_as_the_user_wrote_it(reached, fn):
    from harness._protocol.deadlock import SAME_OP

    got = reached[fn]
    unknown = sorted(set(got["sites"]) - set(got["mutable"]))
    assert got["sites"] and not unknown, f"dist.{fn}: the mutants know no mutant of {unknown}"
    # the call site is this file's line, never torch's deprecation wrapper or the harness's
    assert got["files"] == [os.path.abspath(__file__)], got["files"]
    name = fn.split(" ")[0]
    if name not in NO_FLOATS and name != "batch_isend_irecv":
        assert [SAME_OP.get(n, n) for n in got["names"]] == [SAME_OP.get(name, name)], got


@pytest.mark.parametrize("fn", sorted(CALLED - NO_FLOATS))
def test_the_dtype_watch_sees_the_floating_data_of_every_public_function(reached, fn):
    assert reached[fn]["dtypes"] == ["float32"], (
        f"dist.{fn} moved float32 tensors, the dtype watch saw {reached[fn]['dtypes']}"
    )


def test_the_transposes_of_torch_2_13_reach_the_methods_it_routes_them_through(reached):
    # the regression of issue 28: these three were unseen; on torch < 2.13 the old names
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        assert reached["all_to_all_single"]["methods"] == ["all_to_all_single"]
        assert reached["all_gather_into_tensor"]["methods"] == ["all_gather_single"]
        assert reached["reduce_scatter_tensor"]["methods"] == ["reduce_scatter_single"]


def test_the_transposes_get_the_rotation_and_the_swapped_split_sizes(reached):
    from harness._mutation.catalogue import _BY_METHOD

    for method in reached["all_to_all_single"]["methods"]:
        assert {"skip", "rotate", "swap-splits"} <= set(_BY_METHOD[method])
    for method in reached["all_to_all"]["methods"]:
        assert {"skip", "rotate"} <= set(_BY_METHOD[method])
