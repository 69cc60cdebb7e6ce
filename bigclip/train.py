"""The training loop: setup, epochs, accumulation, precision, schedule, logging, eval, checkpoints.

The loop talks to the engine only through its contract (engine/base.py) and to checkpoints only
through the manager's save / wait / latest / load, so engines and storage change without touching it.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from datetime import datetime
from typing import Any

import numpy as np
import torch

from bigclip import config as config_mod
from bigclip.ckpt.preemption import Preempted
from bigclip.ckpt.session import CheckpointSession, local_logs_dir, preflight
from bigclip.data import DataInfo
from bigclip.dist import World, all_reduce_min, all_reduce_sum, broadcast_object, init_distributed, shutdown
from bigclip.engine import build_engine
from bigclip.errors import UserError
from bigclip.eval import evaluate
from bigclip.log import (
    AverageMeter,
    MetricSinks,
    check_new_run,
    default_run_name,
    logger,
    peak_memory_bytes,
    run_paths,
    setup_console_logging,
    train_line,
)

MAX_CONSECUTIVE_NONFINITE = 10


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- setup
def build_model(cfg, world: World):
    import functools

    from bigclip.engine import build_model as build_for_engine
    from bigclip.model import create_model

    factory = functools.partial(
        create_model,
        cfg.model,
        image_size=_image_size_override(cfg),
        context_length=cfg.force_context_length,
        patch_dropout=cfg.force_patch_dropout,
        quick_gelu=cfg.force_quick_gelu,
        siglip=cfg.siglip,
        pretrained=cfg.pretrained,
    )
    # The engine picks where it is built: whole, or on meta for sharding engines to initialise shard by shard.
    return build_for_engine(cfg, world, factory)


def _image_size_override(cfg):
    size = cfg.force_image_size
    return size[0] if size is not None and len(size) == 1 else (tuple(size) if size else None)


def build_data(cfg, world: World, epoch: int):
    from bigclip.data import get_data
    from bigclip.data.transforms import image_transform
    from bigclip.model import get_tokenizer, preprocess_cfg

    pp = preprocess_cfg(cfg.model, _image_size_override(cfg))
    mean = tuple(cfg.image_mean) if cfg.image_mean else pp["mean"]
    std = tuple(cfg.image_std) if cfg.image_std else pp["std"]
    mean, std = (mean * 3 if len(mean) == 1 else mean), (std * 3 if len(std) == 1 else std)
    interpolation = cfg.image_interpolation or pp["interpolation"]
    resize_mode = cfg.image_resize_mode or pp["resize_mode"]
    tokenizer = get_tokenizer(cfg.model, context_length=cfg.force_context_length)
    preprocess_train = image_transform(pp["size"], True, mean, std, interpolation, resize_mode, cfg.aug_cfg)
    preprocess_val = image_transform(pp["size"], False, mean, std, interpolation, resize_mode, None)
    data = get_data(
        cfg,
        preprocess_train,
        preprocess_val,
        tokenizer,
        rank=world.rank,
        world_size=world.world_size,
        epoch=epoch,
        preprocess_cfg={"size": pp["size"], "mean": mean, "std": std},
    )
    return data, tokenizer


def build_loss_fn(cfg, world: World):
    from bigclip.loss import build_loss

    return build_loss(
        siglip=cfg.siglip,
        local_loss=cfg.local_loss,
        gather_with_grad=cfg.gather_with_grad,
        impl=cfg.loss_impl,
        dist_impl=cfg.loss_dist_impl,
        rank=world.rank,
        world_size=world.world_size,
    )


# ------------------------------------------------------------------------------------------ one step
def _loss(loss_fn, image_features, text_features, out: dict[str, torch.Tensor], keep_scale_grad: bool):
    scale = out["logit_scale"] if keep_scale_grad else out["logit_scale"].detach()
    bias = out.get("logit_bias")
    if bias is not None and not keep_scale_grad:
        bias = bias.detach()
    return loss_fn(image_features, text_features, scale, bias)


def forward_backward(
    engine, loss_fn, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], world: World
) -> tuple[float, dict[str, torch.Tensor]]:
    """Gradients for one optimizer step; returns (loss value, last forward outputs).

    With several micro-batches this is OpenCLIP's --accum-freq: features of every micro-batch are first
    computed without gradients, then each micro-batch is recomputed with gradients while the cached
    features of the others serve as negatives. Summed over micro-batches this is the gradient of the
    contrastive loss over the whole accumulated batch. The logit scale (and bias) keep their gradient
    in the last micro-batch only, so their gradient is counted once rather than accum-freq times.
    Gradients are synchronised only in the last micro-batch's backward.
    """
    if len(micro_batches) == 1:
        images, texts = micro_batches[0]
        with engine.autocast():
            out = engine.module(images=images, texts=texts)
            loss = _loss(loss_fn, out["image_features"], out["text_features"], out, True)
        _stop_if_nonfinite(loss, world)
        engine.backward(loss)
        return loss.item(), out

    cached_images, cached_texts = [], []
    with torch.no_grad(), engine.autocast():
        for images, texts in micro_batches:
            out = engine.module(images=images, texts=texts)
            cached_images.append(out["image_features"])
            cached_texts.append(out["text_features"])

    for j, (images, texts) in enumerate(micro_batches):
        last = j == len(micro_batches) - 1
        with contextlib.nullcontext() if last else engine.no_sync():
            with engine.autocast():
                out = engine.module(images=images, texts=texts)
                image_features = torch.cat(cached_images[:j] + [out["image_features"]] + cached_images[j + 1 :])
                text_features = torch.cat(cached_texts[:j] + [out["text_features"]] + cached_texts[j + 1 :])
                loss = _loss(loss_fn, image_features, text_features, out, keep_scale_grad=last)
            if j == 0:
                _stop_if_nonfinite(loss, world)
            engine.backward(loss)
    return loss.item(), out


class NonFiniteLoss(Exception):
    pass


def _stop_if_nonfinite(loss: torch.Tensor, world: World) -> None:
    # All ranks must agree, or one rank would skip a backward the others wait on.
    finite = all_reduce_min(1.0 if bool(torch.isfinite(loss.detach()).all()) else 0.0, world)
    if finite < 1.0:
        raise NonFiniteLoss


# ----------------------------------------------------------------------------------------- one epoch
def train_one_epoch(
    cfg,
    engine,
    loss_fn,
    data: dict,
    epoch: int,
    state: dict[str, Any],
    schedule,
    sinks: MetricSinks,
    world: World,
    skip_batches: int = 0,
    on_step=None,
    before_update=None,
) -> None:
    """One epoch. on_step(state, epoch, last_in_epoch), if given, runs after every optimizer step (the
    checkpoint cadence; it may raise Preempted); before_update(), right before every optimizer step (an
    asynchronous checkpoint finishes copying the state it is about to change)."""
    info = data["train"]
    info.set_epoch(epoch, skip_batches=skip_batches)
    engine.train()
    steps_per_epoch = info.num_batches // cfg.accum_freq
    samples_per_step = cfg.batch_size * cfg.accum_freq * world.world_size
    samples_per_epoch = info.num_samples
    batch_time, data_time, loss_meter = AverageMeter(), AverageMeter(), AverageMeter()
    progress = _progress_bar(steps_per_epoch, epoch, world, cfg)

    micro: list[tuple[torch.Tensor, torch.Tensor]] = []
    step_in_epoch = skip_batches // cfg.accum_freq
    end = time.perf_counter()
    for images, texts in info.dataloader:
        images = images.to(world.device, dtype=engine.precision.param_dtype, non_blocking=True)
        micro.append((images, texts.to(world.device, non_blocking=True)))
        if len(micro) < cfg.accum_freq:
            continue
        if step_in_epoch >= steps_per_epoch:
            break
        data_time.update(time.perf_counter() - end)
        step = state["step"]
        engine.set_lr(schedule(step))
        try:
            loss_value, out = forward_backward(engine, loss_fn, micro, world)
            if before_update is not None:
                before_update()
            grad_norm = engine.step()
            state["nonfinite_streak"] = 0
        except NonFiniteLoss:
            engine.zero_grad()
            state["nonfinite_streak"] += 1
            state["nonfinite_steps"] += 1
            logger.warning(f"step {step}: non-finite loss; step skipped, weights unchanged")
            sinks.write({"step": step, "epoch": epoch, "nonfinite_loss": 1})
            if state["nonfinite_streak"] >= MAX_CONSECUTIVE_NONFINITE:
                raise UserError(
                    f"the loss was non-finite for {MAX_CONSECUTIVE_NONFINITE} steps in a row "
                    f"(last at step {step}); lower --lr, add --grad-clip-norm or use "
                    f"--precision amp_bf16/fp32"
                ) from None
            loss_value, grad_norm = float("nan"), float("nan")
        micro = []
        state["step"] += 1
        state["samples_seen"] += samples_per_step
        step_in_epoch += 1
        state["batches_in_epoch"] = step_in_epoch * cfg.accum_freq
        batch_time.update(time.perf_counter() - end)
        end = time.perf_counter()
        if math.isfinite(loss_value):
            loss_meter.update(loss_value, cfg.batch_size)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{engine.get_lr():.2e}")

        due = step_in_epoch % cfg.log_every_n_steps == 0 or step_in_epoch == steps_per_epoch
        if due and math.isfinite(loss_value):  # a skipped step already wrote its own record
            samples_per_s = samples_per_step / max(batch_time.avg, 1e-9)
            logit_scale = float(engine.model.logit_scale.detach().float().exp().mean())
            seen_in_epoch = min(step_in_epoch * samples_per_step, samples_per_epoch)
            line = train_line(
                epoch,
                seen_in_epoch,
                samples_per_epoch,
                data_time.avg,
                batch_time.avg,
                samples_per_s,
                samples_per_s / world.world_size,
                engine.get_lr(),
                logit_scale,
                loss_value,
                loss_meter.avg,
            )
            (progress.write(line) if progress is not None else logger.info(line))
            sinks.write(
                {
                    "step": state["step"],
                    "epoch": epoch,
                    "samples_seen": state["samples_seen"],
                    "loss": loss_value,
                    "lr": engine.get_lr(),
                    "logit_scale": logit_scale,
                    "grad_norm": grad_norm,
                    "samples_per_s": samples_per_s,
                    "samples_per_s_per_gpu": samples_per_s / world.world_size,
                    "batch_time": batch_time.avg,
                    "data_time": data_time.avg,
                    "peak_memory_bytes": peak_memory_bytes(world.device),
                }
            )
            batch_time.reset()
            data_time.reset()
        if on_step is not None:
            on_step(state, epoch, step_in_epoch == steps_per_epoch)
    if progress is not None:
        progress.close()
    state["batches_in_epoch"] = 0
    _report_skipped(info, state, epoch, sinks, world)


def _report_skipped(info, state: dict, epoch: int, sinks: MetricSinks, world: World) -> None:
    """Bad samples are skipped, never fatal and never silent: totals over all ranks, once per epoch."""
    counts = info.skipped()
    totals = all_reduce_sum(torch.tensor([counts[k] for k in sorted(counts)], dtype=torch.float64), world)
    skipped = {k: int(v) for k, v in zip(sorted(counts), totals.tolist()) if v}
    if skipped:
        detail = ", ".join(f"{k}: {v}" for k, v in skipped.items())
        logger.warning(f"data: {sum(skipped.values())} bad sample(s) skipped so far ({detail})")
        sinks.write({"step": state["step"], "epoch": epoch, **{f"data/skipped_{k}": v for k, v in skipped.items()}})


def _progress_bar(total: int, epoch: int, world: World, cfg):
    if not (world.is_main and sys.stdout.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True)


# -------------------------------------------------------------------------------------------- a run
def _report_eval(metrics: dict[str, float], state: dict, epoch: int, sinks: MetricSinks) -> None:
    if not metrics:
        return
    shown = "\t".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items())
    logger.info(f"Eval Epoch: {epoch} {shown}")
    sinks.write({"step": state["step"], "epoch": epoch, **{f"eval/{k}": v for k, v in metrics.items()}})


def _resolve_run_name(cfg, world: World) -> str:
    if cfg.name:
        return cfg.name
    if cfg.resume == "latest":
        raise UserError("--resume latest needs --name: the name of the run to continue")
    date = datetime.now().strftime("%Y_%m_%d-%H_%M_%S")
    return broadcast_object(default_run_name(cfg, date), world)


def run(cfg, local_rank: int | None = None) -> int:
    world = init_distributed(
        cfg.device, cfg.dist_backend, cfg.dist_url, local_rank, pin_to_local_rank=not cfg.no_set_device_rank
    )
    try:
        return _run(cfg, world)
    finally:
        shutdown()


def _run(cfg, world: World) -> int:
    name = _resolve_run_name(cfg, world)
    paths = run_paths(local_logs_dir(cfg), name)  # --logs s3://… writes locally and uploads (--remote-sync)
    resuming = cfg.resume is not None
    problem = None
    if world.is_main:
        try:
            check_new_run(paths, resuming)
        except UserError as e:
            problem = str(e)
    problem = broadcast_object(problem, world)  # every rank stops, or none does
    if problem:
        raise UserError(problem)
    preflight(cfg, name, world)  # a remote store that cannot be written stops the run before any work
    active = world.is_main or (cfg.log_local and world.local_rank == 0)
    if world.is_main:
        os.makedirs(paths.checkpoints, exist_ok=True)
    setup_console_logging(paths.out_log if world.is_main else None, active, cfg.debug)
    config_dict = config_mod.to_dict(cfg)
    config_dict["name"] = name
    _announce_config(cfg, config_dict, paths, world)

    seed_everything(cfg.seed)  # same initial weights on every rank
    model = build_model(cfg, world)
    engine = build_engine(cfg, model, world)
    loss_fn = build_loss_fn(cfg, world)
    data, tokenizer = build_data(cfg, world, epoch=0)
    seed_everything(cfg.seed + world.rank)  # different augmentation / dropout per rank

    state: dict[str, Any] = {
        "step": 0,
        "epoch": 0,
        "samples_seen": 0,
        "batches_in_epoch": 0,
        "nonfinite_streak": 0,
        "nonfinite_steps": 0,
    }
    ckpt = CheckpointSession(cfg, paths, name, engine, world, config_dict)
    try:
        ckpt.resume(state)
        return _train(cfg, world, engine, loss_fn, data, tokenizer, state, ckpt, paths, active, config_dict)
    finally:
        ckpt.close()
        for info in data.values():
            if isinstance(info, DataInfo):
                info.close()  # loader workers ignore SIGTERM: stop them here, not at interpreter exit


def _train(cfg, world, engine, loss_fn, data, tokenizer, state, ckpt, paths, active, config_dict) -> int:
    sinks = MetricSinks(cfg, paths, active, config_dict)
    last_metrics: dict[str, float] = {}
    try:
        if "train" not in data:
            raise UserError("no training data: pass --train-data, or --dataset-type synthetic")
        steps_per_epoch = data["train"].num_batches // cfg.accum_freq
        if steps_per_epoch == 0:
            raise UserError(
                f"--batch-size {cfg.batch_size}: larger than one epoch of data per process "
                f"({data['train'].num_samples} samples over {world.world_size} processes "
                f"x --accum-freq {cfg.accum_freq}); lower it"
            )
        from bigclip.schedule import build_schedule

        schedule = build_schedule(cfg, steps_per_epoch)
        logger.info(
            f"training {cfg.epochs} epochs x {steps_per_epoch} steps on {world.world_size} "
            f"process(es), engine {engine.name}, device {world.device}, precision {cfg.precision}"
        )
        preempted = None
        try:
            for epoch in range(state["epoch"], cfg.epochs):
                train_one_epoch(
                    cfg,
                    engine,
                    loss_fn,
                    data,
                    epoch,
                    state,
                    schedule,
                    sinks,
                    world,
                    skip_batches=state.pop("batches_in_epoch", 0) if epoch == state["epoch"] else 0,
                    on_step=ckpt.after_step,
                    before_update=ckpt.before_update,
                )
                state["epoch"] = completed = epoch + 1
                metrics = evaluate(engine, data, tokenizer, cfg, completed, world)
                _report_eval(metrics, state, completed, sinks)
                last_metrics.update(metrics)
                ckpt.after_epoch(state, completed)
        except Preempted as stop:  # SIGTERM: the final checkpoint is on its way; wait for it below
            preempted = stop
        ckpt.finish(preempted)
        if state["nonfinite_steps"]:
            logger.warning(f"{state['nonfinite_steps']} step(s) were skipped for a non-finite loss")
        _summarise(cfg, paths, data, last_metrics)
    finally:
        sinks.close()
    return 0


def _announce_config(cfg, config_dict: dict, paths, world: World) -> None:
    import yaml

    if not world.is_main:
        return
    logger.info("bigclip config:\n" + "\n".join(f"  {k}: {v!r}" for k, v in sorted(config_dict.items())))
    with open(paths.params, "w") as f:
        yaml.safe_dump(config_dict, f, sort_keys=True)
    if cfg.copy_codebase:
        import shutil

        package = os.path.dirname(os.path.abspath(__file__))
        shutil.copytree(
            package,
            os.path.join(paths.root, "code", "bigclip"),
            ignore=shutil.ignore_patterns("__pycache__"),
            dirs_exist_ok=True,
        )


def _summarise(cfg, paths, data: dict, metrics: dict[str, float]) -> None:
    if "zeroshot_top1" in metrics:
        logger.info(
            f"zero-shot top-1 accuracy on {metrics['zeroshot_samples']} held-out images: "
            f"{metrics['zeroshot_top1']:.3f} (chance {metrics['zeroshot_chance']:.3f})"
        )
    logger.info(f"logs:        {os.path.abspath(paths.out_log)}")
    logger.info(f"metrics:     {os.path.abspath(paths.metrics)}")
    logger.info(f"checkpoints: {os.path.abspath(paths.checkpoints)}")
    logger.info(f"config:      {os.path.abspath(paths.params)}")
