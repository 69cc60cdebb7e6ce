"""EpochProgress: what the loop reports about its steps, kept out of the loop so the loop reads as the algorithm.

Times each step (waiting for data vs the whole step), averages the loss, drives the progress bar on a
terminal, and every --log-every-n-steps prints OpenCLIP's `Train Epoch: ...` line and writes one metrics
record (metrics.jsonl, tensorboard, wandb), with the samples skipped so far summed over all ranks
(`data/skipped_<reason>`: unreadable shards or members, undecodable images, missing captions, dropped).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from bigclip.dist import World, all_reduce_sum
from bigclip.metrics.meters import AverageMeter, peak_memory_bytes
from bigclip.metrics.sinks import MetricSinks
from bigclip.train_state import TrainState

logger = logging.getLogger("bigclip")


def train_line(
    epoch: int,
    seen: int,
    total: int,
    data_time: float,
    batch_time: float,
    samples_per_s: float,
    per_gpu: float,
    lr: float,
    logit_scale: float,
    loss_val: float,
    loss_avg: float,
) -> str:
    """OpenCLIP's `Train Epoch: ...` log line."""
    digits = len(str(total))
    pct = 100.0 * seen / max(1, total)
    return (
        f"Train Epoch: {epoch} [{seen:>{digits}}/{total} ({pct:.0f}%)] "
        f"Data (t): {data_time:.3f} Batch (t): {batch_time:.3f}, {samples_per_s:#g}/s, {per_gpu:#g}/s/gpu "
        f"LR: {lr:.6f} Logit Scale: {logit_scale:.3f} Loss: {loss_val:#.5g} ({loss_avg:#.5g})"
    )


