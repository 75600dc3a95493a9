"""What the ranks printed during a test, attached to its report (long output cut, the whole
saved to a file), and the collective sites they reached, kept for mutation testing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.goldens import golden_stem
from harness.plugin.mutants import collect_sites
from harness.pool import RankPool
from harness.pool.launcher import LauncherRunner

#: Rank output longer than this (characters) is cut in the report; the whole is saved.
OUTPUT_LIMIT = 8000


class RankOutput:
    """Hears the ranks of one test (``node``); long output is saved under ``tmp``'s base."""

    def __init__(self, node: pytest.Item, tmp: pytest.TempPathFactory | None) -> None:
        self._node = node
        self._tmp = tmp

    @contextlib.contextmanager
    def heard(self, pools: list[RankPool | LauncherRunner]) -> Iterator[None]:
        """Whatever the ranks of ``pools`` do inside (a list the block may still add to):
        what they printed attached to the test, and the collective sites they reached kept
        for mutation testing."""
        try:
            yield
        finally:
            for pool in dict.fromkeys(pools):
                self.attach(pool.last_outputs)
                collect_sites(self._node, pool)

    def attach(self, outputs: list[str]) -> None:
        """What each rank printed, as a report section; long output is cut to its first and
        last lines, and the whole of it saved to a file that the section names."""
        for rank, text in enumerate(outputs):
            if not text.strip():
                continue
            if len(text) > OUTPUT_LIMIT:
                stem = golden_stem(self._node.nodeid).replace("/", ".")
                path = self._directory() / f"{stem}.rank{rank}.txt"
                path.write_text(text)
                text = cut(text, path)
            self._node.add_report_section("call", f"rank {rank} stdout", text)

    def _directory(self) -> Path:
        assert self._tmp is not None, "long rank output needs the session's tmp_path_factory"
        path = self._tmp.getbasetemp() / "spatial-output"
        path.mkdir(parents=True, exist_ok=True)
        return path


def cut(text: str, path: Path) -> str:
    """The head and tail of a long output, and where the whole of it is."""
    head, tail = text[: OUTPUT_LIMIT // 4], text[-(OUTPUT_LIMIT * 3 // 4) :]
    left_out = len(text) - len(head) - len(tail)
    return (
        f"{head}\n... {left_out} characters left out; the whole output ({len(text)} "
        f"characters) is in {path} ...\n{tail}"
    )
