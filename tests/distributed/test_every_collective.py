"""A rank that skips any public collective is a proven deadlock naming it, within seconds.

Each collective of ``torch.distributed`` that a model may call is issued by every rank but
one; the others wait in it. The harness must prove that from the board (the waiting ranks'
operation and the skipping rank's counts) and name the operation as the user wrote it, long
before the timeout, on the forms torch 2.13 routes through ``ProcessGroup``'s ``*_single``
methods as on the others. The enumeration of the API itself, and which method each function
reaches, is ``tests/unit/test_intercept_coverage.py``.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankDeadlock, RankFailure

#: the rank that skips: not rank 0, so a rooted collective's root is among the waiters
SKIPPER = 1


def _issue(name: str) -> None:
    """``name`` once, as a model would call it, on the default group (4 ranks)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if name == "all_to_all_single":
        dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))
    elif name == "all_to_all":
        dist.all_to_all([torch.empty(2) for _ in range(n)], [torch.ones(2) for _ in range(n)])
    elif name == "all_gather_into_tensor":
        dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))
    elif name == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))
    elif name == "reduce_scatter":
        dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(n)])
    elif name == "all_gather":
        dist.all_gather([torch.empty(2) for _ in range(n)], torch.ones(2))
    elif name == "gather":
        dist.gather(torch.ones(2), [torch.empty(2) for _ in range(n)] if rank == 0 else None)
    elif name == "scatter":
        dist.scatter(torch.empty(2), [torch.ones(2) for _ in range(n)] if rank == 0 else None)
    elif name == "broadcast":
        dist.broadcast(torch.ones(2), 0)
    elif name == "reduce":
        dist.reduce(torch.ones(2), 0)
    elif name == "barrier":
        dist.barrier()
    elif name == "monitored_barrier":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=600))
    elif name == "all_gather_object":
        dist.all_gather_object([None] * n, {"rank": rank})
    elif name == "broadcast_object_list":
        dist.broadcast_object_list([{"rank": rank}], 0)
    else:
        raise AssertionError(name)


def skip_once(name: str) -> None:
    """Every rank but ``SKIPPER`` issues ``name``; ``SKIPPER`` returns at once."""
    import warnings

    if dist.get_rank() == SKIPPER:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates *_tensor names
        _issue(name)


#: (function skipped, the name a waiting rank's proof must give it)
SKIPPED = [
    ("all_to_all_single", "all_to_all_single"),
    ("all_gather_into_tensor", "all_gather_into_tensor"),
    ("reduce_scatter_tensor", "reduce_scatter_tensor"),
    ("all_to_all", "all_to_all"),
    ("reduce_scatter", "reduce_scatter"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("barrier", "barrier"),
    ("monitored_barrier", "monitored_barrier"),
    ("all_gather_object", "all_gather"),
    ("broadcast_object_list", "broadcast"),
]


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
@pytest.mark.parametrize(("skipped", "named"), SKIPPED, ids=[s for s, _ in SKIPPED])
def test_a_rank_that_skips_a_collective_is_a_deadlock_naming_it(spatial, skipped, named):
    t0 = time.monotonic()
    with pytest.raises(RankDeadlock) as info:
        spatial.run(skip_once, skipped, timeout=300)
    took = time.monotonic() - t0
    err = info.value
    print(f"{skipped}: RankDeadlock after {took:.2f} s")  # measured: see the report
    assert err.returned == [SKIPPER], str(err)
    stuck = [p for p in err.problems if p.kind == "deadlock"]
    assert stuck, str(err)
    # an object collective is several: its root may be past the first
    assert all(f"waits in {named} #" in p.summary for p in stuck), str(err)
    gone = f"rank {SKIPPER} never entered it: it returned after 0 collectives"
    assert all(gone in p.summary for p in stuck), str(err)
    assert spatial.run(dist.get_rank) == [0, 1, 2, 3]  # the next run is clean


def skip_then_transpose_back() -> None:
    """A pencil layer's two transposes; rank 1 skips the first, so its second meets the
    others' first with twice the data: gloo aborts the ranks that receive too much."""
    import warnings

    n = dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if dist.get_rank() != SKIPPER:
            dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))  # the transpose
        dist.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n))  # the transpose back


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_collective_that_gloo_aborts_names_the_rank_that_skipped_it(spatial):
    with pytest.raises(RankFailure) as info:
        spatial.run(skip_then_transpose_back, timeout=300)
    err = info.value
    crashed = [p for p in err.problems if p.kind == "crash"]
    if not crashed:  # gloo happened not to abort: then the proof must name the skipper
        assert isinstance(err, RankDeadlock), str(err)
        assert "rank 1 " in str(err), str(err)
        return
    assert SKIPPER not in [p.rank for p in crashed]  # the victims died, not the culprit
    assert all("killed by SIGABRT" in p.summary for p in crashed), str(err)
    # a victim whose board slot shows the wait it died in names the skipper; gloo may abort
    # a rank before its slot shows the wait (about 1 run in 5 on a loaded machine): that
    # victim has no evidence to give, and is not asked for any
    for victim in (p.summary for p in crashed if "died waiting in" in p.summary):
        assert "it died waiting in all_to_all_single #1 on the world group" in victim, victim
        assert f"rank {SKIPPER} " in victim and "in skip_then_transpose_back" in victim
        assert f"(rank {SKIPPER} skipped one, or added one, before it)" in victim
    assert spatial.run(dist.get_rank) == [0, 1, 2, 3]  # a fresh pool for the next run
