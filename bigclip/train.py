"""A training run: set up the world, run folder, model, engine, loss, data and checkpointer (built by
build.py from the config's typed slices), then train epoch by epoch (loop.py), evaluating and checkpointing
after each, until --epochs or a SIGTERM.

    launch/train.py -> cli.main -> train.run -> _run (setup) -> _train (epochs) -> loop.train_one_epoch
"""

from __future__ import annotations

import os
import shutil
import sys
from datetime import datetime
from functools import partial

import yaml
from torch.distributed.checkpoint.stateful import Stateful

from bigclip import dry_run
from bigclip.build import (
    build_data,
    build_engine,
    build_loss_fn,
    build_model,
    build_teacher,
    run_sections,
    seed_everything,
)
from bigclip.ckpt.checkpointer import Checkpointer
from bigclip.ckpt.participants import Recorded
from bigclip.ckpt.rng import RankRNG
from bigclip.config import Sections, TrainConfig, scrub_argv, to_dict
from bigclip.data import DataInfo
from bigclip.dist import World, broadcast_object, describe_world, join_world, raise_together, shutdown
from bigclip.errors import UserError
from bigclip.evaluation import evaluate
from bigclip.loop import LoopConfig, train_one_epoch
from bigclip.metrics.progress import EpochProgress
from bigclip.metrics.sinks import MetricSinks
from bigclip.model.convert import bigclip_to_openclip
from bigclip.optim import hyperparameters
from bigclip.precision import resolve_precision, slow_precision_warning
from bigclip.preemption import NOTICE
from bigclip.report import RunReports
from bigclip.run.code_version import code_version
from bigclip.run.console import logger, setup_console_logging
from bigclip.run.folder import check_new_run, default_run_name, local_logs_dir, preflight, run_paths
from bigclip.schedule import build_schedule
from bigclip.train_state import TrainState


# -------------------------------------------------------------------------------------------- a run
def _create_run_folder(logs: str, paths) -> None:
    try:
        os.makedirs(paths.checkpoints, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"--logs {logs}: cannot create the run folder {paths.root} ({e.strerror}); pass --logs "
            f"a directory you can write"
        ) from None


def _report_eval(metrics: dict[str, float], state: TrainState, sinks: MetricSinks) -> None:
    if not metrics:
        return
    shown = "\t".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items())
    logger.info(f"Eval Epoch: {state.epoch} {shown}")
    sinks.write({"step": state.step, "epoch": state.epoch, **{f"eval/{k}": v for k, v in metrics.items()}})


def _resolve_run_name(cfg: TrainConfig, world: World) -> str:
    if cfg.name:
        return cfg.name
    if cfg.resume == "latest":
        raise UserError("--resume latest needs --name: the name of the run to continue")
    date = datetime.now().strftime("%Y_%m_%d-%H_%M_%S")
    lr = hyperparameters(cfg.sections.optimizer)["lr"]
    return broadcast_object(default_run_name(date, cfg.model, lr, cfg.batch_size, cfg.workers, cfg.precision), world)


def run(cfg: TrainConfig, local_rank: int | None = None) -> int:
    world = join_world(cfg.sections.dist, local_rank)
    try:
        sections = run_sections(cfg.sections, world)  # an hf-hub: model's config fetched and checked, before any work
        if cfg.dry_run:
            for line in sections.idle_notes if world.is_main else ():  # as the run would say them at its start
                logger.warning(line)
            lines = dry_run.report(sections.model, sections.engine, world, sections.loss)
            if world.is_main:
                print("\n".join(lines), flush=True)
            return 0
        return _run(cfg, sections, world)
    finally:
        shutdown()


def _run(cfg: TrainConfig, run: Sections, world: World) -> int:
    """The run's setup, in order (docs/architecture.md): run folder and logs, model, engine, loss, data,
    checkpointer (resuming if asked), then the epochs."""
    name = _resolve_run_name(cfg, world)
    logs = local_logs_dir(run.checkpoint.logs)  # --logs s3://… writes locally and uploads (--remote-sync)
    paths = run_paths(logs, name)
    raise_together(world, lambda: check_new_run(paths, resuming=cfg.resume is not None))
    preflight(run.checkpoint, name, world)  # a remote store that cannot be written stops the run before any work
    active = world.is_main or (cfg.log_local and world.local_rank == 0)
    raise_together(world, lambda: _create_run_folder(logs, paths))
    setup_console_logging(paths.out_log if world.is_main else None, active, cfg.debug)
    config_dict = to_dict(cfg)
    config_dict["name"] = name
    _announce_config(config_dict, paths, world, copy_codebase=cfg.copy_codebase)
    for line in describe_world(world):  # collective: every rank reports its host and device
        logger.info(line)
    if world.is_main and (slow := slow_precision_warning(resolve_precision(cfg.precision, world.device), world.device)):
        logger.warning(slow)
    for line in run.idle_notes if world.is_main else ():  # OpenCLIP's flags set where they do nothing (idle)
        logger.warning(line)

    seed_everything(cfg.seed)  # same initial weights on every rank
    model = build_model(run.model, run.engine, world)
    engine = build_engine(run.engine, model, world)
    teacher = build_teacher(run.model, run.engine, world, engine)
    loss_fn = build_loss_fn(run.loss, world)
    data, tokenizer = build_data(run.model, run.data, world, epoch=0)
    seed_everything(cfg.seed + world.rank)  # different augmentation / dropout per rank

    state = TrainState()
    checkpointer = Checkpointer(
        run.checkpoint,
        paths,
        name,
        engine,
        world,
        _participants(state, config_dict, data, engine),
        consolidated_names=partial(bigclip_to_openclip, separate_text=model.openclip_separate_text),
    )
    sinks = MetricSinks(run.report, paths, active, config_dict, scrub_argv(sys.argv[1:]))
    reports = RunReports(paths.root, world.is_main, run.report.no_run_report)
    try:
        checkpointer.resume(state)
        NOTICE.arm()  # from here a preemption notice saves a final checkpoint at the next step
        metrics = _train(run, world, engine, loss_fn, data, tokenizer, state, checkpointer, sinks, teacher, reports)
        # the last commit, and the report drawn into the run folder before --remote-sync's last copy of it
        checkpointer.finish(before_last_copy=partial(reports.write, final=True))
        if state.nonfinite_steps:
            logger.warning(f"{state.nonfinite_steps} step(s) were skipped for a non-finite loss")
        _summarise(paths, metrics, reports.page)
        return 0
    finally:
        sinks.close()
        checkpointer.close()
        for info in data.values():
            if isinstance(info, DataInfo):
                info.close()  # loader workers ignore SIGTERM: stop them here, not at interpreter exit


