"""fme's global state for one run: its ``Distributed`` singleton (``NonDistributed`` or
``ModelTorchDistributed`` on the harness's world), what fme's backend changes beyond it, and
the check of fme's groups against the topology. Every change is on ``harness.adopt``'s undo
stack."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from harness.adopt import adopt_distributed_manager, check_group, on_undo
from harness.contrib._fme_model import FmeConfig
from harness.topology import Topology


def _install_backend(topo: Topology, cfg: FmeConfig) -> Any:
    """fme's ``Distributed`` singleton for this run: ``NonDistributed`` for the reference,
    ``ModelTorchDistributed(h, w)`` on the harness's world for the ranks; each change is
    pushed onto ``harness.adopt``'s undo stack."""
    from fme.core.distributed import distributed as fme_distributed
    from fme.core.distributed.distributed import Distributed
    from fme.core.distributed.external.pnd_manager import DistributedManager

    from harness._base.compat import reset_torch_harmonics_groups, restore_transposes

    saved = (fme_distributed.singleton, Distributed._entered)

    def restore_singleton() -> None:
        setattr(fme_distributed, "singleton", saved[0])  # noqa: B010
        Distributed._entered = saved[1]

    on_undo(restore_singleton)
    instance = Distributed.__new__(Distributed)
    instance._seed = 0
    instance._force_non_distributed = topo.spatial_group is None
    if topo.spatial_group is None:
        from fme.core.distributed.non_distributed import NonDistributed

        instance._distributed = NonDistributed()
    else:
        from fme.core.distributed.model_torch_distributed import ModelTorchDistributed

        restore_transposes()  # fme brings its own answer to gloo's all_to_all
        reset_torch_harmonics_groups()
        # fme's manager then skips init_process_group (and never destroys the harness's)
        adopt_distributed_manager(topo, DistributedManager)
        on_undo(_undo_fme_side_effects)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Distributed manager is already initialized")
            instance._distributed = ModelTorchDistributed(h_size=cfg.h, w_size=cfg.w)
    setattr(fme_distributed, "singleton", instance)  # noqa: B010
    Distributed._entered = True
    return instance


def _undo_fme_side_effects() -> None:
    """What ``ModelTorchDistributed.__init__`` changes beyond the manager: its gloo
    ``all_to_all`` patch and torch-harmonics' groups (``thd.init``)."""
    from fme.core.distributed import _gloo_patch

    from harness._base.compat import reset_torch_harmonics_groups

    if _gloo_patch._original_all_to_all is not None:
        torch.distributed.all_to_all = _gloo_patch._original_all_to_all
        _gloo_patch._original_all_to_all = None
    reset_torch_harmonics_groups()


def _check_groups(backend: Any, topo: Topology, cfg: FmeConfig) -> None:
    """fme built its groups from its own (data, h, w) mesh: they must hold the ranks the
    harness partitions for (the spatial and data groups, and the rows and columns of the
    h x w grid as ``Topology.grid`` lays them out). As sets: fme places its blocks by its own
    group ranks and reports them by global position, so an order of its own is no error."""
    base = topo.data_rank * topo.spatial_size
    p, a = divmod(topo.spatial_rank, cfg.w)
    check_group(backend._spatial_group, topo, "fme's spatial group", of="spatial")
    check_group(backend._data_group, topo, "fme's data group", of="data")
    polar = [base + i * cfg.w + a for i in range(cfg.h)]
    check_group(backend._h_group, topo, "fme's h (polar) group", of=polar)
    azimuth = [base + p * cfg.w + j for j in range(cfg.w)]
    check_group(backend._w_group, topo, "fme's w (azimuth) group", of=azimuth)
