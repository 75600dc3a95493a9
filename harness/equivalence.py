"""The downstream contract: ``SpatialCase``, ``Outputs``, ``Shard`` and ``check_equivalence``.

A downstream repo writes one ``SpatialCase`` per model; ``check_equivalence`` runs it once as
the single-process reference and once on every rank of a warm rank pool, then compares loss,
every gradient, every output field (reassembled from the shards) and the parameters after
each SGD step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from harness.compare import (
    Difference,
    EquivalenceReport,
    FieldError,
    Mismatch,
    QuantityStats,
    Tolerance,
    compare_tensors,
    scale_hint,
)
from harness.errors import ConfigError, RankFailure
from harness.topology import Topology, validate_sizes

# ---------------------------------------------------------------------- contract


@dataclass
class Shard:
    """A rank's part of a global field: ``values`` at global positions ``index`` along ``dim``.

    ``index`` is a 1-D LongTensor (or a ``slice``) of positions along ``dim`` of the global
    field. ``unit`` names a position in reports ("cell" for HEALPix cells). ``grid_shape``
    (rows, cols), set by ``Shard.grid``, says positions are ``row * cols + col`` of the
    field's last two dimensions flattened, so reports can name (lat, lon).
    """

    values: torch.Tensor
    index: torch.Tensor | slice
    dim: int = -1
    grid_shape: tuple[int, int] | None = None
    unit: str = "position"

    @classmethod
    def grid(cls, values: torch.Tensor, rows: slice, cols: slice, nrows: int, ncols: int) -> Shard:
        """The block ``values`` = field[..., rows, cols] of a (..., nrows, ncols) field.

        The last two dimensions are flattened; the reference's full field is flattened the
        same way when compared.
        """
        r = torch.arange(nrows)[rows]
        c = torch.arange(ncols)[cols]
        if tuple(values.shape[-2:]) != (len(r), len(c)):
            raise ConfigError(
                f"Shard.grid: values end in shape {tuple(values.shape[-2:])} but the block "
                f"rows {rows} x cols {cols} of a {nrows}x{ncols} grid is {len(r)}x{len(c)}"
            )
        index = (r[:, None] * ncols + c[None, :]).reshape(-1)
        return cls(values.reshape(*values.shape[:-2], -1), index, -1, (nrows, ncols))


@dataclass
class Outputs:
    """What one forward pass produced: the global loss and named output fields.

    ``loss`` is a scalar already reduced to the global value on every rank. ``fields`` maps a
    name to a ``Shard`` (partitioned) or a full tensor (the reference, or a replicated value).
    """

    loss: torch.Tensor
    fields: dict[str, torch.Tensor | Shard] = field(default_factory=dict)


class SpatialCase:
    """One model under test. Subclass it and write ``build``, ``batch`` and ``forward``.

    The harness seeds torch, numpy and ``random`` identically on every rank before ``build``
    and before each ``batch``, sets the default dtype to ``dtype`` (if given) and runs plain
    SGD with the given ``lr`` after each ``forward`` + ``loss.backward()``. Gradient
    synchronisation is the case's job (e.g. ``harness.collectives.sync_gradients`` in
    ``build``): that is what is under test. The case object is pickled to the ranks, so
    define the class at module level.
    """

    name: str | None = None
    dtype: torch.dtype | None = None

    def build(self, topo: Topology) -> torch.nn.Module:
        raise NotImplementedError

    def batch(self, topo: Topology, step: int) -> Any:
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        raise NotImplementedError

    def describe(self, topo: Topology | None = None) -> str:
        """A short description of the partition for reports (override to say more)."""
        return ""

    @property
    def label(self) -> str:
        return self.name or type(self).__name__


def data_share(n: int, topo: Topology) -> slice:
    """The samples ``[start, stop)`` of ``n`` that data group ``topo.data_rank`` gets.

    The rule the harness assumes when it compares the fields of several data groups with the
    reference's: contiguous, equal shares (``n`` must divide evenly).

    >>> data_share(4, Topology.single())
    slice(0, 4, None)
    """
    if n % topo.data_size:
        raise ConfigError(
            f"{n} samples do not split evenly over {topo.data_size} data groups; "
            f"use a batch size that is a multiple of {topo.data_size}"
        )
    k = n // topo.data_size
    return slice(topo.data_rank * k, (topo.data_rank + 1) * k)


# ---------------------------------------------------------------------- running a case


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + 7919 * (step + 1)) % 2**31


def _strip(name: str) -> str:
    return name[len("module.") :] if name.startswith("module.") else name


def _detach(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").clone()


def _field_record(value: Any) -> dict[str, Any]:
    if isinstance(value, Shard):
        return {
            "values": _detach(value.values),
            "index": value.index
            if isinstance(value.index, slice)
            else _detach(torch.as_tensor(value.index, dtype=torch.long)),
            "dim": value.dim,
            "grid": value.grid_shape,
            "unit": value.unit,
        }
    if isinstance(value, torch.Tensor):
        return {
            "values": _detach(value),
            "index": None,
            "dim": None,
            "grid": None,
            "unit": "position",
        }
    raise ConfigError(
        f"Outputs.fields values must be Shard or torch.Tensor, got {type(value).__name__}"
    )


def run_case(case: SpatialCase, topo: Topology, steps: int, lr: float, seed: int) -> dict[str, Any]:
    """Build, then ``steps`` times: batch, forward, backward, record, SGD step. Returns records.

    Runs the same way for the reference (``Topology.single()``) and on each rank.
    """
    old_dtype = torch.get_default_dtype()
    if case.dtype is not None:
        torch.set_default_dtype(case.dtype)
    try:
        _seed(seed)
        model = case.build(topo)
        record: dict[str, Any] = {
            "init": {_strip(n): _detach(p) for n, p in model.named_parameters()},
            "steps": [],
        }
        params = dict(model.named_parameters())
        for step in range(steps):
            _seed(_step_seed(seed, step))
            batch = case.batch(topo, step)
            model.zero_grad(set_to_none=True)
            buffers = {n: (b, b._version, _detach(b)) for n, b in model.named_buffers()}
            out = case.forward(model, batch, topo)
            if not isinstance(out, Outputs):
                raise ConfigError(
                    f"{case.label}.forward must return harness.Outputs, got {type(out).__name__}"
                )
            out.loss.backward()
            grads = {
                _strip(n): (None if p.grad is None else _detach(p.grad))
                for n, p in params.items()
                if p.requires_grad
            }
            with torch.no_grad():
                for p in params.values():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-lr)
            mutated = sorted(
                _strip(n)
                for n, (b, version, before) in buffers.items()
                if b._version != version or not torch.equal(b.detach().cpu(), before)
            )
            record["steps"].append(
                {
                    "loss": _detach(out.loss),
                    "grads": grads,
                    "fields": {k: _field_record(v) for k, v in out.fields.items()},
                    "params": {_strip(n): _detach(p) for n, p in params.items()},
                    "mutated_buffers": mutated,
                }
            )
        return record
    finally:
        torch.set_default_dtype(old_dtype)


def _rank_entry(
    case: SpatialCase, spatial_size: int | None, steps: int, lr: float, seed: int
) -> dict[str, Any]:
    """What every rank of the pool runs (module level, so the pool can pickle it)."""
    topo = Topology.create(spatial_size)
    record = run_case(case, topo, steps, lr, seed)
    record["topology"] = {
        "spatial_rank": topo.spatial_rank,
        "data_rank": topo.data_rank,
        "spatial_size": topo.spatial_size,
        "data_size": topo.data_size,
    }
    record["describe"] = case.describe(topo)
    return record


# ---------------------------------------------------------------------- check


def check_equivalence(
    case: SpatialCase,
    *,
    ranks: int,
    spatial_size: int | None = None,
    steps: int = 2,
    lr: float = 0.1,
    tolerance: Tolerance | None = None,
    timeout: float | None = None,
    seed: int = 0,
    pool: Any = None,
) -> EquivalenceReport:
    """Run ``case`` as the reference and on ``ranks`` ranks; compare everything.

    Returns an ``EquivalenceReport``; a crash, an exception or a timeout on any rank is a
    mismatch of the report (``crash``, ``error``, ``timeout``), not an exception. ``pool``
    defaults to a warm pool shared by the process (``harness.pool.shared_registry()``).
    """
    if not isinstance(case, SpatialCase):
        raise ConfigError(
            f"check_equivalence needs a harness.SpatialCase, got {type(case).__name__}; "
            "subclass SpatialCase and implement build, batch and forward"
        )
    s = validate_sizes(ranks, spatial_size)
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    t0 = time.perf_counter()
    if pool is None:
        from harness.pool import shared_registry

        pool = shared_registry().get(ranks)
    if pool.world_size != ranks:
        raise ConfigError(f"pool has {pool.world_size} ranks but ranks={ranks} was asked for")

    reference = run_case(case, Topology.single(), steps, lr, seed)
    dtype = reference["steps"][0]["loss"].dtype
    tol = tolerance or Tolerance.for_dtype(dtype)
    report = EquivalenceReport(
        case=case.label,
        ranks=ranks,
        spatial_size=s,
        partition="",
        steps=steps,
        dtype=str(dtype).replace("torch.", ""),
        tolerance=tol,
        stats={q: QuantityStats() for q in ("loss", "grad", "field", "param")},
        reference=flatten_record(reference),
    )
    try:
        records = pool.run(_rank_entry, case, spatial_size, steps, lr, seed, timeout=timeout)
    except RankFailure as failure:
        for p in failure.problems:
            if p.kind == "stopped":
                continue
            detail = p.detail + (
                f"\n--- rank {p.rank} output ---\n{p.output}" if p.output.strip() else ""
            )
            report.mismatches.append(
                Mismatch(p.kind, case.label, None, p.rank, where=p.summary, detail=detail)
            )
        report.partition = _layout(case.describe(None), s, ranks // s)
        report.seconds = time.perf_counter() - t0
        return report
    report.partition = _layout(records[0].get("describe", ""), s, ranks // s)
    _Comparer(report, reference, records, tol).run()
    report.seconds = time.perf_counter() - t0
    return report


def flatten_record(record: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The reference's results as one flat ``{name: tensor}`` map (what goldens store)."""
    flat: dict[str, torch.Tensor] = {}
    for i, st in enumerate(record["steps"]):
        flat[f"step{i}/loss"] = st["loss"]
        for n, g in st["grads"].items():
            if g is not None:
                flat[f"step{i}/grad/{n}"] = g
        for n, f in st["fields"].items():
            flat[f"step{i}/field/{n}"] = f["values"]
        for n, p in st["params"].items():
            flat[f"step{i}/param/{n}"] = p
    return flat


