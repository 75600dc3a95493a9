import torch
from harness import Outputs, Shard, SpatialCase
from harness.collectives import reduce_loss
from model import Ring, sum_gradients


class RingCase(SpatialCase):
    dtype = torch.float64

    def build(self, topo):
        model = Ring(3, 8, topo.spatial_group)
        if topo.spatial_group is not None:
            sum_gradients(model, topo.spatial_group)
        return model

    def batch(self, topo, step):
        x = torch.randn(2, 3, 8)
        return x[..., self.part(topo)]

    def forward(self, model, x, topo):
        y = model(x)
        loss = reduce_loss((y**2).sum(), topo) / y.numel() / topo.spatial_size
        if topo.spatial_group is None:
            return Outputs((y**2).mean(), {"y": y})
        return Outputs(loss, {"y": Shard(y, torch.arange(8)[self.part(topo)], dim=-1)})

    def part(self, topo):
        k = 8 // topo.spatial_size
        return slice(topo.spatial_rank * k, (topo.spatial_rank + 1) * k)


def test_ring_matches_serial(spatial):
    spatial.check(RingCase())