class EpochProgress:
    def __init__(
        self,
        log_every: int,
        batch_size: int,
        samples_per_step: int,
        engine,
        sinks: MetricSinks,
        world: World,
        steps: int,
        samples: int,
        state: TrainState,
        train_data,
        more_metrics: Callable[[], dict[str, float]] = dict,
        metric_every: int | None = None,
        loss_ema_samples: int = 0,
    ):
        """log_every: --log-every-n-steps; batch_size: per rank and micro-batch (the loss average's weight);
        samples_per_step: over all ranks and micro-batches; steps:
        optimizer steps in the epoch; samples: samples in the epoch over all ranks; train_data: the
        DataInfo whose skipped samples are reported (summed over ranks) at every log step; more_metrics: other
        parts' counters for every record (the checkpointer's ckpt/skipped); metric_every:
        --log-metric-every-n-steps (a scalars-only record every N steps, every record's loss the mean over ranks);
        loss_ema_samples: --train-loss-ema-samples (the log line's smoothed loss; 0: the epoch's average)."""
        self.more_metrics = more_metrics
        self.log_every, self.batch_size = log_every, batch_size
        self.engine, self.sinks, self.world = engine, sinks, world
        self.train_data = train_data
        self.steps, self.samples = steps, samples
        self.samples_per_step = samples_per_step
        self.epoch = state.epoch
        self.batch_time, self.data_time, self.loss = AverageMeter(), AverageMeter(), AverageMeter()
        self.metric_every = metric_every
        # the smoothed loss's weight on the past per step: about loss_ema_samples samples of memory
        self.ema_decay = math.exp(-samples_per_step / loss_ema_samples) if loss_ema_samples else None
        self.loss_ema: float | None = None
        self._parts: dict = {}  # the loss's terms at the last step (see step_done)
        self.bar = None
        if world.is_main and sys.stdout.isatty():
            self.bar = tqdm(total=steps, desc=f"epoch {state.epoch}", leave=False, dynamic_ncols=True)
        self._end = time.perf_counter()

    def data_ready(self) -> None:
        """The step's batches have arrived: the time since the last step ended was spent waiting for data."""
        self.data_time.update(time.perf_counter() - self._end)

    def step_skipped(self, state: TrainState) -> None:
        """A step whose loss was non-finite on some rank (state.step: that step, not yet advanced)."""
        logger.warning(f"step {state.step}: non-finite loss; step skipped, weights unchanged")
        self.sinks.write({"step": state.step, "epoch": state.epoch, "nonfinite_loss": 1})

    def step_done(
        self, state: TrainState, step_in_epoch: int, loss: float, grad_norm: float, parts: dict | None = None
    ) -> None:
        """After state.advance(); loss is nan for a skipped step (it wrote its own record). `parts`: the loss's
        terms as its module exposes them (the distillation loss: contrastive_loss, distill_loss), logged and
        recorded beside it."""
        self._parts = parts or {}
        self.batch_time.update(time.perf_counter() - self._end)
        self._end = time.perf_counter()
        if math.isfinite(loss):
            self.loss.update(loss, self.batch_size)
            if self.ema_decay is not None:
                previous = loss if self.loss_ema is None else self.loss_ema
                self.loss_ema = self.ema_decay * previous + (1 - self.ema_decay) * loss
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self.engine.get_lr():.2e}")
        due = step_in_epoch % self.log_every == 0 or step_in_epoch == self.steps
        scalars_due = self.metric_every is not None and step_in_epoch % self.metric_every == 0
        if not math.isfinite(loss):
            return
        if due:
            self._log(state, step_in_epoch, loss, grad_norm)
        elif scalars_due:
            self.sinks.write({**self._scalars(state, loss, grad_norm), "epoch": self.epoch})

    def _scalars(self, state: TrainState, loss: float, grad_norm: float) -> dict[str, float]:
        """The step's scalars for a record; with --log-metric-every-n-steps the loss is the mean over ranks
        (collective: every rank records at the same steps)."""
        names = sorted(self._parts)
        values = [loss, *(float(self._parts[n]) for n in names)]
        if self.metric_every is not None:
            summed = all_reduce_sum(torch.tensor(values, dtype=torch.float64), self.world)
            values = [float(v) / self.world.world_size for v in summed]
        model = self.engine.model
        bias = getattr(model, "logit_bias", None)  # SigLIP's
        return {
            "step": state.step,
            "samples_seen": state.samples_seen,
            "loss": values[0],
            **dict(zip(names, values[1:])),
            "lr": self.engine.get_lr(),
            "logit_scale": float(model.logit_scale.detach().float().exp().mean()),
            **({"logit_bias": float(bias.detach().float().mean())} if bias is not None else {}),
            "grad_norm": grad_norm,
        }

    def _log(self, state: TrainState, step_in_epoch: int, loss: float, grad_norm: float) -> None:
        per_s = self.samples_per_step / max(self.batch_time.avg, 1e-9)
        per_gpu = per_s / self.world.world_size
        scalars = self._scalars(state, loss, grad_norm)
        seen = min(step_in_epoch * self.samples_per_step, self.samples)
        smoothed = self.loss_ema if self.loss_ema is not None else self.loss.avg
        line = train_line(
            self.epoch, seen, self.samples, self.data_time.avg, self.batch_time.avg, per_s, per_gpu,
            scalars["lr"], scalars["logit_scale"], loss, smoothed,
        )  # fmt: skip
        for name in sorted(self._parts):  # OpenCLIP's spelling of the terms in its log line
            line += f" {name.capitalize()}: {scalars[name]:.4f}"
        skipped = self._skipped()  # collective: every rank logs at the same steps
        if skipped:
            line += f" Skipped: {sum(skipped.values())} ({', '.join(f'{k} {v}' for k, v in skipped.items())})"
        (self.bar.write(line) if self.bar is not None else logger.info(line))
        self.sinks.write(
            {
                **{f"data/skipped_{k}": v for k, v in skipped.items()},
                **self.more_metrics(),
                **scalars,
                "epoch": self.epoch,
                "samples_per_s": per_s,
                "samples_per_s_per_gpu": per_gpu,
                "batch_time": self.batch_time.avg,
                "data_time": self.data_time.avg,
                "peak_memory_bytes": peak_memory_bytes(self.world.device),
            }
        )
        self.batch_time.reset()
        self.data_time.reset()

    def _skipped(self) -> dict[str, int]:
        """Samples skipped so far by reason, summed over all ranks (collective); reasons with none left out."""
        counts = self.train_data.skipped()
        totals = all_reduce_sum(torch.tensor([counts[k] for k in sorted(counts)], dtype=torch.float64), self.world)
        return {k: int(v) for k, v in zip(sorted(counts), totals.tolist()) if v}

    def close(self, state: TrainState) -> None:
        """End of the epoch's steps (finished or stopped): close the bar and report the bad samples skipped so
        far, summed over all ranks (collective). Bad samples are never fatal and never silent."""
        if self.bar is not None:
            self.bar.close()
        skipped = self._skipped()
        if skipped:
            detail = ", ".join(f"{k}: {v}" for k, v in skipped.items())
            logger.warning(f"data: {sum(skipped.values())} bad sample(s) skipped so far ({detail})")
            self.sinks.write(
                {"step": state.step, "epoch": self.epoch, **{f"data/skipped_{k}": v for k, v in skipped.items()}}
            )
