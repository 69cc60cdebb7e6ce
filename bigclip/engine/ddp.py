"""Data-parallel engine: torch DistributedDataParallel, or the bare model in a single process.

Every rank holds the whole model and optimizer state; gradients are all-reduced in backward.
On CPU no device_ids are passed (DDP rejects them for CPU modules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bigclip import optim
from bigclip.dist import World
from bigclip.engine.base import StateBytes, TorchOptimizerEngine
from bigclip.engine.config import EngineConfig
from bigclip.errors import UserError


class DDPEngine(TorchOptimizerEngine):
    name = "ddp"
    help = "torch DistributedDataParallel: every rank holds the whole model and optimizer state"

    @classmethod
    def check_config(cls, cfg: EngineConfig) -> None:
        if cfg.engine == cls.name and cfg.sharded_init == "always":
            raise UserError(
                "--sharded-init always: needs an engine that shards parameters (--engine fsdp, or "
                "deepspeed with ZeRO stage 3)"
            )

    @classmethod
    def describe_plan(cls, cfg: EngineConfig, world: World, num_params: int) -> tuple[str, str]:
        return cls.name, f"ddp: the whole model, its gradients and AdamW state on each of {world.world_size} rank(s)"

    @classmethod
    def memory_models(cls) -> dict[str, StateBytes]:
        # fp32 weights, gradients and Adam moments on every rank, whatever the precision (amp keeps fp32 weights)
        return {cls.name: lambda psi, n, precision, size: 16 * psi}

    def __init__(self, cfg: EngineConfig, model: nn.Module, world: World):
        super().__init__(cfg, model, world)
        self.model = model.to(device=world.device, dtype=self.precision.param_dtype)
        if cfg.use_bn_sync and world.distributed:
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        self.module = self.model
        if world.distributed:
            ddp_kwargs: dict[str, Any] = {"static_graph": cfg.ddp_static_graph}
            if world.device.type == "cuda":
                ddp_kwargs["device_ids"] = [world.device]
            self.module = DistributedDataParallel(self.model, **ddp_kwargs)
        self.optimizer = optim.create_optimizer(cfg.optimizer, optim.param_groups(self.model, cfg.optimizer.wd))
        self.scaler = torch.amp.GradScaler(world.device.type) if self.precision.loss_scaling else None
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def no_sync(self):
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return super().no_sync()
