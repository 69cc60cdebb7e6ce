"""Engines and the order in which parallelism is applied to a finished model.

    1. freeze locked towers         (--lock-image / --lock-text: requires_grad off before any wrapping)
    2. activation checkpointing     (per transformer block, inside the towers' block loop)
    3. compile per block            (--torchcompile: each block compiled in place, names unchanged)
    4. wrap / shard by the engine   (DDP; FSDP2: fully_shard per block, then the root; DeepSpeed ZeRO 0-3)
    5. materialise and initialise   (engines that build on the meta device)

Step 0 comes before all of these: `build_model` asks the engine where the model is built. DDP and ZeRO-0/1/2
take a real, initialised model; FSDP2 and ZeRO-3 take a meta model when it is large (--sharded-init auto:
500M+ parameters) and initialise it shard by shard in step 5 (engine/sharded_init.py), so no rank ever
holds the whole of a ViT-bigG-14.

Each step is a small function; the model code itself never mentions an engine.
"""

from __future__ import annotations

import torch
from torch import nn

from bigclip.dist import World
from bigclip.engine.base import Engine
from bigclip.engine.ddp import DDPEngine
from bigclip.engine.deepspeed import DeepSpeedEngine
from bigclip.engine.fsdp import FSDPEngine
from bigclip.errors import UserError

ENGINE_CLASSES: dict[str, type[Engine]] = {cls.name: cls for cls in (DDPEngine, FSDPEngine, DeepSpeedEngine)}


def check_config(cfg) -> None:
    """Flag validation's engine part: the chosen engine exists, and every engine checks the flags it owns."""
    if cfg.engine not in ENGINE_CLASSES:
        raise UserError(f"--engine {cfg.engine!r}: choose one of {', '.join(ENGINE_CLASSES)}")
    for cls in ENGINE_CLASSES.values():
        cls.check_config(cfg)


def build_model(cfg, world: World, factory) -> nn.Module:
    """Step 0: the engine decides whether the model is built whole or on meta (see above)."""
    return ENGINE_CLASSES[cfg.engine].build_model(cfg, world, factory)


def describe_plan(cfg, world: World, num_params: int) -> tuple[str, str]:
    """For --dry-run: (the memory setup bigclip.plan computes, one line on how the engine lays the run out)."""
    return ENGINE_CLASSES[cfg.engine].describe_plan(cfg, world, num_params)


def apply_locks(model: nn.Module, cfg) -> None:
    if cfg.lock_image:
        model.lock_image_tower(cfg.lock_image_unlocked_groups, cfg.lock_image_freeze_bn_stats)
    if cfg.lock_text:
        model.lock_text_tower(cfg.lock_text_unlocked_layers, cfg.lock_text_freeze_layer_norm)


def apply_activation_checkpointing(model: nn.Module, cfg) -> None:
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True, every=cfg.grad_checkpointing_every)


def apply_compile(model: nn.Module, cfg) -> None:
    # Per block rather than whole-model: compile time stays flat in depth, parameter names stay the
    # same (checkpoints and sharding see the usual names), and a graph break stays local to one block.
    # The block's forward is compiled, not its __call__: the engines' per-block hooks (FSDP2's all-gather,
    # ZeRO-3's parameter fetch) stay outside the graph, so their changing state fails no guard (under ZeRO-3
    # compiling __call__ recompiled every block on every call).
    if cfg.torchcompile:
        for block in model.transformer_blocks():
            block.forward = torch.compile(block.forward)


def build_engine(cfg, model: nn.Module, world: World) -> Engine:
    apply_locks(model, cfg)
    apply_activation_checkpointing(model, cfg)
    apply_compile(model, cfg)
    return ENGINE_CLASSES[cfg.engine](cfg, model, world)


__all__ = [
    "Engine",
    "DDPEngine",
    "FSDPEngine",
    "DeepSpeedEngine",
    "build_engine",
    "describe_plan",
    "build_model",
    "check_config",
    "ENGINE_CLASSES",
]
