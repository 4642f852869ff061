"""``fsdp`` mode: FSDP2 (``torch.distributed.fsdp.fully_shard``) under ``torchrun``.

Launched like ``ddp`` (:func:`ckptfix.train.ddp.launch`; gloo on CPU, nccl on
CUDA).  Every layer that holds parameters is ``fully_shard``-ed, then the root:
each rank keeps a 1/N slice (dim 0) of every parameter, of its gradient and of
the SGD momentum buffer; a forward all-gathers a layer's parameters, a backward
reduce-scatters (averages) its gradients.

Saving (collective: every rank takes part):

* ``--save-format dcp`` (the default for fsdp): a truly sharded
  ``torch.distributed.checkpoint`` directory.  ``get_state_dict`` gives the
  model and optimizer state as DTensor shards keyed by parameter name; every
  rank writes its own ``.distcp`` file with only its shards.
* ``--save-format pt``: ``get_state_dict(full_state_dict=True,
  cpu_offload=True)`` gathers the full state on rank 0, which writes the same
  wrapper dict as every other mode (optimizer state keyed by parameter index,
  so it resumes anywhere).

Resuming: the weights come through :func:`ckptfix.ops.load.load_checkpoint`
(any mode, format or prefix) into the unsharded model before it is sharded;
the optimizer state (keyed by index, or by name as in an fsdp DCP checkpoint)
is set with ``set_optimizer_state_dict(full_state_dict=True)``, which keeps
each rank's slice.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ckptfix.errors import TrainingError
from ckptfix.train.config import TrainConfig
from ckptfix.train.devices import Dist
from ckptfix.train.models import build_model
from ckptfix.train.saving import atomic_torch_save, save_dcp


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that own parameters directly (each becomes one FSDP unit), innermost first."""
    units = []
    for _, m in model.named_modules():
        if m is model:
            continue
        if any(True for _ in m.parameters(recurse=False)):
            units.append(m)
    return units


def names_to_ids(opt_sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_state_dict``) re-keyed by index into ``names``.

    Keys that are already ints (or not among ``names``) are kept.
    """
    index = {n: i for i, n in enumerate(names)}

    def as_id(k: Any) -> Any:
        return index.get(k, k) if isinstance(k, str) else k

    out = dict(opt_sd)
    out["state"] = {as_id(k): v for k, v in (opt_sd.get("state") or {}).items()}
    out["param_groups"] = [
        {**g, "params": [as_id(p) for p in g.get("params", [])]} for g in (opt_sd.get("param_groups") or [])
    ]
    return out


def ids_to_names(opt_sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`names_to_ids`: index keys become parameter names (what ``set_state_dict`` wants)."""

    def as_name(k: Any) -> Any:
        return names[k] if isinstance(k, int) and 0 <= k < len(names) else k

    out = dict(opt_sd)
    out["state"] = {as_name(k): v for k, v in (opt_sd.get("state") or {}).items()}
    out["param_groups"] = [
        {**g, "params": [as_name(p) for p in g.get("params", [])]} for g in (opt_sd.get("param_groups") or [])
    ]
    return out


