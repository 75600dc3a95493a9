"""Keyed fields (``Shard.keyed``): every rank's items matched with the reference's by
key, coverage of the keys over the whole run, error maps per HEALPix cell."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from harness._judges.judge import Judge, Layout, position_text
from harness._records.run import FieldError, FieldRecord
from harness.compare import Mismatch, Quantity
from harness.report.hints import boundary_hint

KEYED_HINT = (
    "return a keyed field as Shard.keyed(values, keys) on every rank and in the reference "
    "(there the whole field, in any packing order): items are matched by key"
)
KEY_WIDTH_HINT = (
    "name every item by the same key columns on every rank and in the reference, "
    "e.g. (sample, cell, token)"
)
GLOBAL_SAMPLE_HINT = (
    "with data groups, keys are matched across all groups (the reference holds every "
    "sample): key each sample by its global index, data_share(n, topo).start + the local one"
)


def check_keyed_field(
    judge: Judge, name: str, step: int, ref: FieldRecord, fields: list[FieldRecord]
) -> tuple[list[Mismatch], list[FieldError]]:
    """A keyed field (``Shard.keyed``): every rank's items matched with the reference's by key.

    Coverage first: each reference key must be held by exactly one rank of the whole run,
    all data groups together (the reference holds every sample and each group its share,
    so keys must name samples globally); a key held by no rank, by several ranks, twice by
    one rank, or not in the reference is a ``coverage`` finding naming the key and the rank.
    A key missing from a rank that holds the rest of its (all columns but the last) prefix,
    say the other tokens of its (sample, cell), is charged to that rank. Then every item
    held exactly once is compared with the reference's item of the same key (the ``field``
    finding names the key, and its cell with a ``cell_column``); error maps are per cell.
    """
    found: list[Mismatch] = []
    ref_keys = _reference_keys(name, step, ref, fields, found)
    if ref_keys is None:
        return found, []
    column = (
        ref.cell_column
        if ref.keyed
        else next((f.cell_column for f in fields if f.cell_column is not None), None)
    )
    job = _KeyedJob(name, step, judge.layout, ref_keys, column, ref.keyed)
    held: list[np.ndarray | None] = [job.accept(rank, f) for rank, f in enumerate(fields)]
    ids = job.match(held)
    coverage = job.coverage(ids)
    mismatch, placed = _compare_items(judge, job, ids, held, fields, ref)
    found += job.found + coverage  # refused ranks (keys, then values), then coverage
    if mismatch is None:
        return found, []
    errors = [] if coverage or column is None else _cell_errors(judge, job, placed, mismatch)
    return [*found, mismatch], errors


def _reference_keys(
    name: str, step: int, ref: FieldRecord, fields: list[FieldRecord], found: list[Mismatch]
) -> np.ndarray | None:
    """The reference's keys, ``(items, width)``. A plain tensor in the reference is the
    whole field with its rows as items ``0..n-1``: a match for 1-D keys (a row index), and
    a ``field`` finding of the reference where the ranks' keys have several columns."""
    if ref.keys is not None:
        return np.asarray(ref.keys.numpy(), dtype=np.int64)
    widths = sorted({int(f.keys.shape[1]) for f in fields if f.keys is not None})
    if widths == [1] and ref.values.dim() >= 1:
        return np.arange(ref.values.shape[0], dtype=np.int64)[:, None]
    found.append(
        Mismatch(
            Quantity.FIELD,
            name,
            step,
            None,
            where=f"a plain tensor of shape {tuple(ref.values.shape)} where the ranks return "
            f"keyed items (keys of {_width_text(widths)})",
            hint=KEYED_HINT,
            run="reference",
        )
    )
    return None


def _width_text(widths: list[int]) -> str:
    return " or ".join(map(str, widths)) + " column" + ("" if widths == [1] else "s")