def _participants(state: TrainState, config_dict: dict, data: dict, engine) -> dict[str, Stateful]:
    """What every checkpoint saves and a resume restores besides the engine's model and optimizer, by name; each
    says where it is kept (ckpt/participants.py). The order is the order of capture: the data position before
    the RNG (as the loop left them)."""
    participants = {
        "train_state": state,  # record: train_state.json
        "config": Recorded(config_dict),  # record, for the record only
        "data": data.get("train"),  # per rank: the training loader's position (None: no training data)
        "rng": RankRNG(),  # per rank
        "ema": engine.ema,  # sharded, in the engine's layout (--ema-decay; else None)
    }
    return {name: p for name, p in participants.items() if p is not None}


def _train(
    run: Sections, world, engine, loss_fn, data, tokenizer, state, checkpointer, sinks, teacher=None, reports=None
) -> dict[str, float]:
    """Epochs from state.epoch to --epochs: train, evaluate, checkpoint, redraw the run's report. Returns the last
    evaluation's metrics. Ends early, after a final checkpoint, when SIGTERM asks the run to stop. `teacher`:
    --distill-model's."""
    loop = run.loop
    train_data = _training_data(loop, data, world)
    steps_per_epoch = train_data.num_batches // loop.accum_freq
    schedule = build_schedule(run.schedule, steps_per_epoch)
    logger.info(
        f"training {loop.epochs} epochs x {steps_per_epoch} steps on {world.world_size} "
        f"process(es), engine {engine.name}, device {world.device}, precision {loop.precision}"
    )
    metrics: dict[str, float] = {}
    while state.epoch < loop.epochs:
        samples = train_data.num_samples
        progress = EpochProgress(
            loop.log_every_n_steps,
            loop.batch_size,
            loop.samples_per_step(world.world_size),
            engine,
            sinks,
            world,
            steps_per_epoch,
            samples,
            state,
            train_data,
            checkpointer.metrics,
            metric_every=loop.log_metric_every_n_steps,
            loss_ema_samples=loop.train_loss_ema_samples,
        )
        stop = train_one_epoch(
            loop, engine, loss_fn, train_data, state, schedule, checkpointer, progress, world, teacher
        )
        progress.close(state)
        if stop:
            break
        state.finish_epoch()
        # A save the epoch's last step started may still be copying the state: --eval-ema writes the average into
        # the weights (and the live weights into the average's tensors) while it evaluates
        checkpointer.wait_for_staging()
        new = evaluate(engine, data, tokenizer, run.eval, state.epoch, world)
        _report_eval(new, state, sinks)
        metrics.update(new)
        checkpointer.after_epoch(state)
        if reports is not None and state.epoch < loop.epochs:  # the last epoch's is drawn at the end
            reports.write()
    return metrics


def _training_data(cfg: LoopConfig, data: dict, world: World):
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


def _announce_config(config_dict: dict, paths, world: World, copy_codebase: bool) -> None:
    if not world.is_main:
        return
    logger.info("bigclip config:\n" + "\n".join(f"  {k}: {v!r}" for k, v in sorted(config_dict.items())))
    with open(paths.params, "w") as f:
        yaml.safe_dump({**config_dict, **code_version()}, f, sort_keys=True)  # and which code ran
    if copy_codebase:
        package = os.path.dirname(os.path.abspath(__file__))
        shutil.copytree(
            package,
            os.path.join(paths.root, "code", "bigclip"),
            ignore=shutil.ignore_patterns("__pycache__"),
            dirs_exist_ok=True,
        )


def _summarise(paths, metrics: dict[str, float], report: str | None = None) -> None:
    if "zeroshot_top1" in metrics:
        logger.info(
            f"zero-shot top-1 accuracy on {metrics['zeroshot_samples']} held-out images: "
            f"{metrics['zeroshot_top1']:.3f} (chance {metrics['zeroshot_chance']:.3f})"
        )
    logger.info(f"logs:        {os.path.abspath(paths.out_log)}")
    logger.info(f"metrics:     {os.path.abspath(paths.metrics)}")
    logger.info(f"checkpoints: {os.path.abspath(paths.checkpoints)}")
    logger.info(f"config:      {os.path.abspath(paths.params)}")
    if report is not None:
        logger.info(f"report:      {os.path.abspath(report)}")
