"""Data-parallel engine: torch DistributedDataParallel, or the bare model in a single process.

Every rank holds the whole model and optimizer state; gradients are all-reduced in backward.
On CPU no device_ids are passed (DDP rejects them for CPU modules).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bigclip import optim
from bigclip.dist import World
from bigclip.engine.base import TorchOptimizerEngine, clip_and_measure


class DDPEngine(TorchOptimizerEngine):
    name = "ddp"

    def __init__(self, cfg, model: nn.Module, world: World):
        super().__init__(cfg, model, world)
        self._model = model.to(device=world.device, dtype=self.precision.param_dtype)
        if cfg.use_bn_sync and world.distributed:
            self._model = nn.SyncBatchNorm.convert_sync_batchnorm(self._model)
        self._module: nn.Module = self._model
        if world.distributed:
            ddp_kwargs: dict[str, Any] = {"static_graph": cfg.ddp_static_graph}
            if world.device.type == "cuda":
                ddp_kwargs["device_ids"] = [world.device]
            self._module = DistributedDataParallel(self._model, **ddp_kwargs)
        self.optimizer = optim.create_optimizer(cfg, optim.param_groups(self._model, cfg.wd))
        self.scaler = torch.amp.GradScaler(world.device.type) if self.precision.loss_scaling else None
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def model(self) -> nn.Module:
        return self._model

    def no_sync(self):
        if isinstance(self._module, DistributedDataParallel):
            return self._module.no_sync()
        return super().no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = clip_and_measure(self._params, self.cfg.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the step itself when gradients overflowed
            self.scaler.update()
        elif math.isfinite(norm):
            self.optimizer.step()
        self.zero_grad()
        self._model.clamp_logit_scale_()
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self._model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
