"""A training run: set up the world, run folder, model, engine, loss, data and checkpointer, then train
epoch by epoch (loop.py), evaluating and checkpointing after each, until --epochs or a SIGTERM.

    launch/train.py -> cli.main -> train.run -> _run (setup) -> _train (epochs) -> loop.train_one_epoch
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from datetime import datetime

import numpy as np
import torch
import yaml

from bigclip import config as config_mod
from bigclip import dry_run
from bigclip.ckpt.checkpointer import Checkpointer, local_logs_dir, preflight
from bigclip.data import DataInfo, get_data, image_transform
from bigclip.dist import World, broadcast_object, describe_world, init_distributed, raise_together, shutdown
from bigclip.engine import build_engine
from bigclip.engine import build_model as build_for_engine
from bigclip.errors import UserError
from bigclip.eval import evaluate
from bigclip.log import MetricSinks, check_new_run, default_run_name, logger, run_paths, setup_console_logging
from bigclip.loop import train_one_epoch
from bigclip.loss import build_loss
from bigclip.model import create_model, get_tokenizer, preprocess_cfg
from bigclip.model.pretrained import model_weights, resolve_pretrained, resolve_pretrained_image, timm_model_name
from bigclip.model.registry import CONFIG_NAME, is_schema_name
from bigclip.preemption import NOTICE
from bigclip.progress import EpochProgress
from bigclip.schedule import build_schedule
from bigclip.train_state import TrainState


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- setup
def build_model(cfg, world: World):
    weights = pretrained_weights(cfg, world)
    image_weights = pretrained_image_weights(cfg, world, weights)

    def factory(**overrides):
        # On meta (sharded init) the weights are checked now and streamed into each rank's shards later.
        return create_model(
            cfg.model,
            image_size=_image_size_override(cfg),
            context_length=cfg.force_context_length,
            patch_dropout=cfg.force_patch_dropout,
            quick_gelu=cfg.force_quick_gelu,
            siglip=cfg.siglip,
            layer_scale_init=cfg.layer_scale_init,
            int8_linear=cfg.use_bnb_linear,
            pretrained=weights,
            pretrained_image=image_weights or False,
            load_weights=False,  # a local-dir:/hf-hub: model's own weights are resolved here, once per node
            cache_dir=cfg.cache_dir,
            **overrides,
        )

    # The engine picks where it is built: whole, or on meta for sharding engines to initialise shard by shard.
    return build_for_engine(cfg, world, factory)


def pretrained_weights(cfg, world: World) -> str | None:
    """The local file of the whole model's weights: what --pretrained names, else the weights a local-dir: or
    hf-hub: --model brings (OpenCLIP loads them by default; --pretrained wins). Hub files are fetched once per
    node (local rank 0, which also checks their hash) while the other ranks wait; then every rank reads them
    from the cache."""
    if cfg.pretrained:
        raise_together(
            world,
            lambda: resolve_pretrained(cfg.model, cfg.pretrained, cfg.cache_dir),
            runs_here=world.local_rank == 0,
        )
        return resolve_pretrained(cfg.model, cfg.pretrained, cfg.cache_dir, local_files_only=True, verify=False)
    if not is_schema_name(cfg.model):
        return None
    raise_together(world, lambda: model_weights(cfg.model, cfg.cache_dir), runs_here=world.local_rank == 0)
    path = model_weights(cfg.model, cfg.cache_dir, local_files_only=True, verify=False)
    if path is None:
        logger.warning(f"--model {cfg.model}: no weights beside its {CONFIG_NAME}; starting from a random init")
    else:
        logger.info(f"--model {cfg.model}: weights from {path}")
    return path


def pretrained_image_weights(cfg, world: World, clip_weights: str | None) -> str | None:
    """The local file of timm's pretrained trunk weights (--pretrained-image), fetched once per node like
    pretrained_weights; None when whole-model weights are loaded instead (as in OpenCLIP)."""
    if not cfg.pretrained_image:
        return None
    if clip_weights is not None:
        logger.info(f"--pretrained-image: timm's trunk weights are not loaded; {clip_weights} sets the whole model")
        return None
    timm_name = timm_model_name(cfg.model, cfg.cache_dir)
    raise_together(world, lambda: resolve_pretrained_image(timm_name, cfg.cache_dir), runs_here=world.local_rank == 0)
    path, repo = resolve_pretrained_image(timm_name, cfg.cache_dir, local_files_only=True, verify=False)
    logger.info(f"--pretrained-image: image tower trunk {timm_name} from timm's weights {repo} ({path})")
    return path


def _image_size_override(cfg):
    size = cfg.force_image_size
    return size[0] if size is not None and len(size) == 1 else (tuple(size) if size else None)


def build_transforms(cfg):
    """(train transform, eval transform, geometry {'size', 'mean', 'std'}) for the model and the image flags."""
    pp = preprocess_cfg(cfg.model, _image_size_override(cfg), cache_dir=cfg.cache_dir)
    mean = tuple(cfg.image_mean) if cfg.image_mean else pp["mean"]
    std = tuple(cfg.image_std) if cfg.image_std else pp["std"]
    mean, std = (mean * 3 if len(mean) == 1 else mean), (std * 3 if len(std) == 1 else std)
    interpolation = cfg.image_interpolation or pp["interpolation"]
    resize_mode = cfg.image_resize_mode or pp["resize_mode"]
    preprocess_train = image_transform(pp["size"], True, mean, std, interpolation, resize_mode, cfg.aug_cfg)
    preprocess_val = image_transform(pp["size"], False, mean, std, interpolation, resize_mode, None)
    return preprocess_train, preprocess_val, {"size": pp["size"], "mean": mean, "std": std}


def build_data(cfg, world: World, epoch: int):
    preprocess_train, preprocess_val, geometry = build_transforms(cfg)
    tokenizer = get_tokenizer(cfg.model, context_length=cfg.force_context_length, cache_dir=cfg.cache_dir)
    data = get_data(
        cfg,
        preprocess_train,
        preprocess_val,
        tokenizer,
        rank=world.rank,
        world_size=world.world_size,
        epoch=epoch,
        preprocess_cfg=geometry,
    )
    return data, tokenizer


def build_loss_fn(cfg, world: World):
    return build_loss(
        siglip=cfg.siglip,
        local_loss=cfg.local_loss,
        gather_with_grad=cfg.gather_with_grad,
        impl=cfg.loss_impl,
        dist_impl=cfg.loss_dist_impl,
        rank=world.rank,
        world_size=world.world_size,
    )


# -------------------------------------------------------------------------------------------- a run
def _create_run_folder(cfg, paths) -> None:
    try:
        os.makedirs(paths.checkpoints, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"--logs {local_logs_dir(cfg)}: cannot create the run folder {paths.root} ({e.strerror}); pass --logs "
            f"a directory you can write"
        ) from None


def _report_eval(metrics: dict[str, float], state: TrainState, sinks: MetricSinks) -> None:
    if not metrics:
        return
    shown = "\t".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items())
    logger.info(f"Eval Epoch: {state.epoch} {shown}")
    sinks.write({"step": state.step, "epoch": state.epoch, **{f"eval/{k}": v for k, v in metrics.items()}})


def _resolve_run_name(cfg, world: World) -> str:
    if cfg.name:
        return cfg.name
    if cfg.resume == "latest":
        raise UserError("--resume latest needs --name: the name of the run to continue")
    date = datetime.now().strftime("%Y_%m_%d-%H_%M_%S")
    return broadcast_object(default_run_name(cfg, date), world)


def run(cfg, local_rank: int | None = None) -> int:
    world = init_distributed(
        cfg.device,
        cfg.dist_backend,
        cfg.dist_url,
        local_rank,
        pin_to_local_rank=not cfg.no_set_device_rank,
        timeout_s=cfg.dist_timeout,
    )
    try:
        if cfg.dry_run:
            lines = dry_run.report(cfg, world)
            if world.is_main:
                print("\n".join(lines), flush=True)
            return 0
        return _run(cfg, world)
    finally:
        shutdown()


def _run(cfg, world: World) -> int:
    name = _resolve_run_name(cfg, world)
    paths = run_paths(local_logs_dir(cfg), name)  # --logs s3://… writes locally and uploads (--remote-sync)
    raise_together(world, lambda: check_new_run(paths, resuming=cfg.resume is not None))
    preflight(cfg, name, world)  # a remote store that cannot be written stops the run before any work
    active = world.is_main or (cfg.log_local and world.local_rank == 0)
    raise_together(world, lambda: _create_run_folder(cfg, paths))
    setup_console_logging(paths.out_log if world.is_main else None, active, cfg.debug)
    config_dict = config_mod.to_dict(cfg)
    config_dict["name"] = name
    _announce_config(cfg, config_dict, paths, world)
    for line in describe_world(world):  # collective: every rank reports its host and device
        logger.info(line)

    seed_everything(cfg.seed)  # same initial weights on every rank
    model = build_model(cfg, world)
    engine = build_engine(cfg, model, world)
    loss_fn = build_loss_fn(cfg, world)
    data, tokenizer = build_data(cfg, world, epoch=0)
    seed_everything(cfg.seed + world.rank)  # different augmentation / dropout per rank

    state = TrainState()
    checkpointer = Checkpointer(cfg, paths, name, engine, world, config_dict)
    sinks = MetricSinks(cfg, paths, active, config_dict, config_mod.scrub_argv(sys.argv[1:]))
    try:
        checkpointer.resume(state)
        if "train" in data:  # a resumable loader continues from this rank's saved position
            data["train"].restore(state.data)
            checkpointer.data_position = data["train"].position
        NOTICE.arm()  # from here a preemption notice saves a final checkpoint at the next step
        metrics = _train(cfg, world, engine, loss_fn, data, tokenizer, state, checkpointer, sinks)
        checkpointer.finish()
        if state.nonfinite_steps:
            logger.warning(f"{state.nonfinite_steps} step(s) were skipped for a non-finite loss")
        _summarise(paths, metrics)
        return 0
    finally:
        sinks.close()
        checkpointer.close()
        for info in data.values():
            if isinstance(info, DataInfo):
                info.close()  # loader workers ignore SIGTERM: stop them here, not at interpreter exit


def _train(cfg, world, engine, loss_fn, data, tokenizer, state, checkpointer, sinks) -> dict[str, float]:
    """Epochs from state.epoch to --epochs: train, evaluate, checkpoint. Returns the last evaluation's metrics.
    Ends early, after a final checkpoint, when SIGTERM asks the run to stop."""
    train_data = _training_data(cfg, data, world)
    steps_per_epoch = train_data.num_batches // cfg.accum_freq
    schedule = build_schedule(cfg, steps_per_epoch)
    logger.info(
        f"training {cfg.epochs} epochs x {steps_per_epoch} steps on {world.world_size} "
        f"process(es), engine {engine.name}, device {world.device}, precision {cfg.precision}"
    )
    metrics: dict[str, float] = {}
    while state.epoch < cfg.epochs:
        samples = train_data.num_samples
        progress = EpochProgress(
            cfg, engine, sinks, world, steps_per_epoch, samples, state, train_data, checkpointer.metrics
        )
        stop = train_one_epoch(cfg, engine, loss_fn, train_data, state, schedule, checkpointer, progress, world)
        progress.close(state)
        if stop:
            break
        state.finish_epoch()
        new = evaluate(engine, data, tokenizer, cfg, state.epoch, world)
        _report_eval(new, state, sinks)
        metrics.update(new)
        checkpointer.after_epoch(state)
    return metrics


def _training_data(cfg, data: dict, world: World):
    if "train" not in data:
        raise UserError("no training data: pass --train-data, or --dataset-type synthetic")
    train_data = data["train"]
    if train_data.num_batches // cfg.accum_freq == 0:
        raise UserError(
            f"--batch-size {cfg.batch_size}: larger than one epoch of data per process "
            f"({train_data.num_samples} samples over {world.world_size} processes "
            f"x --accum-freq {cfg.accum_freq}); lower it"
        )
    return train_data


def _announce_config(cfg, config_dict: dict, paths, world: World) -> None:
    if not world.is_main:
        return
    logger.info("bigclip config:\n" + "\n".join(f"  {k}: {v!r}" for k, v in sorted(config_dict.items())))
    with open(paths.params, "w") as f:
        yaml.safe_dump(config_dict, f, sort_keys=True)
    if cfg.copy_codebase:
        package = os.path.dirname(os.path.abspath(__file__))
        shutil.copytree(
            package,
            os.path.join(paths.root, "code", "bigclip"),
            ignore=shutil.ignore_patterns("__pycache__"),
            dirs_exist_ok=True,
        )


def _summarise(paths, metrics: dict[str, float]) -> None:
    if "zeroshot_top1" in metrics:
        logger.info(
            f"zero-shot top-1 accuracy on {metrics['zeroshot_samples']} held-out images: "
            f"{metrics['zeroshot_top1']:.3f} (chance {metrics['zeroshot_chance']:.3f})"
        )
    logger.info(f"logs:        {os.path.abspath(paths.out_log)}")
    logger.info(f"metrics:     {os.path.abspath(paths.metrics)}")
    logger.info(f"checkpoints: {os.path.abspath(paths.checkpoints)}")
    logger.info(f"config:      {os.path.abspath(paths.params)}")
