"""The training loop: one optimizer step, and one epoch of them.

It talks to the engine only through its contract (engine/base.py), to checkpoints only through the
Checkpointer's named calls (ckpt/checkpointer.py), and keeps where the run is in one TrainState.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from bigclip.dist import World, all_reduce_min
from bigclip.errors import UserError
from bigclip.flag_fields import LOG, TRAIN, flag, non_negative_int, optional, positive_int
from bigclip.loss.distill import TeacherOutputs
from bigclip.metrics.progress import EpochProgress
from bigclip.train_state import TrainState

MAX_CONSECUTIVE_NONFINITE = 10


@dataclass(frozen=True)
class LoopConfig:
    """What the loop itself reads: how batches make a step, how many epochs, how often it reports."""

    batch_size: int = flag(
        64, "Batch size per process (global = this x world size x accum-freq).", TRAIN, check=positive_int
    )
    epochs: int = flag(32, "Number of epochs.", TRAIN, check=positive_int)
    accum_freq: int = flag(
        1, "Accumulate this many micro-batches per step; negatives span all of them.", TRAIN, check=positive_int
    )
    seed: int = flag(0, "Random seed.", TRAIN, check=non_negative_int)
    log_every_n_steps: int = flag(100, "Print and record metrics every N steps.", LOG, check=positive_int)
    log_metric_every_n_steps: int | None = flag(
        None,
        "Also record the step's scalars (loss averaged over ranks, lr, logit scale, grad norm) to metrics.jsonl "
        "and the trackers every N steps (OpenCLIP main's flag; its default 10, bigclip's: with the log lines "
        "only, as OpenCLIP 3.3). With it every record's loss is the mean over ranks.",
        LOG,
        check=optional(positive_int),
    )
    train_loss_ema_samples: int = flag(
        0,
        "The loss in the log line's parentheses: an exponential average over about this many samples (OpenCLIP "
        "main's flag; its default 50000); 0: the epoch's running average (OpenCLIP 3.3).",
        LOG,
        check=non_negative_int,
    )
    # read here, owned by another slice (its flag is declared there)
    precision: str = "amp"  # named in the start line only

    def samples_per_step(self, world_size: int) -> int:
        return self.batch_size * self.accum_freq * world_size


MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


def forward_backward(
    engine, loss_fn, micro_batches: MicroBatches, world: World, teacher=None
) -> tuple[float, dict | None]:
    """Gradients for one optimizer step; returns (loss value, last forward outputs), or (nan, None) when the
    loss was not finite on some rank: then no backward ran and the step must be skipped.

    With several micro-batches this is OpenCLIP's --accum-freq: features of every micro-batch are first
    computed without gradients, then each micro-batch is recomputed with gradients while the cached
    features of the others serve as negatives. Summed over micro-batches this is the gradient of the
    contrastive loss over the whole accumulated batch. The logit scale (and bias) keep their gradient
    in the last micro-batch only, so their gradient is counted once rather than accum-freq times.
    Gradients are synchronised only in the last micro-batch's backward.

    `teacher` (--distill-model, placed by engine.frozen): its outputs on the same images and texts, computed
    once per micro-batch without gradients, go to the loss beside the student's (over the whole accumulated
    batch, like the features: OpenCLIP refuses --accum-freq with distillation, bigclip's cache makes it exact).
    """
    # the model outputs the loss reads: the features, and what the loss module asks for besides (CoCa's caption
    # logits and labels), cached and concatenated across micro-batches alike
    keys = ("image_features", "text_features", *getattr(loss_fn, "model_outputs", ()))
    if len(micro_batches) == 1:
        images, texts = micro_batches[0]
        with engine.autocast():
            taught = _teacher_outputs(teacher, [(images, texts)])
            out = engine.module(images=images, texts=texts)
            loss = _loss(loss_fn, {k: out[k] for k in keys}, out, True, taught)
        if not _finite_on_all_ranks(loss, world):
            return float("nan"), None
        engine.backward(loss)
        return loss.item(), out

    cached: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    with torch.no_grad(), engine.autocast():
        taught = _teacher_outputs(teacher, micro_batches)
        for images, texts in micro_batches:
            out = engine.module(images=images, texts=texts)
            for k in keys:
                cached[k].append(out[k])

    for j, (images, texts) in enumerate(micro_batches):
        last = j == len(micro_batches) - 1
        with contextlib.nullcontext() if last else engine.no_sync():
            with engine.autocast():
                out = engine.module(images=images, texts=texts)
                inputs = {k: torch.cat(cached[k][:j] + [out[k]] + cached[k][j + 1 :]) for k in keys}
                loss = _loss(loss_fn, inputs, out, last, taught)
            if j == 0 and not _finite_on_all_ranks(loss, world):
                return float("nan"), None  # every micro-batch sees the same loss: no gradient was taken yet
            engine.backward(loss)
    return loss.item(), out


def _teacher_outputs(teacher, micro_batches: MicroBatches) -> TeacherOutputs | None:
    """The frozen teacher's features of every micro-batch (concatenated) and its logit scale."""
    if teacher is None:
        return None
    with torch.no_grad():
        outs = [teacher(images=images, texts=texts) for images, texts in micro_batches]
    return TeacherOutputs(
        torch.cat([o["image_features"] for o in outs]),
        torch.cat([o["text_features"] for o in outs]),
        outs[-1]["logit_scale"],
    )