@dataclass
class _KeyedJob:
    """One keyed field of one step: the reference's keys and every key's number (``match``)."""

    name: str
    step: int
    layout: Layout
    ref_keys: np.ndarray
    column: int | None
    ref_keyed: bool = True  # False: the reference's plain tensor, its rows keyed 0..n-1
    found: list[Mismatch] = field(default_factory=list)
    unique: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.int64))

    def refuse(self, rank: int, where: str, hint: str = "") -> None:
        self.found.append(
            Mismatch(Quantity.FIELD, self.name, self.step, rank, where=where, hint=hint)
        )

    def accept(self, rank: int, f: FieldRecord) -> np.ndarray | None:
        """A rank's keys if they can be matched (a keyed field, the reference's key width);
        its values are judged in ``_compare_items``."""
        width = self.ref_keys.shape[1]
        if f.keys is None:
            whose = "the reference's field is" if self.ref_keyed else "other ranks return"
            self.refuse(
                rank,
                f"a plain tensor of shape {tuple(f.values.shape)} where {whose} keyed items",
                KEYED_HINT,
            )
            return None
        if f.keys.shape[1] != width:
            self.refuse(
                rank,
                f"keys of {_width_text([int(f.keys.shape[1])])} where the reference's have "
                f"{_width_text([width])}",
                KEY_WIDTH_HINT,
            )
            return None
        return np.asarray(f.keys.numpy(), dtype=np.int64)

    def match(self, held: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """Number every distinct key; the reference's numbers first, then each rank's."""
        parts = [self.ref_keys, *(h for h in held if h is not None)]
        self.unique, inverse = _number_rows(np.concatenate(parts))
        ends = np.cumsum([len(p) for p in parts])
        pieces = iter(np.split(inverse, ends[:-1]))
        ref_ids = next(pieces)
        return [ref_ids, *(None if h is None else next(pieces) for h in held)]

    def key_text(self, k: int) -> str:
        """``key (0, 5, 2) in cell 5`` for the distinct key numbered ``k``."""
        return key_text([int(v) for v in self.unique[k]], self.column)

    def keys_text(self, ks: np.ndarray) -> str:
        """``key (0, 5, 2)`` for one, ``3 keys (first: key (0, 5, 2))`` for several."""
        first = self.key_text(int(ks[0]))
        return first if len(ks) == 1 else f"{len(ks)} keys (first: {first})"

    def coverage(self, ids: list[np.ndarray | None]) -> list[Mismatch]:
        """Keys held twice in the reference, by no rank, by several, twice by one rank, or
        not in the reference: one ``coverage`` finding per kind and rank."""
        ref_ids, rank_ids = ids[0], ids[1:]
        assert ref_ids is not None
        n_keys = len(self.unique)
        ref_count = np.bincount(ref_ids, minlength=n_keys)
        counts = np.zeros((len(rank_ids), n_keys), dtype=np.int64)
        for rank, r_ids in enumerate(rank_ids):
            if r_ids is not None:
                counts[rank] = np.bincount(r_ids, minlength=n_keys)
        in_ref = ref_count > 0
        out: list[Mismatch] = []
        twice = np.flatnonzero(ref_count > 1)
        if len(twice):
            where = f"{self.keys_text(twice)} held more than once in the reference"
            hint = "the reference must name each item once"
            out.append(self._finding(twice, None, where, hint, run="reference"))
        missing = np.flatnonzero(in_ref & (counts.sum(0) == 0))
        for charged, holds, ks in self._charged(missing, counts):
            said = "held by no rank" if charged is None else f"missing: {holds}"
            out.append(self._finding(ks, charged, f"{self.keys_text(ks)} of the reference {said}"))
        holders = (counts > 0).sum(0)
        several = np.flatnonzero(in_ref & (holders > 1))
        if len(several):
            ranks = np.flatnonzero(counts[:, several[0]])
            where = f"{self.keys_text(several)} held by several ranks (first by ranks "
            where += f"{', '.join(map(str, ranks.tolist()))})"
            groups = {int(r) // self.layout.spatial_size for r in ranks}
            hint = GLOBAL_SAMPLE_HINT if len(groups) > 1 else ""
            out.append(self._finding(several, None, where, hint))
        for rank in range(len(rank_ids)):
            doubled = np.flatnonzero(in_ref & (counts[rank] > 1))
            if len(doubled):
                times = int(counts[rank, doubled[0]])
                where = f"{self.keys_text(doubled)} held {times} times here"
                out.append(self._finding(doubled, rank, where))
            extra = np.flatnonzero(~in_ref & (counts[rank] > 0))
            if len(extra):
                out.append(
                    self._finding(extra, rank, f"{self.keys_text(extra)} not in the reference")
                )
        return out

    def _finding(
        self, ks: np.ndarray, rank: int | None, where: str, hint: str = "", run: str = ""
    ) -> Mismatch:
        """A ``coverage`` finding of the keys ``ks``, counted against the reference's items."""
        count, total = len(ks), len(self.ref_keys)
        return Mismatch(
            Quantity.COVERAGE,
            self.name,
            self.step,
            rank,
            count=count,
            total=total,
            where=where,
            hint=hint,
            run=run,
        )

    def _charged(
        self, missing: np.ndarray, counts: np.ndarray
    ) -> list[tuple[int | None, str, np.ndarray]]:
        """The missing keys grouped by the one rank that holds the rest of their prefix
        (all key columns but the last: the other tokens of a (sample, cell)), else, with a
        cell column, the one rank that holds the other items of their cell; ``None`` where
        no rank or several do. Each group comes with what that rank holds, for the report."""
        if not len(missing):
            return []
        charged = np.full(len(missing), -1, dtype=np.int64)  # -1: no rank, or several
        why = np.zeros(len(missing), dtype=np.int64)  # 0: the prefix's rest, 1: the cell's
        ways = []
        if self.unique.shape[1] > 1:
            ways.append(_number_rows(self.unique[:, :-1])[1])
        if self.column is not None:
            ways.append(_number_rows(self.unique[:, self.column : self.column + 1])[1])
        for way, group in enumerate(ways):
            open_ = charged < 0
            # how many items of each group each rank holds: (ranks, groups)
            per_rank = np.stack(
                [np.bincount(group, weights=c, minlength=int(group.max()) + 1) for c in counts]
            )
            holders = per_rank[:, group[missing]] > 0  # (ranks, missing)
            one = open_ & (holders.sum(0) == 1)
            charged = np.where(one, holders.argmax(0), charged)
            why = np.where(one, way if self.unique.shape[1] > 1 else 1, why)
        out: list[tuple[int | None, str, np.ndarray]] = []
        for r, w in sorted({(int(r), int(w)) for r, w in zip(charged, why)}):
            ks = missing[(charged == r) & (why == w)]
            if r < 0:
                out.append((None, "", ks))
            elif w == 0:
                rest = ", ".join(map(str, self.unique[ks[0]][:-1].tolist()))
                out.append((r, f"this rank holds the rest of ({rest}, *)", ks))
            else:
                cell = int(self.unique[ks[0], self.column])
                out.append((r, f"this rank holds the other items of cell {cell}", ks))
        return out


def _number_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of an ``(n, width)`` integer array in lexicographic order, and each
    row's number among them: ``np.unique(rows, axis=0, return_inverse=True)``, whose sort of
    rows as structured values takes ~20x as long for 10**6 keys.

    >>> unique, number = _number_rows(np.array([[1, 2], [0, 5], [1, 2]]))
    >>> unique.tolist(), number.tolist()
    ([[0, 5], [1, 2]], [1, 0, 1])
    """
    order = np.lexsort(rows.T[::-1])  # by the first column, then the second, ...
    ordered = rows[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    number = np.empty(len(rows), dtype=np.int64)
    number[order] = np.cumsum(new) - 1
    return ordered[new], number


@dataclass
class _Placed:
    """The items compared: each rank's item held once, in the reference's order."""

    actual: torch.Tensor
    expected: torch.Tensor
    keys: np.ndarray  # the distinct-key number of each item
    owners: np.ndarray  # the rank holding each item


def _key_rows(ids: list[np.ndarray | None], n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key: the reference's (first) row of it (-1: none), and how many ranks' items
    hold it."""
    ref_ids = ids[0]
    assert ref_ids is not None
    first_row = np.full(n_keys, -1, dtype=np.int64)  # the reference's (first) row of each key
    present, first = np.unique(ref_ids, return_index=True)
    first_row[present] = first
    total = np.zeros(n_keys, dtype=np.int64)
    for r_ids in ids[1:]:
        if r_ids is not None:
            total += np.bincount(r_ids, minlength=n_keys)
    return first_row, total


def _compare_items(
    judge: Judge,
    job: _KeyedJob,
    ids: list[np.ndarray | None],
    held: list[np.ndarray | None],
    fields: list[FieldRecord],
    ref: FieldRecord,
) -> tuple[Mismatch | None, _Placed]:
    """Compare every item held exactly once with the reference's item of the same key."""
    first_row, total = _key_rows(ids, len(job.unique))
    rows, ref_rows, owners, parts = [], [], [], []
    for rank, (f, r_ids) in enumerate(zip(fields, ids[1:])):
        if r_ids is None or held[rank] is None:
            continue
        if tuple(f.values.shape[1:]) != tuple(ref.values.shape[1:]) or (
            f.values.dtype != ref.values.dtype
        ):
            job.refuse(
                rank,
                f"items {f.values.dtype} {tuple(f.values.shape[1:])} where the reference's "
                f"are {ref.values.dtype} {tuple(ref.values.shape[1:])} (items run along dim 0)",
            )
            continue
        once = (total[r_ids] == 1) & (first_row[r_ids] >= 0)
        mine = np.flatnonzero(once)
        rows.append(r_ids[mine])
        ref_rows.append(first_row[r_ids[mine]])
        owners.append(np.full(len(mine), rank, dtype=np.int64))
        parts.append(f.values[torch.from_numpy(mine)])
    empty = np.zeros(0, dtype=np.int64)
    order_by = np.concatenate(ref_rows) if ref_rows else empty
    order = np.argsort(order_by, kind="stable")  # the reference's order, whatever the packing
    inner = tuple(ref.values.shape[1:])
    actual = torch.cat(parts) if parts else ref.values.new_zeros((0, *inner))
    placed = _Placed(
        actual[torch.from_numpy(order)],
        ref.values[torch.from_numpy(order_by[order])],
        (np.concatenate(rows) if rows else empty)[order],
        (np.concatenate(owners) if owners else empty)[order],
    )

    def where(flat: int) -> str:
        coords = np.unravel_index(flat, tuple(placed.actual.shape))
        item = int(coords[0])
        others = [int(c) for c in coords[1:]]
        lead = f"[{', '.join(map(str, others))}] " if others else ""
        return f"{lead}{job.key_text(int(placed.keys[item]))} on rank {int(placed.owners[item])}"

    m = judge.numeric(
        Quantity.FIELD, job.name, job.step, None, placed.actual, placed.expected, where
    )
    return m, placed


def _cell_errors(judge: Judge, job: _KeyedJob, placed: _Placed, m: Mismatch) -> list[FieldError]:
    """Per data group, the largest error of the items in each HEALPix cell (what error
    maps draw), and the boundary hint on ``m``. A cell no item of the group lies in is
    drawn as owned by the rank of the cell before it (nested ranges are contiguous)."""
    column = job.column
    assert column is not None
    n = len(placed.keys)
    if n == 0 or placed.actual[0].numel() == 0:
        return []
    cells = torch.from_numpy(job.unique[placed.keys, column])
    npix = _healpix_cells(int(job.ref_keys[:, column].max(initial=0)) if len(job.ref_keys) else 0)
    diff = (placed.actual - placed.expected).abs().to(torch.float64).reshape(n, -1).amax(1)
    mag = placed.expected.abs().to(torch.float64).reshape(n, -1).amax(1)
    bound = judge.tolerance.field
    over = ~(diff <= bound.atol + bound.rtol * mag)  # NaN counts as over
    groups = torch.from_numpy(placed.owners // job.layout.spatial_size)
    errors: list[FieldError] = []
    for g in range(job.layout.data_size):
        mine = groups == g
        if not bool((over & mine).any()):
            continue
        err_np, most_np = np.zeros(npix), np.zeros(npix)
        with np.errstate(invalid="ignore"):  # a NaN item makes its cell's error NaN: wanted
            np.maximum.at(err_np, cells[mine].numpy(), diff[mine].numpy())
            np.maximum.at(most_np, cells[mine].numpy(), mag[mine].numpy())
        err, most = torch.from_numpy(err_np), torch.from_numpy(most_np)
        owners = np.full(npix, -1, dtype=np.int64)
        owners[cells[mine].numpy()] = placed.owners[mine.numpy()]
        owners = _fill_owners(owners, g * job.layout.spatial_size)
        owned = torch.from_numpy(owners)
        if not errors:
            hint = boundary_hint(err, owned, bound.atol + bound.rtol * most, None, "cell")
            m.hint = hint or m.hint
        errors.append(FieldError(job.name, job.step, g, err, owned, None, "cell"))
    return errors


def _fill_owners(owners: np.ndarray, default: int) -> np.ndarray:
    """Cells without an owner take the owner of the cell before them (the one after, at
    the start; ``default`` if none has one)."""
    known = np.flatnonzero(owners >= 0)
    if not len(known):
        return np.full_like(owners, default)
    before = np.maximum.accumulate(np.where(owners >= 0, np.arange(len(owners)), -1))
    filled = np.where(before >= 0, owners[np.maximum(before, 0)], owners[known[0]])
    return filled


def _healpix_cells(largest: int) -> int:
    """The cells of the smallest HEALPix sphere (``12 * nside**2``, nside a power of two)
    holding cell ``largest``.

    >>> _healpix_cells(0), _healpix_cells(12), _healpix_cells(47), _healpix_cells(48)
    (12, 48, 48, 192)
    """
    nside = 1
    while 12 * nside * nside <= largest:
        nside *= 2
    return 12 * nside * nside


def _keyed_position(f: FieldRecord) -> Callable[[int], str]:
    """Names the item (by key, and cell) of a flat index into a keyed field's values."""
    keys, values, column = f.keys, f.values, f.cell_column
    assert keys is not None

    def where(flat: int) -> str:
        coords = np.unravel_index(flat, tuple(values.shape))
        others = [int(c) for c in coords[1:]]
        lead = f"[{', '.join(map(str, others))}] " if others else ""
        return lead + key_text([int(v) for v in keys[int(coords[0])]], column)

    return where


def key_text(key: list[int], cell_column: int | None = None) -> str:
    """An item's name in reports: ``key 7``, ``key (0, 5, 2)``, ``key (0, 5, 2) in cell 5``.

    >>> key_text([0, 5, 2], cell_column=1)
    'key (0, 5, 2) in cell 5'
    """
    text = f"key {key[0]}" if len(key) == 1 else f"key ({', '.join(map(str, key))})"
    if cell_column is not None:
        text += " in " + position_text(key[cell_column], None, "cell")
    return text
