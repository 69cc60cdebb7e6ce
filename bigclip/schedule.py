"""Learning-rate schedules with OpenCLIP's shapes, as pure functions of the step.

A schedule is a plain function step -> lr, so the loop sets the rate on whatever optimizer the engine
owns (torch, timm or DeepSpeed's) and a resumed run recomputes it from the step alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Schedule = Callable[[int], float]


def _warmup(base_lr: float, warmup: int, step: int) -> float:
    return base_lr * (step + 1) / warmup


def cosine(base_lr: float, warmup: int, total_steps: int) -> Schedule:
    def lr(step: int) -> float:
        if step < warmup:
            return _warmup(base_lr, warmup, step)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * progress)) * base_lr

    return lr


def constant(base_lr: float, warmup: int) -> Schedule:
    def lr(step: int) -> float:
        return _warmup(base_lr, warmup, step) if step < warmup else base_lr

    return lr


def constant_cooldown(
    base_lr: float, warmup: int, total_steps: int, cooldown_steps: int, power: float = 1.0, end_lr: float = 0.0
) -> Schedule:
    start_cooldown = total_steps - cooldown_steps

    def lr(step: int) -> float:
        if step < warmup:
            return _warmup(base_lr, warmup, step)
        if step < start_cooldown:
            return base_lr
        progress = (step - start_cooldown) / max(1, total_steps - start_cooldown)
        return (1 - progress) ** power * (base_lr - end_lr) + end_lr

    return lr


def build_schedule(cfg, steps_per_epoch: int) -> Schedule:
    """steps_per_epoch counts optimizer steps (batches // accum_freq), as OpenCLIP does."""
    total = steps_per_epoch * cfg.epochs
    base_lr = cfg.lr if cfg.lr is not None else 5e-4
    if cfg.lr_scheduler == "cosine":
        return cosine(base_lr, cfg.warmup, total)
    if cfg.lr_scheduler == "const":
        return constant(base_lr, cfg.warmup)
    return constant_cooldown(
        base_lr, cfg.warmup, total, steps_per_epoch * cfg.epochs_cooldown, cfg.lr_cooldown_power, cfg.lr_cooldown_end
    )
