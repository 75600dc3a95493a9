"""The notice board: a rank's slot reads back as written, never half of two writes."""

from __future__ import annotations

import multiprocessing
from typing import Any

from harness._protocol.board import Board, Slot, State, Writer, members_bits
from harness._protocol.deadlock import ANY_SOURCE
from harness.pool._watch import _slot_op


def test_a_slot_reads_back_what_its_rank_wrote(tmp_path):
    board = Board(str(tmp_path / "board"), 3, create=True)
    assert board.read(1) == Slot()  # never written: nothing known
    pen = Writer(Board(str(tmp_path / "board"), 3), 1)  # the rank maps the same file
    pen.begin(7, now=10.0)
    pen.phase("step 0 forward", 0)
    pen.enter(
        11.5,
        kind=1,
        index=3,
        peer=None,
        tag=0,
        numel=12,
        bounded=False,
        members=members_bits((0, 1, 2)),
        group="0",
        op="all_reduce",
        dtype="float32",
        site="model.py:41 in halo",
    )
    slot = board.read(1)
    assert slot == Slot(
        run_id=7,
        state=State.WAITING,
        step=0,
        started=10.0,
        since=11.5,
        kind=1,
        index=3,
        numel=12,
        members=(0, 1, 2),
        group="0",
        op="all_reduce",
        dtype="float32",
        site="model.py:41 in halo",
        phase="step 0 forward",
    )
    pen.leave(12.0, State.RETURNED)
    after = board.read(1)
    assert (after.state, after.since, after.phase) == (State.RETURNED, 12.0, slot.phase)
    assert not after.waiting
    # the last operation waited on stays, for a crash report to compare with a dead peer's
    assert (after.kind, after.op, after.index, after.site) == (1, "all_reduce", 3, slot.site)
    assert board.read(0) == Slot() and board.read(2) == Slot()  # other slots untouched


def test_long_text_is_cut_and_unknown_members_are_left_empty(tmp_path):
    board = Board(str(tmp_path / "board"), 1, create=True)
    pen = Writer(board, 0)
    pen.begin(1, 0.0)
    pen.enter(
        1.0,
        kind=2,
        index=1,
        peer=70,
        tag=3,
        numel=None,
        bounded=True,
        members=members_bits((0, 70)),  # rank 70 does not fit the 64-bit map
        group="g" * 100,
        op="isend",
        dtype="",
        site="é" * 200,  # two bytes each: cut to 160 bytes, never a broken character
    )
    slot = board.read(0)
    assert slot.group == "g" * 64 and slot.members == () and slot.peer == 70
    assert slot.site == "é" * 80 and slot.numel is None and slot.bounded


def _write_forever(path: str, stop: Any) -> None:
    pen = Writer(Board(path, 1), 0)
    i = 0
    while not stop.is_set():
        i += 1
        # every field of one write carries the same number
        pen.enter(float(i), kind=1, index=i, peer=i, tag=i, numel=i, bounded=False,
                  members=0, group=str(i), op="x" * (i % 30), dtype="", site=str(i))  # fmt: skip


def test_a_reader_never_sees_half_of_one_write_and_half_of_another(tmp_path):
    # the writer is another process, as a rank is: nothing but the sequence lock orders it
    path = str(tmp_path / "board")
    board = Board(path, 1, create=True)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    writer = ctx.Process(target=_write_forever, args=(path, stop))
    writer.start()
    try:
        seen, torn = set(), 0
        while len(seen) < 5_000 and writer.is_alive():
            s = board.read(0)
            if s.index:
                seen.add(s.index)
                torn += not (s.since == s.index == s.peer == s.tag == s.numel == int(s.group))
    finally:
        stop.set()
        writer.join(10)
    assert len(seen) >= 5_000, "the writer died"
    assert torn == 0


def test_a_receive_from_any_source_reads_back_as_any_source_never_as_no_peer(tmp_path):
    board = Board(str(tmp_path / "board"), 1, create=True)
    pen = Writer(board, 0)
    pen.begin(1, 0.0)
    wait = dict(kind=3, index=1, tag=5, numel=2, bounded=False, members=members_bits((0, 1)),
                group="0", op="recv", dtype="float32", site="m.py:3 in f")  # fmt: skip
    pen.enter(1.0, peer=ANY_SOURCE, **wait)  # type: ignore[arg-type]
    assert board.read(0).peer == ANY_SOURCE
    op = _slot_op(board.read(0))
    assert op is not None and op.describe().startswith("recv from any rank (tag 5, #1)")
    pen.enter(2.0, peer=None, **wait)  # type: ignore[arg-type]  # a collective: no peer
    assert board.read(0).peer is None
    pen.enter(3.0, peer=0, **wait)  # type: ignore[arg-type]  # rank 0 is a peer, not "none"
    assert board.read(0).peer == 0
