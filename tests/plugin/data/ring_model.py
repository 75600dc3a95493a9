"""A ring of positions split over ranks: a halo stencil, a global mean, own gradient hooks."""

import torch
import torch.distributed as dist


class GlobalMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_sum, n, group):
        ctx.n, ctx.group = n, group
        total = local_sum.clone()
        dist.all_reduce(total, group=group)  # ALLREDUCE_FORWARD
        return total / n

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # ALLREDUCE_BACKWARD
        return grad / ctx.n, None, None


def halo(y, group):
    """The neighbours' edge values on the ring: (left's last, right's first)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    left, right = (rank - 1) % size, (rank + 1) % size
    from_left, from_right = torch.zeros_like(y[..., :1]), torch.zeros_like(y[..., :1])
    works = [
        dist.isend(y[..., -1:].contiguous(), right, group=group),  # ISEND_RIGHT
        dist.isend(y[..., :1].contiguous(), left, group=group),  # ISEND_LEFT
        dist.irecv(from_left, left, group=group),  # IRECV_LEFT
        dist.irecv(from_right, right, group=group),  # IRECV_RIGHT
    ]
    for work in works:
        work.wait()
    return from_left, from_right


def sum_gradients(model, group):
    for p in model.parameters():
        p.register_hook(lambda g: _summed(g, group))


def _summed(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)  # ALLREDUCE_HOOK
    return grad


class Ring(torch.nn.Module):
    def __init__(self, channels, npos, group=None):
        super().__init__()
        self.lin, self.npos, self.group = torch.nn.Linear(channels, channels), npos, group

    def forward(self, x):  # x: (batch, channels, positions)
        y = self.lin(x.movedim(1, -1)).movedim(-1, 1)
        d = y.detach()
        if self.group is None:
            left, right = d.roll(1, -1), d.roll(-1, -1)
            mean = y.sum(-1) / self.npos
        else:
            from_left, from_right = halo(d, self.group)
            left = torch.cat([from_left, d[..., :-1]], -1)
            right = torch.cat([d[..., 1:], from_right], -1)
            mean = GlobalMean.apply(y.sum(-1), self.npos, self.group)
        return y + 0.5 * (left + right) + mean[..., None]
