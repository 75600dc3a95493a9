"""A pencil-decomposed spectral filter: rows split over ranks, every layer a transpose.

Each layer mixes channels locally, then filters along the rows in Fourier space, which needs
every row: the field is transposed (``all_to_all_single``, uneven pieces) so each rank holds
all rows of some columns, filtered, and transposed back. The backward of a transpose is the
transpose back.
"""

import torch
import torch.distributed as dist


def sizes(n, parts):
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def exchange(x, cut_dim, join_dim, joined, group):
    """Cut ``x`` along ``cut_dim`` (whole here) into the group's pieces, send piece j to rank
    j, and join what arrives along ``join_dim`` into its global length ``joined``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces = [p.contiguous() for p in torch.split(x, sizes(x.shape[cut_dim], size), cut_dim)]
    shapes = []
    for n in sizes(joined, size):  # from rank j: its part of join_dim, my piece of cut_dim
        shape = list(pieces[rank].shape)
        shape[join_dim] = n
        shapes.append(shape)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    out = torch.empty(sum(numels), dtype=x.dtype)
    dist.all_to_all_single(
        out,
        torch.cat([p.reshape(-1) for p in pieces]),
        output_split_sizes=numels,
        input_split_sizes=[p.numel() for p in pieces],
        group=group,
    )  # TRANSPOSE
    return torch.cat([c.view(s) for c, s in zip(out.split(numels), shapes)], dim=join_dim)


class Transpose(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cut_dim, join_dim, joined, group):
        ctx.args = (join_dim, cut_dim, x.shape[cut_dim], group)
        return exchange(x, cut_dim, join_dim, joined, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad.contiguous(), *ctx.args), None, None, None, None


class Pencil(torch.nn.Module):
    def __init__(self, channels, rows, cols, group=None, layers=2):
        super().__init__()
        self.group, self.rows, self.cols = group, rows, cols
        self.mix = torch.nn.ModuleList(torch.nn.Linear(channels, channels) for _ in range(layers))
        self.filters = torch.nn.ParameterList(
            torch.nn.Parameter(torch.linspace(1.0, 0.2, rows // 2 + 1)) for _ in range(layers)
        )

    def forward(self, x):  # (batch, channels, rows, cols): the local rows on a rank
        for mix, weight in zip(self.mix, self.filters):
            x = torch.tanh(mix(x.movedim(1, -1)).movedim(-1, 1))
            if self.group is not None:
                x = Transpose.apply(x, -1, -2, self.rows, self.group)  # all rows, some columns
            x = torch.fft.irfft(torch.fft.rfft(x, dim=-2) * weight[:, None], n=self.rows, dim=-2)
            if self.group is not None:
                x = Transpose.apply(x, -2, -1, self.cols, self.group)  # back
        return x
