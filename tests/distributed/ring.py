"""A chaotic ring model: Lorenz-96 with a global-mean coupling, float32, split over ranks.

``dx_i/dt = (x_{i+1} - x_{i-2}) x_{i-1} - d x_i + F + c (mean(x) - x_i)`` on a ring of
``N`` variables, one classic Runge-Kutta step (four tendencies) per model call. Each rank
holds a contiguous arc of the ring; the stencil needs two values from the left neighbour
and one from the right (a halo, exchanged through an autograd-aware all_gather of every
rank's edges), and the coupling needs the global mean (a ``spatial_sum``). ``F``, ``d`` and
``c`` are the trainable parameters. In float32 its rounding differences grow by chaos
alone, ~1000x over 150 steps: no fixed tolerance can judge a long rollout of it.

``RingCase(fault)`` switches on one bug that lives only in inference:

- ``stale-halo``: in eval mode the halo received at the first call is kept and reused at
  every later step (each Runge-Kutta stage keeps its own: the bug enters at step 1);
- ``local-mean``: in eval mode the mean is taken over the rank's own arc (the shape of
  fme's ``clip_latent_global_means`` eval finding).
"""

from __future__ import annotations

from typing import Any

import torch

from harness import Outputs, Positions, Shard, SpatialCase, Topology
from harness.collectives import all_gather_uneven, reduce_loss, spatial_sum, sync_gradients

N, BATCH, DT = 40, 2, 0.05
FAULTS = ("stale-halo", "local-mean")


def arc(topo: Topology) -> slice:
    """This rank's contiguous variables of the ring (the reference's: all of them)."""
    sizes = [len(p) for p in torch.arange(N).tensor_split(topo.spatial_size)]
    start = sum(sizes[: topo.spatial_rank])
    return slice(start, start + sizes[topo.spatial_rank])


class Lorenz96(torch.nn.Module):
    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.forcing = torch.nn.Parameter(torch.tensor(8.0))
        self.damping = torch.nn.Parameter(torch.tensor(1.0))
        self.coupling = torch.nn.Parameter(torch.tensor(0.1))
        self.fault = fault
        self._halos: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def halo(
        self, x: torch.Tensor, topo: Topology, stage: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The two values left of this arc and the one right of it (periodic)."""
        if self.fault == "stale-halo" and not self.training and stage in self._halos:
            return self._halos[stage]
        edges = torch.cat([x[..., :1], x[..., -2:]], dim=-1)  # (batch, 3): first, last two
        every = all_gather_uneven(edges, topo, dim=-1).unflatten(-1, (topo.spatial_size, 3))
        me, s = topo.spatial_rank, topo.spatial_size
        left, right = every[..., (me - 1) % s, 1:], every[..., (me + 1) % s, :1]
        if self.fault == "stale-halo" and not self.training:
            self._halos[stage] = (left, right)
        return left, right

    def forward(self, x: torch.Tensor, topo: Topology) -> torch.Tensor:
        k1 = self.tendency(x, topo, 0)
        k2 = self.tendency(x + DT / 2 * k1, topo, 1)
        k3 = self.tendency(x + DT / 2 * k2, topo, 2)
        k4 = self.tendency(x + DT * k3, topo, 3)
        return x + DT / 6 * (k1 + 2 * k2 + 2 * k3 + k4)

    def tendency(self, x: torch.Tensor, topo: Topology, stage: int) -> torch.Tensor:
        left, right = self.halo(x, topo, stage)
        ext = torch.cat([left, x, right], dim=-1)  # x_{i-2} .. x_{i+1} around the arc
        xm2, xm1, xp1 = ext[..., :-3], ext[..., 1:-2], ext[..., 3:]
        if self.fault == "local-mean" and not self.training:
            mean = x.mean(dim=-1, keepdim=True)
        else:
            mean = spatial_sum(x.sum(dim=-1, keepdim=True), topo) / N
        return (xp1 - xm2) * xm1 - self.damping * x + self.forcing + self.coupling * (mean - x)


class RingCase(SpatialCase):
    dtype = torch.float32  # where rounding grows by chaos: what a rollout check must judge

    def __init__(self, fault: str | None = None, rollout_steps: int | None = None) -> None:
        if fault not in (None, *FAULTS):
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        self.fault = fault
        self.rollout_steps = rollout_steps
        self.name = "lorenz96-ring" + (f"-{fault}" if fault else "")

    def build(self, topo: Topology) -> torch.nn.Module:
        model = Lorenz96(self.fault)
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # on the attractor: a spun-up state, the same on every rank, then this rank's arc
        x = 8.0 + torch.randn(BATCH, N)
        model = Lorenz96()
        with torch.no_grad():
            for _ in range(200):
                x = model(x, Topology.single())
        target = x + 0.1 * torch.randn(BATCH, N)
        return x[:, arc(topo)].clone(), target[:, arc(topo)].clone()

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        x, target = batch
        out = model(x, topo)
        loss = reduce_loss(((out - target) ** 2).sum(), topo) / (BATCH * N)
        return Outputs(loss, {"state": self.shard(out, topo)})

    def predict(
        self, model: torch.nn.Module, batch: Any, topo: Topology, steps: int
    ) -> list[dict[str, Shard | torch.Tensor]]:
        x, _ = batch
        out: list[dict[str, Shard | torch.Tensor]] = []
        for _ in range(steps):
            x = model(x, topo)
            out.append({"state": self.shard(x, topo), "energy": self.energy(x, topo)})
        return out

    def energy(self, x: torch.Tensor, topo: Topology) -> torch.Tensor:
        """A replicated diagnostic: the ring's mean of x^2 / 2 per sample."""
        return spatial_sum((x * x).sum(dim=-1), topo) / (2 * N)

    def shard(self, x: torch.Tensor, topo: Topology) -> Shard:
        a = arc(topo)
        return Shard(x, torch.arange(a.start, a.stop), dim=-1)

    def partition(self, topo: Topology) -> Positions:
        """This rank's arc of the ring: where locating places a module's tensors."""
        a = arc(topo)
        return Positions(N, range(a.start, a.stop), unit="variable")

    def describe(self, topo: Topology | None = None) -> str:
        return f"ring of {N}"
