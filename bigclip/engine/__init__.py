"""Engines and the order in which parallelism is applied to a finished model.

    1. freeze locked towers         (--lock-image / --lock-text: requires_grad off before any wrapping)
    2. activation checkpointing     (per transformer block, inside the towers' block loop)
    3. compile per block            (--torchcompile: each block compiled in place, names unchanged)
    4. wrap / shard by the engine   (DDP; FSDP2 and DeepSpeed ZeRO slot in here)
    5. materialise and initialise   (engines that build on the meta device)

Each step is a small function; the model code itself never mentions an engine.
"""

from __future__ import annotations

from torch import nn

from ..dist import World
from .base import Engine
from .ddp import DDPEngine

ENGINE_CLASSES: dict[str, type[Engine]] = {"ddp": DDPEngine}


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
    if cfg.torchcompile:
        for block in model.transformer_blocks():
            block.compile()


def build_engine(cfg, model: nn.Module, world: World) -> Engine:
    apply_locks(model, cfg)
    apply_activation_checkpointing(model, cfg)
    apply_compile(model, cfg)
    return ENGINE_CLASSES[cfg.engine](cfg, model, world)


__all__ = ["Engine", "DDPEngine", "build_engine", "ENGINE_CLASSES"]
