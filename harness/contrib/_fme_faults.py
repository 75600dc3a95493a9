"""The faults ``FmeCase(faults=...)`` patches into fme's own distributed path, on a rank
only: ``FME_FAULTS`` names and describes them, ``_patch_faults`` applies them (each patch on
``harness.adopt``'s undo stack, undone by ``FmeCase.teardown``)."""

from __future__ import annotations

from typing import Any

import torch

from harness.adopt import on_undo, patch

#: fault id -> what is patched into fme's own distributed path (inside the rank only)
FME_FAULTS: dict[str, str] = {
    "no-spatial-grad-hooks": "wrap_module leaves out fme's spatial gradient all-reduce hooks",
    "reduce-sum-no-allreduce": "spatial_reduce_sum returns the local sum (no all-reduce)",
    "reduce-sum-summed-backward": "spatial_reduce_sum's backward all-reduces the gradient "
    "(fme's is the identity, right for the replicated loss): gradients S times too large",
    "slices-swapped": "get_local_slices hands each rank the block of its mirror rank",
    "all-to-all-peer-order": "fme's gloo all_to_all files each peer's block under the next "
    "peer (a wrong gather order in the SHT's transposes)",
    "no-gloo-alltoall-patch": "ModelTorchDistributed skips patch_gloo_alltoall",
    "mesh-data-innermost": "fme's manager lays its (data, h, w) mesh out with the data "
    "dimension innermost: fme's spatial groups are strided, the harness's consecutive (a "
    "layout the harness must refuse in one line, not judge)",
    # only in inference (fme's Stepper.predict, no_grad): a training check passes them
    "inference-stale-forcing": "each rank keeps the forcing it scattered for the first "
    "rollout step and feeds it to every later step (a per-rank buffer cached across steps)",
    "inference-noise-per-rank": "inference seeds each rank's isotropic-noise generator with "
    "the rank (ensemble inference seeded per process): the tiles of one member see "
    "different noise",
}

#: the faults of ``FME_FAULTS`` that live only in fme's inference path (``FmeCase.predict``)
INFERENCE_FAULTS = ("inference-stale-forcing", "inference-noise-per-rank")


def _patch_faults(faults: tuple[str, ...]) -> None:
    """Break fme's own distributed path the way each fault says, on this rank only (undone
    by ``teardown``)."""
    # long: one short branch per fault id, in FME_FAULTS' order, each patching one fme name
    from fme.core.distributed import _gloo_patch, model_torch_distributed
    from fme.core.distributed.model_torch_distributed import (
        ModelTorchDistributed,
        _AutogradAllReduce,
    )

    cls = ModelTorchDistributed
    on_undo(_FAULT_GROUPS.clear)
    if "no-spatial-grad-hooks" in faults:
        patch(cls, "_register_spatial_grad_hooks", lambda self, module: None)
    if "reduce-sum-no-allreduce" in faults:
        patch(cls, "spatial_reduce_sum", lambda self, tensor: tensor)
    if "reduce-sum-summed-backward" in faults:

        def summed_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            grad = grad.clone()
            torch.distributed.all_reduce(grad, group=_FAULT_GROUPS[0])
            return grad, None

        original_reduce = cls.spatial_reduce_sum

        def reduce_sum(self: Any, tensor: torch.Tensor) -> torch.Tensor:
            _FAULT_GROUPS[:] = [self._spatial_group]
            reduced: torch.Tensor = original_reduce(self, tensor)
            return reduced

        patch(cls, "spatial_reduce_sum", reduce_sum)
        patch(_AutogradAllReduce, "backward", staticmethod(summed_backward))
    if "slices-swapped" in faults:
        original = cls._get_local_spatial_shape

        def mirrored(self: Any, h: int, w: int) -> Any:
            self._h_rank, saved = self._h_size - 1 - self._h_rank, self._h_rank
            try:
                return original(self, h, w)
            finally:
                self._h_rank = saved

        patch(cls, "_get_local_spatial_shape", mirrored)
    if "all-to-all-peer-order" in faults:
        exchange = _gloo_patch._gloo_all_to_all

        def misfiled(outputs: list[torch.Tensor], inputs: list[torch.Tensor], **kw: Any) -> None:
            exchange(outputs, inputs, **kw)
            received = [t.clone() for t in outputs]
            for i, out in enumerate(outputs):
                nxt = received[(i + 1) % len(received)]
                if nxt.shape == out.shape:
                    out.copy_(nxt)

        patch(_gloo_patch, "_gloo_all_to_all", misfiled)
    if "no-gloo-alltoall-patch" in faults:
        patch(model_torch_distributed, "patch_gloo_alltoall", lambda: None)
    if "mesh-data-innermost" in faults:
        from fme.core.distributed.external.pnd_manager import DistributedManager
        from torch.distributed.device_mesh import DeviceMesh

        def data_innermost(self: Any, mesh_shape: Any, mesh_dim_names: Any) -> Any:
            _, h, w = mesh_shape  # fme asks for (-1, h, w) named ("data", "h", "w")
            d = self.world_size // (h * w)
            ranks = torch.arange(self.world_size).reshape(h, w, d).permute(2, 0, 1)
            self._global_mesh = DeviceMesh("cpu", ranks, mesh_dim_names=mesh_dim_names)
            self._mesh_dims = dict(zip(mesh_dim_names, (d, h, w), strict=True))
            return self._global_mesh

        patch(DistributedManager, "initialize_mesh", data_innermost)
    if "inference-stale-forcing" in faults:
        from fme.ace.stepper.single_module import Stepper

        generate = Stepper.predict_generator

        def stale_forcing(self: Any, ic: Any, forcing: Any, *args: Any, **kw: Any) -> Any:
            first = {k: v[:, :1].expand_as(v) for k, v in forcing.items()}
            return generate(self, ic, first, *args, **kw)

        patch(Stepper, "predict_generator", stale_forcing)
    if "inference-noise-per-rank" in faults:
        from fme.ace.registry import stochastic_sfno
        from fme.core.rand import use_generator

        draw = stochastic_sfno.isotropic_noise

        def per_rank(*args: Any, **kw: Any) -> torch.Tensor:
            if torch.is_grad_enabled():  # training draws as fme does
                noise: torch.Tensor = draw(*args, **kw)
                return noise
            seeded = torch.Generator().manual_seed(torch.distributed.get_rank())
            with use_generator(seeded):
                noise = draw(*args, **kw)
            return noise

        patch(stochastic_sfno, "isotropic_noise", per_rank)


_FAULT_GROUPS: list[Any] = []
