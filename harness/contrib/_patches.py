"""Attribute patches a contrib case applies inside a run, and their undo.

One stack per process: ``patch`` records the attribute's value as stored (``vars(owner)``,
so a class's ``staticmethod`` comes back as a ``staticmethod``) and ``undo_all`` restores
them, last first, from the case's ``teardown``; the warm rank serves the next test.
"""

from __future__ import annotations

from typing import Any

_STACK: list[tuple[Any, str, Any]] = []


def patch(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name`` (a class or a module) to ``value``; ``undo_all`` puts it back."""
    _STACK.append((owner, name, vars(owner)[name]))
    setattr(owner, name, value)


def undo_all() -> None:
    """Restore every patched attribute, the last patch first."""
    while _STACK:
        owner, name, value = _STACK.pop()
        setattr(owner, name, value)
