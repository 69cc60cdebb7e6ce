"""When to save: every N epochs (--save-frequency), every N steps, every N minutes, and on SIGTERM.

Steps and epochs are the same on every rank; minutes and signals are not (clocks drift, a signal may reach
one rank first). So after each step the ranks agree on [stop, minutes due] with one tiny all-reduce (max)
on a gloo group of its own — rank 0's clock decides the minutes, any rank's SIGTERM stops all of them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bigclip.ckpt.config import CheckpointConfig


class SaveCadence:
    def __init__(self, cfg: CheckpointConfig, world):
        self.save_frequency = cfg.save_frequency
        self.epochs = cfg.epochs
        self.every_steps = cfg.save_every_n_steps
        self.every_seconds = cfg.save_every_minutes * 60.0
        self.world = world
        self.group = dist.new_group(backend="gloo") if world.distributed else None
        self.last_save = time.monotonic()

    def epoch_due(self, completed: int) -> bool:
        return self.save_frequency > 0 and (completed % self.save_frequency == 0 or completed == self.epochs)

    def after_step(self, step: int, stop_requested: bool) -> tuple[bool, bool]:
        """(save now, stop now) for the step just finished; collective in multi-process runs."""
        minutes_due = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        stop = stop_requested
        if self.group is not None:
            flags = torch.tensor([float(stop), float(minutes_due and self.world.is_main)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            stop, minutes_due = bool(flags[0]), bool(flags[1])
        steps_due = self.every_steps > 0 and step % self.every_steps == 0
        return steps_due or minutes_due or stop, stop

    def saved(self) -> None:
        self.last_save = time.monotonic()