class FSDPState:
    """The sharded model and optimizer of one fsdp rank, and how they are saved and restored."""

    def __init__(self, cfg: TrainConfig, dist: Dist, device_type: str, base: nn.Module) -> None:
        """Shard ``base`` over the process group and make its SGD optimizer.

        Args:
            cfg: The run's configuration.
            dist: The process group's facts (it must be initialised).
            device_type: ``"cuda"`` (rank ``i`` uses ``cuda:LOCAL_RANK``) or ``"cpu"``.
            base: The unsharded model (moved and sharded in place).

        Raises:
            TrainingError: there is no process group.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.enabled:
            raise TrainingError(
                "--mode fsdp needs a process group: run it through `ckptfix train --mode fsdp` "
                "(which launches torchrun) or under your own torchrun"
            )
        self.cfg = cfg
        self.dist = dist
        self.names = [n for n, _ in base.named_parameters()]
        if device_type == "cuda":
            dev = torch.device("cuda", dist.local_rank)
        else:
            dev = torch.device("cpu")
        self.device = dev
        base = base.to(dev)
        mesh = init_device_mesh(dev.type, (dist.world_size,))
        for unit in _shard_units(base):
            fully_shard(unit, mesh=mesh)
        fully_shard(base, mesh=mesh)
        self.model = base
        self.optimizer = torch.optim.SGD(
            base.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )

    def load_optimizer(self, opt_sd: dict[str, Any]) -> None:
        """Restore a full (unsharded) optimizer state dict keyed by index or name; each rank keeps its slice."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not any(g.get("momentum") for g in self.optimizer.param_groups):
            # an SGD without momentum keeps no state tensors, and torch's full-state-dict loader learns the
            # device from those ("Expected device to be set"): shard the checkpoint's state here instead
            self._load_optimizer_locally(opt_sd)
            return
        full = ids_to_names(opt_sd, self.names)
        full["state"] = {
            k: {sk: (sv.to(self.device) if isinstance(sv, torch.Tensor) and sv.dim() else sv) for sk, sv in v.items()}
            for k, v in full["state"].items()
        }
        set_optimizer_state_dict(self.model, self.optimizer, full, options=StateDictOptions(full_state_dict=True))

    def _load_optimizer_locally(self, opt_sd: dict[str, Any]) -> None:
        """Load a full optimizer state dict keyed by index: each state tensor shaped like its parameter becomes a
        DTensor sharded as that parameter is (from this rank's full copy: no collective), the rest as it is.

        Args:
            opt_sd: The full optimizer state dict (index or name keys; every rank holds all of it).
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        opt_sd = names_to_ids(opt_sd, self.names)  # a DCP checkpoint's state is keyed by parameter name
        unknown = [k for k in opt_sd["state"] if not isinstance(k, int) or not 0 <= k < len(self.names)]
        if unknown:
            raise KeyError(f"optimizer state for {unknown[0]!r}, which is not a parameter of the model")
        params = list(self.model.parameters())
        state: dict[int, dict[str, Any]] = {}
        for i, entry in opt_sd["state"].items():
            p = params[i]
            state[i] = {}
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.dim() and v.shape == p.shape:
                    v = distribute_tensor(
                        v.to(self.device, dtype=p.dtype), p.device_mesh, p.placements, src_data_rank=None
                    )
                elif isinstance(v, torch.Tensor) and v.dim():
                    v = v.to(self.device)
                state[i][k] = v
        self.optimizer.load_state_dict({"state": state, "param_groups": copy.deepcopy(opt_sd["param_groups"])})

    def save(
        self, epoch: int, path: str, args: dict[str, Any], args_object: Any
    ) -> tuple[dict[str, Any], nn.Module | None]:
        """Save this epoch to ``path`` (DCP shards from every rank, or a full .pt from rank 0).

        Collective: every rank calls it.

        Args:
            epoch: The epoch just trained.
            path: The checkpoint's final path.
            args: The run's options as a plain dict (stored in a DCP checkpoint).
            args_object: The options as stored in a .pt file (a dict or an ``argparse.Namespace``).

        Returns:
            (the full model state dict, a plain model holding it for the probe), on rank 0;
            ``({}, None)`` on the other ranks.

        Raises:
            OutputError: the checkpoint cannot be written.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        cfg = self.cfg
        full_model, full_optim = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if cfg.save_format == "dcp":
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            payload = {
                "epoch": epoch,
                "model_state_dict": model_sd,
                "optimizer_state_dict": optim_sd,
                "args": args,
            }
            save_dcp(payload, path, self.dist)
        else:
            if self.dist.is_main:
                payload = {
                    "epoch": epoch,
                    "model_state_dict": full_model,
                    "optimizer_state_dict": names_to_ids(full_optim, self.names),
                    "args": args_object,
                }
                atomic_torch_save(payload, path, legacy=cfg.legacy_format)
            self.dist.barrier()
        if not self.dist.is_main:
            return {}, None
        plain = build_model(cfg.model, 0)
        plain.load_state_dict(full_model)
        return full_model, plain
