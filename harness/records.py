"""What one run of a case records: the typed shape a rank sends and the comparison reads.

``run_case`` fills a ``RunRecord`` on every rank and once for the reference; ``checks``
compares them. Everything here is plain CPU tensors, picklable across the pool's pipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FieldRecord:
    """One output field of one rank: its values and, for a shard, where they sit.

    ``index`` is ``None`` for a full (replicated, or the reference's) tensor; otherwise the
    global positions along ``dim`` (a LongTensor, or a slice of the global length).
    ``grid`` (rows, cols) says positions are flattened lat x lon; ``unit`` names a position.
    """

    values: torch.Tensor
    index: torch.Tensor | slice | None = None
    dim: int | None = None
    grid: tuple[int, int] | None = None
    unit: str = "position"

    @property
    def sharded(self) -> bool:
        return self.index is not None

    def positions(self, size: int) -> torch.Tensor:
        """The global positions as a LongTensor (a slice resolved against ``size``)."""
        if isinstance(self.index, slice):
            return torch.arange(size)[self.index]
        if self.index is None:
            return torch.arange(size)
        return self.index


@dataclass
class StepRecord:
    """One training step: the loss, every named gradient (``None`` where the parameter got
    none), every field, the parameters after the SGD step, and the buffers the step changed
    in place."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    fields: dict[str, FieldRecord] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    mutated_buffers: list[str] = field(default_factory=list)


@dataclass
class RunRecord:
    """A whole run on one rank (or the reference): parameters after ``build``, then steps.

    The topology fields say where the rank sat (the reference: sizes 1, ranks 0).
    """

    init: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    spatial_rank: int = 0
    data_rank: int = 0
    spatial_size: int = 1
    data_size: int = 1
    describe: str = ""
    #: torch.distributed operations the rank issued during the run (``None``: not known,
    #: e.g. under torchrun, where the harness does not watch them)
    communicated: int | None = None

    def flat(self) -> dict[str, torch.Tensor]:
        """The run's results as one flat ``{name: tensor}`` map (what goldens store)."""
        flat: dict[str, torch.Tensor] = {}
        for i, st in enumerate(self.steps):
            flat[f"step{i}/loss"] = st.loss
            for n, g in st.grads.items():
                if g is not None:
                    flat[f"step{i}/grad/{n}"] = g
            for n, f in st.fields.items():
                flat[f"step{i}/field/{n}"] = f.values
            for n, p in st.params.items():
                flat[f"step{i}/param/{n}"] = p
        return flat


def detached(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that shares nothing with the model's tensors."""
    return t.detach().to("cpu").clone()