def _loss(loss_fn, inputs: dict[str, torch.Tensor], out: dict[str, torch.Tensor], keep_scale_grad: bool, taught=None):
    """loss_fn(image features, text features, scale, bias, **the other inputs[, teacher=])."""
    scale = out["logit_scale"] if keep_scale_grad else out["logit_scale"].detach()
    bias = out.get("logit_bias")
    if bias is not None and not keep_scale_grad:
        bias = bias.detach()
    inputs = dict(inputs)
    image_features, text_features = inputs.pop("image_features"), inputs.pop("text_features")
    if taught is not None:
        inputs["teacher"] = taught
    return loss_fn(image_features, text_features, scale, bias, **inputs)


def _finite_on_all_ranks(loss: torch.Tensor, world: World) -> bool:
    # All ranks must agree, or one rank would skip a backward the others wait on.
    return all_reduce_min(1.0 if bool(torch.isfinite(loss.detach()).all()) else 0.0, world) == 1.0


def optimizer_step(engine) -> float:
    """The update, then the model's constraints on its parameters (CLIP's temperature clamp), applied by the
    engine to every copy it keeps, then the moving average of the weights (--ema-decay). Returns the grad norm
    before clipping."""
    grad_norm = engine.step()
    for param, fix in engine.model.parameter_constraints():
        engine.update_parameter_(param, fix)
    if engine.ema is not None:
        engine.ema.update()
    return grad_norm


def train_one_epoch(
    cfg: LoopConfig,
    engine,
    loss_fn,
    train_data,
    state: TrainState,
    schedule,
    checkpointer,
    progress: EpochProgress,
    world: World,
    teacher=None,
) -> bool:
    """The steps of epoch `state.epoch` from `state.batches_in_epoch` on (`teacher`: see forward_backward).
    Returns True when the run must stop (SIGTERM; its final checkpoint is on its way), False when the epoch's
    steps are done."""
    steps = train_data.num_batches // cfg.accum_freq
    step_in_epoch = state.batches_in_epoch // cfg.accum_freq
    samples_per_step = cfg.samples_per_step(world.world_size)
    train_data.set_epoch(state.epoch, skip_batches=state.batches_in_epoch)
    engine.train()
    groups = _micro_batches(train_data.dataloader, cfg.accum_freq, steps - step_in_epoch, engine, world)
    if train_data.ends_early:
        groups = _while_every_rank_has_data(groups, cfg.batch_size, train_data, world)
    first_step = step_in_epoch
    for micro in groups:
        progress.data_ready()
        engine.set_lr(schedule(state.step))
        if engine.steps_in_backward:  # the backward updates the parameters (--optimizer-in-backward): a save in
            # flight must hold its copy before the first update; the forward and the backward until then run beside it
            engine.before_updates_in_backward(checkpointer.wait_for_staging)
        loss, out = forward_backward(engine, loss_fn, micro, world, teacher=teacher)
        if out is None:
            engine.zero_grad()
            grad_norm = float("nan")
            _count_nonfinite(state, progress)
        else:
            checkpointer.wait_for_staging()  # a save in flight must hold its copy before the update
            grad_norm = optimizer_step(engine)
            state.nonfinite_streak = 0
        state.advance(samples_per_step, cfg.accum_freq)
        step_in_epoch += 1
        progress.step_done(state, step_in_epoch, loss, grad_norm, getattr(loss_fn, "parts", None))
        if checkpointer.after_step(state, end_of_epoch=step_in_epoch == steps):
            return True
    if step_in_epoch == first_step < steps:
        raise UserError(
            "the training data yielded no batch this epoch: every shard failed or held no usable sample (image "
            "with a .txt caption); see the data warnings above"
        )
    return False


def _micro_batches(loader, accum_freq: int, steps: int, engine, world: World) -> Iterator[MicroBatches]:
    """At most `steps` groups of accum_freq (images, texts) batches, on the device, images in the weights'
    dtype (pure bf16/fp16 runs)."""
    group: MicroBatches = []
    for images, texts in loader if steps > 0 else ():
        images = images.to(world.device, dtype=engine.precision.param_dtype, non_blocking=True)
        group.append((images, texts.to(world.device, non_blocking=True)))
        if len(group) == accum_freq:
            yield group
            group, steps = [], steps - 1
            if steps == 0:
                return


def _while_every_rank_has_data(groups: Iterator[MicroBatches], batch_size: int, train_data, world: World):
    """The groups, as long as every rank has one: a rank that ran out of data ends the epoch for all (one
    all-reduce per step). The other ranks then read what is left of their epoch without training on it, so
    every shard is still read once per epoch, and count those samples as dropped."""
    groups = iter(groups)
    while True:
        group = next(groups, None)
        if all_reduce_min(0.0 if group is None else 1.0, world) == 0.0:
            left = [] if group is None else [group]
            train_data.count_dropped(sum(len(g) for g in itertools.chain(left, groups)) * batch_size)
            return
        yield group


def _count_nonfinite(state: TrainState, progress: EpochProgress) -> None:
    state.nonfinite_streak += 1
    state.nonfinite_steps += 1
    progress.step_skipped(state)
    if state.nonfinite_streak >= MAX_CONSECUTIVE_NONFINITE:
        raise UserError(
            f"the loss was non-finite for {MAX_CONSECUTIVE_NONFINITE} steps in a row (last at step {state.step}); "
            f"lower --lr, add --grad-clip-norm or use --precision amp_bf16/fp32"
        )
