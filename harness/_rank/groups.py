"""Process groups named as the user made them, for the messages of a hang.

torch numbers its groups (``"4"``): a deadlock that reads ``all_reduce #2 on group 4`` names
nothing the user wrote. Each group is named instead by its ranks and the call that made it,
recorded on the rank when the group is created: ``the group of ranks [0, 1] (new_group at
model.py:42)``, ``the world group``. The record comes from watching
``ProcessGroup._set_group_name``, which torch calls on every group it makes (``new_group``,
``split_group``, a ``DeviceMesh``'s, the default one), from Python; no public function of
``torch.distributed`` is replaced. Where that private method is missing (a torch that
renamed it), groups are named by their ranks only.

The label travels with the evidence (``harness._protocol.deadlock.Op.label``, the notice board's
``label``); the rule itself only ever reads group ids.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from harness._base.frames import MODEL_PACKAGES, PACKAGE, plumbing, standard_library

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: group name (torch's id) -> "new_group at model.py:42": where the user's code made it.
#: Kept across runs (groups outlive them); a name torch reuses after the world is made
#: again is written afresh when that group is made.
MADE: dict[str, str] = {}

_MODELS = tuple(PACKAGE + name + os.sep for name in MODEL_PACKAGES)
#: torch's package directory (set by ``watch_creation``): its frames are never the maker
_TORCH = "\0"
#: how many ranks a label lists before it shortens the list (the board's field is 96 bytes)
_LISTED = 8


def made_by(frame: FrameType | None) -> str:
    """``"new_group at model.py:42"``: walking ``frame`` outwards, the innermost frame of
    model code, and the function it called (torch's, or the harness's library's, such as
    ``Topology.grid``). ``""`` when no model code made it: the harness's own groups (a
    plumbing frame, such as the rank's run of a case making its ``Topology``, comes first)."""
    callee: FrameType | None = None
    while frame is not None:
        path = frame.f_code.co_filename
        if plumbing(path):
            return ""
        if not standard_library(path):
            model = not path.startswith(PACKAGE) or path.startswith(_MODELS)
            if model and not path.startswith(_TORCH):
                if callee is None:
                    return ""
                return f"{_name(callee)} at {os.path.basename(path)}:{frame.f_lineno}"
            if "<locals>" not in _name(frame):  # a decorator's wrapper is not what was called
                callee = frame
        frame = frame.f_back
    return ""


def _name(frame: FrameType) -> str:
    """``Topology.grid``, ``new_group``: the function's qualified name (its plain name on
    Pythons without ``co_qualname``)."""
    code = frame.f_code
    return str(getattr(code, "co_qualname", code.co_name))


def label(name: str, members: Sequence[int], world: bool) -> str:
    """``"the group of ranks [0, 1] (new_group at model.py:42)"``; ``"the world group"``."""
    if world:
        return "the world group"
    ranks = list(members)
    listed = ", ".join(map(str, ranks[:_LISTED]))
    notes = [MADE.get(name, "")]
    if len(ranks) > _LISTED:
        listed += f", ..., {ranks[-1]}"
        notes.insert(0, f"{len(ranks)} ranks")
    said = ", ".join(n for n in notes if n)
    return f"the group of ranks [{listed}]" + (f" ({said})" if said else "")


def watch_creation(process_group: type[ProcessGroup]) -> None:
    """Record where each group is made: wrap ``ProcessGroup._set_group_name``, which torch
    calls once on every group it makes, with its name (skipped where it does not exist)."""
    global _TORCH
    import torch

    _TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    original = process_group.__dict__.get("_set_group_name")
    if original is None:
        return

    def set_group_name(pg: ProcessGroup, name: str, *args: object, **kwargs: object) -> object:
        try:
            MADE[str(name)] = made_by(sys._getframe(1))
        except Exception:  # noqa: BLE001 - never break the caller: the ranks still name it
            MADE[str(name)] = ""
        return original(pg, name, *args, **kwargs)

    process_group._set_group_name = functools.wraps(original)(set_group_name)  # type: ignore[method-assign,assignment]
