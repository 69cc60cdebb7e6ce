"""The Engine contract: everything the loop may ask of DDP, FSDP2 or DeepSpeed, and nothing more.

An engine is built from (config, model, world). It owns the wrapped model, the optimizer, loss scaling
and gradient synchronisation. The loop only calls:

    engine.module(images=..., texts=...)   forward (features dict), also for eval
    with engine.autocast(): ...            the precision context for forward and loss
    with engine.no_sync(): ...             micro-batches whose gradients are not synchronised yet
    engine.backward(loss)
    engine.step() -> grad norm             unscale, clip, optimizer step, zero grads, clamp logit scale
    engine.set_lr(lr)
    engine.state_dict() / load_state_dict(state)   for the checkpoint manager
    engine.world                           rank, world size, device

Additions for sharding engines (FSDP2, DeepSpeed):

    Engine.build_model(cfg, world, factory)   classmethod, called before the engine exists: where the model
                                           is built. The default calls factory() (a real, initialised model);
                                           sharding engines may return factory(device="meta") for giant
                                           models and materialise the shards themselves.
    engine.sharded_state                   False: state_dict() is the whole state, rank 0 may save it alone.
                                           True: every rank holds a part; every rank must take part in saving.
                                           FSDP's state_dict() holds DTensors (for DCP).
    engine.save_checkpoint(dir, tag) / load_checkpoint(dir, tag)
                                           collective; write/read this engine's state under dir. The default
                                           torch-saves state_dict() from rank 0; FSDP writes a DCP directory;
                                           DeepSpeed writes its own files (its state_dict() raises).
    engine.state_bytes()                   bytes of parameters, gradients and optimizer state on this rank
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
from typing import Any

import torch
from torch import nn

from bigclip.dist import World
from bigclip.precision import Precision, resolve_precision


class Engine(abc.ABC):
    name: str = "base"
    sharded_state: bool = False

    @classmethod
    def build_model(cls, cfg, world: World, factory) -> nn.Module:
        """Build the model for this engine; `factory(**overrides)` is create_model with the run's options."""
        return factory()

    def __init__(self, cfg, model: nn.Module, world: World):
        self.cfg = cfg
        self.world = world
        self.precision: Precision = resolve_precision(cfg.precision, world.device)

    # -- model access
    @property
    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The callable model: forward(images=None, texts=None) -> features dict."""

    @property
    @abc.abstractmethod
    def model(self) -> nn.Module:
        """The unwrapped CLIP model (for attribute access such as logit_scale)."""

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    # -- precision and accumulation
    def autocast(self):
        return self.precision.autocast(self.world.device)

    def no_sync(self):
        return contextlib.nullcontext()

    # -- optimisation
    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def step(self) -> float:
        """Apply the accumulated gradients. Returns the global grad norm before clipping (inf/nan when the
        step was skipped because gradients were not finite)."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abc.abstractmethod
    def get_lr(self) -> float: ...

    # -- state for checkpoints
    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_checkpoint(self, directory: str, tag: str | None = None) -> None:
        """Collective: write this engine's state under `directory` (rank 0 alone for unsharded state)."""
        if self.world.is_main:
            torch.save(self.state_dict(), os.path.join(directory, f"{tag or 'engine_state'}.pt"))

    def load_checkpoint(self, directory: str, tag: str | None = None) -> None:
        path = os.path.join(directory, f"{tag or 'engine_state'}.pt")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (see engine/memory.py)."""
        from bigclip.engine.memory import tensor_bytes

        return tensor_bytes(self.model, getattr(self, "optimizer", None))


class TorchOptimizerEngine(Engine):
    """An engine whose optimizer is a plain torch optimizer in `self.optimizer` (DDP, FSDP2)."""

    optimizer: torch.optim.Optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def clip_and_measure(params: list[torch.Tensor], max_norm: float | None) -> float:
    """Global grad norm of `params`, clipping in place when max_norm is set."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if max_norm is not None and math.isfinite(max_norm):
        nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)
