"""Data-parallel engine: torch DistributedDataParallel, or the bare model in a single process.

Every rank holds the whole model and optimizer state; gradients are all-reduced in backward.
On CPU no device_ids are passed (DDP rejects them for CPU modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bigclip.dist import World
from bigclip.engine import in_backward
from bigclip.engine.base import NO_BATCHNORM, TorchOptimizerEngine, has_batchnorm
from bigclip.engine.config import EngineConfig
from bigclip.engine.ema import update_scratch_bytes as ema_update_bytes
from bigclip.errors import UserError
from bigclip.flag_fields import DIST, flag, idle
from bigclip.memory import MemorySetup, ModelSize, StateRecipe, WorkingBytes


@dataclass(frozen=True)
class DDPFlags:
    ddp_static_graph: bool = flag(False, "DDP static graph (--engine ddp).", DIST)
    use_bn_sync: bool = flag(False, "Synchronise BatchNorm statistics across processes (--engine ddp).", DIST)


class DDPEngine(TorchOptimizerEngine):
    name = "ddp"
    help = "torch DistributedDataParallel: every rank holds the whole model and optimizer state"
    Flags = DDPFlags

    @classmethod
    def check_config(cls, cfg: EngineConfig) -> None:
        if cfg.sharded_init != "auto":  # DDP builds the whole model on every rank, whatever the flag says
            raise UserError(
                f"--sharded-init {cfg.sharded_init}: needs an engine that shards parameters (--engine fsdp, or "
                "deepspeed with ZeRO stage 3); drop the flag"
            )
        if cfg.optimizer_in_backward and cfg.engine_flags.ddp_static_graph:
            # stepped in the backward, the model is not wrapped in DistributedDataParallel at all
            raise UserError(
                "--ddp-static-graph: only applies to DistributedDataParallel's reducer, which "
                "--optimizer-in-backward replaces with its own hooks; drop one of the two"
            )

    @classmethod
    def describe_plan(cls, cfg: EngineConfig, world: World, num_params: int) -> tuple[str, str]:
        if cfg.optimizer_in_backward:
            return cls.name, (
                f"ddp: the whole model and its optimizer state on each of {world.world_size} rank(s); each "
                f"parameter stepped in the backward once its gradient is all-reduced (no gradients kept)"
            )
        return cls.name, f"ddp: the whole model, its gradients and AdamW state on each of {world.world_size} rank(s)"

    @classmethod
    def memory_setups(cls) -> dict[str, MemorySetup]:
        def ddp(psi: int, n: int, recipe: StateRecipe, size: ModelSize | None) -> float:
            # the whole state on every rank (amp keeps fp32 weights); stepped in the backward, at most one
            # block's gradients are in flight
            in_flight = recipe.weight_bytes * size.block_params if recipe.in_backward and size else 0
            return recipe.per_param * psi + in_flight

        return {cls.name: MemorySetup(ddp, cls._working, flags={"engine": cls.name})}

    @staticmethod
    def _working(psi: int, n: int, recipe: StateRecipe, size: ModelSize, device_type: str) -> WorkingBytes:
        # amp: autocast keeps a 16-bit copy of every fp32 weight from its first use in the forward until the
        # backward is done with it; every rank steps every parameter
        copies = 2 * psi if recipe.mixed else 0
        step = recipe.step_scratch_bytes(psi, size.largest_tensor, device_type, size.unit_params)
        # stepped in the backward, the largest gradient and its averaged copy are in flight (beyond one block's
        # budget); else the gradients are views of the buckets, already counted
        in_flight = 2 * recipe.weight_bytes * size.largest_tensor if recipe.in_backward else 0
        # Accumulating, the gradients view DistributedDataParallel's first bucket when it rebuilds its buckets at
        # the second forward, so the new buckets are allocated while the old one still holds every gradient,
        # beside the optimizer state (see __init__; measured, ViT-B-32 amp --accum-freq 4 on 2 ranks: +577 MiB).
        # Stepped in the backward, or on one rank, no DistributedDataParallel is built.
        rebucket = recipe.grad_bytes * psi if n > 1 and recipe.accum_freq > 1 and not recipe.in_backward else 0
        ema = ema_update_bytes(recipe.weight_bytes, psi, size.largest_tensor) if recipe.ema else 0
        return WorkingBytes(copies, step, text_end=in_flight, rebucket=rebucket, ema_update=ema)

    def __init__(self, cfg: EngineConfig, model: nn.Module, world: World):
        super().__init__(cfg, model, world)
        self.model = model.to(device=world.device, dtype=self.precision.param_dtype)
        if cfg.engine_flags.use_bn_sync and not has_batchnorm(model):
            idle("use_bn_sync", NO_BATCHNORM["use_bn_sync"])
        if cfg.engine_flags.use_bn_sync and world.distributed:
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        self.module = self.model
        self._accumulates = cfg.accum_freq > 1
        if world.distributed and cfg.optimizer_in_backward:
            # DDP's reducer would keep a bucket copy of every gradient: the gradients are averaged by the
            # in-backward hooks instead (engine/in_backward.py), and what DDP does besides is done here.
            replicate_from_rank0(self.model)
            self._build_optimizer(
                self.model, average_over=dist.group.WORLD, in_flight_bytes=in_backward.in_flight_budget(self.model)
            )
        else:
            if world.distributed:
                # Gradients as views of the all-reduce buckets: otherwise the reducer keeps its bucket copy of
                # every gradient beside .grad for the whole run (one more gradient's bytes per parameter). A
                # synchronised backward makes every gradient a view of its bucket; so does building the buckets,
                # for a gradient that exists then. Which one bigclip relies on depends on --accum-freq:
                # - accumulating, a gradient that is None when a step starts stays a tensor of its own through the
                #   micro-batches without sync, copied in and freed only by the synchronised backward (measured,
                #   ViT-B-32 amp --accum-freq 2: a whole float32 gradient, 577 MiB, above the plan). Given zeros
                #   now and zeroed in place after each step, every micro-batch accumulates into the buckets.
                # - else the gradients are None between steps (zero_grad), views again after each backward. DDP
                #   starts with one bucket of every gradient and rebuilds its buckets once, at the second forward
                #   (in the order the first backward produced the gradients), freeing the old bucket first: a
                #   gradient still viewing it would keep it beside the new ones (measured, ViT-B-32 fp32: +577
                #   MiB at the second step, 15% above the step's peak with --grad-checkpointing). Accumulating,
                #   the plan counts that moment (memory/peak.py's rebucket).
                if self._accumulates:
                    for param in self.model.parameters():
                        if param.requires_grad:
                            param.grad = torch.zeros_like(param)
                ddp_kwargs: dict[str, Any] = {
                    "static_graph": cfg.engine_flags.ddp_static_graph,
                    "gradient_as_bucket_view": True,
                }
                if world.device.type == "cuda":
                    ddp_kwargs["device_ids"] = [world.device]
                self.module = DistributedDataParallel(self.model, **ddp_kwargs)
            self._build_optimizer(self.model)
        self.scaler = torch.amp.GradScaler(world.device.type) if self.precision.loss_scaling else None

    def no_sync(self):
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return super().no_sync()

    def zero_grad(self) -> None:
        if isinstance(self.module, DistributedDataParallel) and self._accumulates:
            # the gradients are views of the buckets, which stay allocated whatever .grad says (see __init__)
            self.optimizer.zero_grad(set_to_none=False)
        else:
            super().zero_grad()


def replicate_from_rank0(model: nn.Module) -> None:
    """What DistributedDataParallel does besides averaging gradients: every rank starts from rank 0's parameters
    and buffers, and floating-point buffers (BatchNorm statistics) are rank 0's at every training forward."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if buffers:

        def broadcast_buffers(module: nn.Module, _args) -> None:
            if module.training:
                with torch.no_grad():
                    for buffer in buffers:
                        dist.broadcast(buffer, src=0)

        model.register_forward_pre_hook(broadcast_buffers)
