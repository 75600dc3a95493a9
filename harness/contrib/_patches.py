"""The contrib cases' attribute patches: ``harness.adopt``'s undo stack, under the names the
adapters first used (kept for code written against them)."""

from __future__ import annotations

from harness.adopt import patch
from harness.adopt import undo as undo_all

__all__ = ["patch", "undo_all"]
