"""Learning-rate schedules with OpenCLIP's shapes, as pure functions of the step.

A schedule is a plain function step -> lr, so the loop sets the rate on whatever optimizer the engine
owns (torch, timm or DeepSpeed's) and a resumed run recomputes it from the step alone. Each --lr-scheduler
name is registered in SCHEDULES with the function that builds its schedule from a ScheduleConfig.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from bigclip.errors import UserError
from bigclip.flag_fields import TRAIN, Applies, flag, non_negative_int, non_negative_number, optional
from bigclip.optim import DEFAULT_LR
from bigclip.registry import Registry

Schedule = Callable[[int], float]


# --lr-scheduler NAME -> (ScheduleConfig, optimizer steps per epoch) -> schedule; registered below.
SCHEDULES: Registry[Callable[[ScheduleConfig, int], Schedule]] = Registry("--lr-scheduler")


# --skip-scheduler trains at --lr throughout: the schedule's own flags would do nothing beside it
SCHEDULED = Applies(lambda c: not c.skip_scheduler, "without --skip-scheduler (--lr throughout)", "drop one of the two")
COOLDOWN = Applies(
    lambda c: c.lr_scheduler == "const-cooldown", "with --lr-scheduler const-cooldown", "add that or drop the flag"
)


@dataclass(frozen=True)
class ScheduleConfig:
    """The flags a schedule reads (OpenCLIP's names)."""

    epochs_cooldown: int | None = flag(
        None, "Epochs of cooldown at the end (const-cooldown).", TRAIN, applies=(COOLDOWN, SCHEDULED)
    )
    warmup: int = flag(10000, "Linear warmup steps.", TRAIN, check=non_negative_int, applies=SCHEDULED)
    lr_scheduler: str = flag("cosine", "The learning-rate schedule.", TRAIN, choices=SCHEDULES, applies=SCHEDULED)
    lr_cooldown_end: float = flag(
        0.0,
        "Learning rate at the end of the cooldown.",
        TRAIN,
        check=optional(non_negative_number),
        applies=(COOLDOWN, SCHEDULED),
    )
    lr_cooldown_power: float = flag(
        1.0, "Power of the polynomial cooldown (1 = linear).", TRAIN, applies=(COOLDOWN, SCHEDULED)
    )
    skip_scheduler: bool = flag(
        False, "Train at --lr throughout: no warmup, no schedule (OpenCLIP main's flag).", TRAIN
    )
    # read here, owned by another slice (its flag is declared there)
    lr: float | None = None
    epochs: int = 32


def base_lr(cfg: ScheduleConfig) -> float:
    return cfg.lr if cfg.lr is not None else DEFAULT_LR


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


@SCHEDULES.register("cosine", help="warmup, then cosine decay to 0 at the last step")
def _cosine(cfg: ScheduleConfig, steps_per_epoch: int) -> Schedule:
    return cosine(base_lr(cfg), cfg.warmup, steps_per_epoch * cfg.epochs)


@SCHEDULES.register("const", help="warmup, then constant")
def _const(cfg: ScheduleConfig, steps_per_epoch: int) -> Schedule:
    return constant(base_lr(cfg), cfg.warmup)


@SCHEDULES.register("const-cooldown", help="warmup, constant, then a polynomial cooldown over --epochs-cooldown")
def _const_cooldown(cfg: ScheduleConfig, steps_per_epoch: int) -> Schedule:
    total, cooldown = steps_per_epoch * cfg.epochs, steps_per_epoch * cfg.epochs_cooldown
    return constant_cooldown(base_lr(cfg), cfg.warmup, total, cooldown, cfg.lr_cooldown_power, cfg.lr_cooldown_end)


def check_schedule(cfg: ScheduleConfig) -> None:
    """The schedule flags' rules, before any work."""
    SCHEDULES.entry(cfg.lr_scheduler)
    if cfg.lr_scheduler == "const-cooldown" and cfg.epochs_cooldown is None:
        raise UserError("--lr-scheduler const-cooldown needs --epochs-cooldown N")
    if cfg.epochs_cooldown is not None and not (0 <= cfg.epochs_cooldown <= cfg.epochs):
        raise UserError(f"--epochs-cooldown {cfg.epochs_cooldown!r}: must be between 0 and --epochs ({cfg.epochs})")


def build_schedule(cfg: ScheduleConfig, steps_per_epoch: int) -> Schedule:
    """steps_per_epoch counts optimizer steps (batches // accum_freq), as OpenCLIP does."""
    if cfg.skip_scheduler:
        lr = base_lr(cfg)
        return lambda step: lr
    return SCHEDULES.get(cfg.lr_scheduler)(cfg, steps_per_epoch)
