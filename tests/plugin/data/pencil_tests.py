import torch
from harness import Outputs, Shard, SpatialCase
from harness.collectives import reduce_loss, sync_gradients
from pencil_model import Pencil, sizes

ROWS, COLS = 6, 5  # uneven over 4 ranks: rows 2 2 1 1, columns 2 1 1 1


class PencilCase(SpatialCase):
    dtype = torch.float64

    def build(self, topo):
        model = Pencil(3, ROWS, COLS, topo.spatial_group)
        sync_gradients(model, topo)
        return model

    def batch(self, topo, step):
        return torch.randn(2, 3, ROWS, COLS)[..., self.rows(topo), :]

    def forward(self, model, x, topo):
        y = model(x)
        if topo.spatial_group is None:
            return Outputs((y**2).mean(), {"y": y})
        loss = reduce_loss((y**2).sum(), topo) / (y.shape[0] * y.shape[1] * ROWS * COLS)
        return Outputs(loss, {"y": Shard(y, torch.arange(ROWS)[self.rows(topo)], dim=-2)})

    def rows(self, topo):
        n = sizes(ROWS, topo.spatial_size)
        start = sum(n[: topo.spatial_rank])
        return slice(start, start + n[topo.spatial_rank])


def test_pencil_matches_serial(spatial):
    spatial.check(PencilCase())
