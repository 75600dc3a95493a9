"""Which frames are the harness's plumbing: one definition, from the package's layout.

The stacks here are real Python frames whose code carries the file names of a rank's stack
(multiprocessing's start, the rank's loop, ``run_case``, a built-in stepper, the harness's
collectives): compiled from small sources under those names, so the walk sees what it sees on
a rank without starting one.
"""

from __future__ import annotations

import multiprocessing.process
import os
import sys
from types import FrameType
from typing import Any

import harness
from harness._base import frames as _frames
from harness._rank import intercept as _intercept

PACKAGE = os.path.dirname(os.path.abspath(harness.__file__))
STEPPER = os.path.join(PACKAGE, "steppers", "mlp.py")
CONTRIB = os.path.join(PACKAGE, "contrib", "fme.py")
COLLECTIVES = os.path.join(PACKAGE, "collectives.py")
RUN_CASE = os.path.join(PACKAGE, "_rank", "run.py")
RANK = os.path.join(PACKAGE, "_rank", "loop.py")
START = os.path.abspath(multiprocessing.process.__file__)
USER = "/home/someone/model.py"


def _chain(files: list[str], innermost: Any) -> Any:
    """A function that calls through one frame per file (outermost first) and then
    ``innermost()``; each frame's line is 4 (the call, after two blank lines and the def)."""
    call = innermost
    for path in reversed(files):
        scope: dict[str, Any] = {"inner": call}
        exec(compile("\n\ndef f():\n    return inner()\n", path, "exec"), scope)
        call = scope["f"]
    return call


def _stack(files: list[str]) -> FrameType:
    frames: list[FrameType] = []
    _chain(files, lambda: frames.append(sys._getframe(1)))()
    return frames[0]


def test_plumbing_is_the_harnesss_internals_but_not_its_models_or_library():
    assert _frames.plumbing(RUN_CASE) and _frames.plumbing(RANK)
    assert _frames.plumbing(os.path.join(PACKAGE, "_rank", "intercept.py"))
    assert _frames.plumbing(os.path.join(PACKAGE, "a_module_added_later.py"))
    assert not _frames.plumbing(STEPPER) and not _frames.plumbing(CONTRIB)
    assert not _frames.plumbing(COLLECTIVES)
    assert not _frames.plumbing(USER) and not _frames.plumbing(START)


def test_the_user_site_of_a_built_in_stepper_is_its_line_not_multiprocessings():
    # a rank: multiprocessing starts the rank's loop, which runs the case, whose stepper
    # calls the harness's collectives
    frame = _stack([START, RANK, RUN_CASE, STEPPER, COLLECTIVES])
    assert _frames.user_site(frame) == ("mlp.py:4", "collectives.py:4")


def test_the_walk_ends_where_the_harness_started_the_users_code():
    # the library called straight from run_case: nothing of the user's lies beyond it
    frame = _stack([START, RANK, RUN_CASE, COLLECTIVES])
    assert _frames.user_site(frame) == ("", "collectives.py:4")
    # an operation of the harness's own: no user site at all (never multiprocessing's)
    assert _frames.user_site(_stack([START, RANK, RUN_CASE])) == ("", "")


def test_the_dtype_watch_names_the_stepper_line_of_a_collective():
    # as on a rank: the interceptor's watcher (a frame of _rank/intercept.py) asks for the site
    watcher = os.path.join(PACKAGE, "_rank", "intercept.py")
    chain = _chain([START, RANK, RUN_CASE, STEPPER, COLLECTIVES, watcher], _intercept._user_site)
    assert chain() == "mlp.py:4"


def test_the_user_site_of_a_users_model_is_its_own_line():
    frame = _stack([START, RANK, RUN_CASE, USER, COLLECTIVES])
    assert _frames.user_site(frame) == ("model.py:4", "collectives.py:4")


#: what a rank printed in CI when its peer joined the group, raised at once and left
GLOO_PEER_LEFT = (
    "Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:20688. This is typically caused by a remote worker crashing."
)


def test_a_rank_that_could_not_join_its_group_reports_torchs_message_not_the_rank_loop(
    monkeypatch, tmp_path
):
    """A rank still forming the group when a peer raised and left fails inside
    ``init_process_group``: the harness's work, so no frame of the rank's loop is shown, and
    the problem reads as a lost peer, ordered after the rank that failed first."""
    import pickle

    import torch.distributed as dist

    from harness._protocol.events import RunCall
    from harness._rank import loop
    from harness.errors import RankProblem, failure_from

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(GLOO_PEER_LEFT)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    payload = pickle.dumps(([], pickle.dumps((print, (), {}))))
    call = RunCall(1, payload, str(tmp_path / "store"), [], timeout=1.0, reuse=False)
    ok, fields = loop._run_one(0, 4, call, "gloo", _intercept.Tracker())
    assert not ok
    assert fields["summary"] == f"could not join the process group: RuntimeError: {GLOO_PEER_LEFT}"
    assert GLOO_PEER_LEFT in fields["detail"]
    assert RANK not in fields["detail"]
    assert "Traceback" in fields["detail"]  # the frames that are not the harness's stay
    cause = RankProblem(2, "error", "ValueError: halo of the wrong width")
    failure = failure_from([RankProblem(0, "error", **fields), cause], world=4, timeout=60)
    assert str(failure).startswith("rank 2/4 raised ValueError: halo of the wrong width")