class _Comparer:
    """Compares the ranks' records with the reference's and fills the report."""

    def __init__(
        self,
        report: EquivalenceReport,
        ref: dict[str, Any],
        records: list[dict[str, Any]],
        tol: Tolerance,
    ) -> None:
        self.report, self.ref, self.records, self.tol = report, ref, records, tol
        self.S = report.spatial_size
        self.D = report.ranks // self.S

    def add(self, m: Mismatch) -> None:
        self.report.mismatches.append(m)

    def numeric(
        self,
        quantity: str,
        name: str,
        step: int | None,
        rank: int | None,
        actual: torch.Tensor,
        expected: torch.Tensor,
        where: Any = None,
    ) -> Difference:
        d = compare_tensors(actual, expected, self.tol.bound(quantity))
        if not d.problem:
            self.report.stats[quantity].add(d)
        if not d.ok and not d.problem and expected.dim() == 0:
            # a scalar has no position: say what the two values are
            loc = f"{float(actual):.6g} vs reference {float(expected):.6g}"
            hint = scale_hint(actual, expected, self.S) if quantity in ("grad", "loss") else ""
            self.add(Mismatch(quantity, name, step, rank, d.max_abs, d.max_rel, loc,
                              d.count, d.total, hint=hint))
            return d
        if not d.ok:
            loc = d.problem or (
                where(d.worst)
                if where and d.worst is not None
                else _index_text(expected.shape, d.worst)
            )
            hint = scale_hint(actual, expected, self.S) if quantity in ("grad", "loss") else ""
            self.add(
                Mismatch(
                    quantity,
                    name,
                    step,
                    rank,
                    d.max_abs,
                    d.max_rel,
                    loc,
                    d.count,
                    d.total,
                    hint=hint,
                )
            )
        return d

    def run(self) -> None:
        self.initial_params()
        for step, ref_step in enumerate(self.ref["steps"]):
            steps = [r["steps"][step] for r in self.records]
            self.losses(step, ref_step, steps)
            self.grads(step, ref_step, steps)
            self.fields(step, ref_step, steps)
            self.params(step, ref_step, steps)
            self.buffers(step, ref_step, steps)

    # -- parameters right after build: unseeded init shows here first
    def initial_params(self) -> None:
        ref = self.ref["init"]
        for rank, rec in enumerate(self.records):
            for name, p in rec["init"].items():
                if name not in ref:
                    self.add(
                        Mismatch(
                            "param", name, None, rank, where="parameter not in the reference model"
                        )
                    )
                    continue
                d = compare_tensors(p, ref[name], self.tol.param)
                if not d.ok:
                    self.add(
                        Mismatch(
                            "param",
                            name,
                            None,
                            rank,
                            d.max_abs,
                            d.max_rel,
                            d.problem or "initial value",
                            d.count,
                            d.total,
                            hint="differs from the reference right after build: seed the "
                            "initialisation identically on every rank (the harness seeds torch, "
                            "numpy and random before build; a generator of your own is not).",
                        )
                    )
            for name in ref.keys() - rec["init"].keys():
                self.add(
                    Mismatch(
                        "param", name, None, rank, where="reference parameter missing on this rank"
                    )
                )

    def losses(self, step: int, ref_step: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        ref = ref_step["loss"]
        for rank, st in enumerate(steps):
            first = steps[(rank // self.S) * self.S]["loss"]
            if rank % self.S and not torch.equal(st["loss"], first):
                self.numeric("loss", "loss (vs spatial rank 0)", step, rank, st["loss"], first)
        if self.D == 1:
            for rank, st in enumerate(steps):
                self.numeric("loss", "loss", step, rank, st["loss"], ref)
        else:
            mean = torch.stack([steps[g * self.S]["loss"] for g in range(self.D)]).mean(0)
            self.numeric("loss", "loss (mean over data groups)", step, None, mean, ref)

    def grads(self, step: int, ref_step: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        ref = ref_step["grads"]
        for rank, st in enumerate(steps):
            for name, g in st["grads"].items():
                r = ref.get(name)
                if name not in ref:
                    continue  # reported once as a parameter missing from the reference
                if g is None and r is None:
                    continue
                if g is None or r is None:
                    self.add(
                        Mismatch(
                            "grad",
                            name,
                            step,
                            rank,
                            where=(
                                "no gradient (None) on this rank; the reference has one"
                                if g is None
                                else "a gradient where the reference has None"
                            ),
                            hint="a rank whose domain is empty must still run every module, "
                            "giving zeros, not None"
                            if g is None
                            else "",
                        )
                    )
                    continue
                self.numeric("grad", name, step, rank, g, r)

    def fields(self, step: int, ref_step: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        for name, ref_rec in ref_step["fields"].items():
            ref = ref_rec["values"]
            recs = [st["fields"].get(name) for st in steps]
            missing = [r for r, f in enumerate(recs) if f is None]
            for rank in missing:
                self.add(Mismatch("field", name, step, rank, where="field missing on this rank"))
            if missing:
                continue
            if all(f["index"] is None for f in recs):
                for rank, f in enumerate(recs):  # replicated: every rank holds the whole field
                    exp = _data_part(ref, rank // self.S, self.D)
                    self.numeric("field", name, step, rank, f["values"], exp)
                continue
            for g in range(self.D):
                self.assembled_field(
                    name,
                    step,
                    _data_part(ref, g, self.D),
                    recs[g * self.S : (g + 1) * self.S],
                    g * self.S,
                )

    def assembled_field(
        self, name: str, step: int, ref: torch.Tensor, shards: list[dict[str, Any]], first: int
    ) -> None:
        grid = next((f["grid"] for f in shards if f["grid"]), None)
        unit = shards[0]["unit"]
        if grid is not None and tuple(ref.shape[-2:]) == tuple(grid):
            ref = ref.reshape(*ref.shape[:-2], -1)
        dim = shards[0]["dim"] % ref.dim() if ref.dim() else 0
        size = ref.shape[dim] if ref.dim() else 1
        owners = torch.full((size,), -1, dtype=torch.long)
        counts = torch.zeros(size, dtype=torch.long)
        out = torch.zeros_like(ref)
        ok = True

        def refuse(quantity: str, rank: int | None, where: str) -> None:
            self.add(Mismatch(quantity, name, step, rank, where=where))

        for k, f in enumerate(shards):
            rank = first + k
            if f["index"] is None:
                refuse("field", rank, "a full tensor where other ranks return a Shard")
                return
            idx = f["index"]
            idx = torch.arange(size)[idx] if isinstance(idx, slice) else idx
            vals = f["values"]
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
                refuse("coverage", rank, f"index out of range [0, {size}): "
                       f"{idx.min()}..{idx.max()}")
                ok = False
                continue
            expected_shape = list(ref.shape)
            expected_shape[dim] = idx.numel()
            if list(vals.shape) != expected_shape or vals.dtype != ref.dtype:
                refuse(
                    "field",
                    rank,
                    f"shard {vals.dtype} {tuple(vals.shape)} where the reference gives "
                    f"{ref.dtype} {tuple(expected_shape)} for its {idx.numel()} positions",
                )
                ok = False
                continue
            counts.index_add_(0, idx, torch.ones_like(idx))
            owners[idx] = rank
            out.index_copy_(dim, idx, vals)
        bad = (counts != 1).nonzero().reshape(-1)
        if len(bad):
            never = int((counts == 0).sum())
            twice = int((counts > 1).sum())
            pos = int(bad[0])
            self.add(
                Mismatch(
                    "coverage",
                    name,
                    step,
                    None,
                    count=len(bad),
                    total=size,
                    where=f"{never} positions owned by no rank, {twice} by several; first: "
                    f"{_position_text(pos, grid, unit)}",
                )
            )
            return
        if not ok:
            return

        def where(flat: int) -> str:
            # flat indexes the whole tensor; find the position along dim and its owner
            coords = np.unravel_index(flat, tuple(ref.shape))
            pos = int(coords[dim])
            others = [int(c) for i, c in enumerate(coords) if i != dim]
            lead = f"[{', '.join(map(str, others))}] " if others else ""
            return f"{lead}{_position_text(pos, grid, unit)} on rank {int(owners[pos])}"

        d = self.numeric("field", name, step, None, out, ref, where)
        if not d.ok and not d.problem:
            err = (out - ref).abs().double()
            err = err.movedim(dim, -1).reshape(-1, size).amax(0) if err.dim() > 1 else err
            self.report.field_errors.append(
                FieldError(name, step, first // self.S, err, owners.clone(), grid, unit)
            )

    def params(self, step: int, ref_step: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        ref = ref_step["params"]
        for rank, st in enumerate(steps):
            lead = steps[(rank // self.S) * self.S]["params"]
            for name, p in st["params"].items():
                if rank % self.S and name in lead and not torch.equal(p, lead[name]):
                    d = compare_tensors(p, lead[name], self.tol.param)
                    self.add(
                        Mismatch(
                            "sync",
                            name,
                            step,
                            rank,
                            d.max_abs,
                            d.max_rel,
                            f"differs from spatial rank 0 (rank {(rank // self.S) * self.S})",
                            int(((p - lead[name]) != 0).sum())
                            if p.shape == lead[name].shape
                            else 0,
                            p.numel(),
                        )
                    )
                if name in ref:
                    self.numeric("param", name, step, rank, p, ref[name])

    def buffers(self, step: int, ref_step: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        ref = set(ref_step["mutated_buffers"])
        for rank, st in enumerate(steps):
            for name in sorted(set(st["mutated_buffers"]) - ref):
                self.add(
                    Mismatch(
                        "buffer",
                        name,
                        step,
                        rank,
                        where="modified in place during the step; the reference's was not",
                    )
                )


def _layout(describe: str, spatial: int, data: int) -> str:
    """``"nside 2, ... · spatial 2 x data 2"``: the partition and, if any, the data groups."""
    groups = f"spatial {spatial} x data {data}" if data > 1 else ""
    return " · ".join(p for p in (describe, groups) if p) or f"spatial {spatial}"


def _data_part(ref: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    if groups == 1:
        return ref
    n = ref.shape[0]
    k = n // groups
    return ref[group * k : (group + 1) * k]


def _position_text(pos: int, grid: tuple[int, int] | None, unit: str = "position") -> str:
    if grid is None:
        return f"{unit} {pos}"
    lat, lon = divmod(pos, grid[1])
    return f"(lat {lat}, lon {lon})"


def _index_text(shape: torch.Size, flat: int | None) -> str:
    if flat is None or not len(shape):
        return ""
    return str(tuple(int(i) for i in np.unravel_index(flat, tuple(shape))))
