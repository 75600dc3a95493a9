"""Process groups named as the user made them (``harness._rank.groups``): by their ranks and
the call that made it, found on the stack when torch names the group."""

from __future__ import annotations

import sys

import pytest

from harness._rank import groups

#: a stand-in for torch's distributed_c10d: new_group -> a helper that names the group (where
#: the watcher walks the stack), wrapped in a decorator's local function as torch 2.13 does
LIBRARY = """
import functools, sys

def _time_logger(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapper

def _new_process_group_helper(made_by):
    return made_by(sys._getframe(0))

@_time_logger
def new_group(made_by):
    return _new_process_group_helper(made_by)
"""


@pytest.fixture
def torch_like(tmp_path, monkeypatch):
    path = tmp_path / "torch" / "distributed" / "distributed_c10d.py"
    path.parent.mkdir(parents=True)
    namespace: dict[str, object] = {}
    exec(compile(LIBRARY, str(path), "exec"), namespace)
    monkeypatch.setattr(groups, "_TORCH", str(tmp_path / "torch") + "/")
    return namespace


def test_the_maker_is_the_function_the_model_line_called_not_the_decorator_s_wrapper(
    torch_like,
):
    line = sys._getframe(0).f_lineno + 1
    made = torch_like["new_group"](groups.made_by)
    assert made == f"new_group at test_group_labels.py:{line}"


def test_a_group_no_model_code_made_has_no_maker(torch_like, monkeypatch):
    assert torch_like["_new_process_group_helper"](lambda frame: groups.made_by(None)) == ""
    # made from the harness's plumbing (its Topology for a run): no model line to name
    here = __file__
    monkeypatch.setattr(groups, "plumbing", lambda path: path == here)
    assert torch_like["new_group"](groups.made_by) == ""


def test_a_group_is_named_by_its_ranks_and_its_maker_and_the_world_group_as_such(monkeypatch):
    monkeypatch.setitem(groups.MADE, "4", "new_group at model.py:42")
    assert groups.label("4", [1, 2], world=False) == (
        "the group of ranks [1, 2] (new_group at model.py:42)"
    )
    assert groups.label("9", [0, 3], world=False) == "the group of ranks [0, 3]"  # maker unknown
    assert groups.label("0", range(4), world=True) == "the world group"
    many = groups.label("9", range(64), world=False)
    assert many == "the group of ranks [0, 1, 2, 3, 4, 5, 6, 7, ..., 63] (64 ranks)"
    assert len(many.encode()) <= 96  # the board's field
    monkeypatch.setitem(groups.MADE, "9", "Topology.grid at model.py:7")
    assert groups.label("9", range(64), world=False).endswith(
        "..., 63] (64 ranks, Topology.grid at model.py:7)"
    )
