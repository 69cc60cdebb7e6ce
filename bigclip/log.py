"""Where a run writes (logs/<name>/...), and every sink its metrics go to.

Rank 0 (or the first rank of every node with --log-local) prints OpenCLIP-style lines; every logged
step is also one JSON object in metrics.jsonl, and goes to tensorboard / wandb when asked for.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bigclip.errors import UserError
from bigclip.flag_fields import LOG, flag
from bigclip.registry import Registry
from bigclip.storage_options import redact_urls_in

logger = logging.getLogger("bigclip")


@dataclass
class RunPaths:
    root: str  # logs/<name>
    checkpoints: str  # logs/<name>/checkpoints
    metrics: str  # logs/<name>/metrics.jsonl
    params: str  # logs/<name>/params.yaml
    out_log: str  # logs/<name>/out.log
    tensorboard: str  # logs/<name>/tensorboard


def default_run_name(date: str, model: str, lr: float, batch_size: int, workers: int, precision: str) -> str:
    """OpenCLIP's automatic name: date, model, lr, batch size, workers and precision."""
    return "-".join(
        [date, f"model_{model.replace('/', '-')}", f"lr_{lr}", f"b_{batch_size}", f"j_{workers}", f"p_{precision}"]
    )


def run_paths(logs: str, name: str) -> RunPaths:
    root = os.path.join(logs, name)
    return RunPaths(
        root,
        os.path.join(root, "checkpoints"),
        os.path.join(root, "metrics.jsonl"),
        os.path.join(root, "params.yaml"),
        os.path.join(root, "out.log"),
        os.path.join(root, "tensorboard"),
    )


def check_new_run(paths: RunPaths, resuming: bool) -> None:
    # Never write into another run's directory by accident: its checkpoints and metrics would mix.
    if os.path.exists(paths.root) and not resuming:
        raise UserError(
            f"--name: run directory {paths.root} already exists; pass a new --name, "
            f"or --resume latest to continue that run"
        )


class RedactUrls(logging.Filter):
    """Every line bigclip logs (its modules', the data loader workers') leaves URLs without credentials or
    query-string signatures: data URLs reach messages from many places (shard errors, skipped samples)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_urls_in(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def setup_console_logging(out_log: str | None, active: bool, debug: bool) -> None:
    level = logging.DEBUG if debug else logging.INFO
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(level if active else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s | %(message)s", datefmt="%Y-%m-%d,%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.addFilter(RedactUrls())
    logger.addHandler(console)
    if out_log and active:
        os.makedirs(os.path.dirname(out_log), exist_ok=True)
        file_handler = logging.FileHandler(out_log)
        file_handler.setFormatter(fmt)
        file_handler.addFilter(RedactUrls())
        logger.addHandler(file_handler)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class AverageMeter:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.val = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / max(1, self.count)


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


# --report-to NAME -> (config, run paths, the run's config as a dict, argv as trackers may record it) -> tracker.
# Each tracker is imported only when asked for: each takes seconds to import.
REPORT_TARGETS: Registry[Callable[[ReportConfig, RunPaths, dict, list[str] | None], Tracker]] = Registry(
    "--report-to", unknown=lambda names: f"use {', '.join(names)} or {','.join(names)}"
)


@dataclass(frozen=True)
class ReportConfig:
    """Where metrics go besides metrics.jsonl (--report-to) and what the trackers are told."""

    report_to: str = flag(
        "", "Trackers besides metrics.jsonl, comma-separated (tensorboard,wandb).", LOG, shows=REPORT_TARGETS
    )
    wandb_project_name: str = flag("open-clip", "wandb project.", LOG)
    wandb_notes: str = flag("", "wandb notes.", LOG)
    no_run_report: bool = flag(
        False,
        "Do not draw logs/<name>/report.html and .png (the run's plots, see `bigclip report`) at each epoch's end "
        "and at the end.",
        LOG,
    )


def _scalar_name(key: str) -> str:
    return key if "/" in key else f"train/{key}"


class _TensorBoard:
    def __init__(self, cfg: ReportConfig, paths: RunPaths, config_dict: dict, argv: list[str] | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(paths.tensorboard)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(_scalar_name(k), v, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, cfg: ReportConfig, paths: RunPaths, config_dict: dict, argv: list[str] | None):
        import wandb

        real_argv = sys.argv
        sys.argv = [real_argv[0], *argv] if argv is not None else real_argv
        try:  # wandb records sys.argv in its run files: it must see the scrubbed one
            self.run = wandb.init(
                project=cfg.wandb_project_name,
                name=os.path.basename(paths.root),
                notes=cfg.wandb_notes,
                dir=paths.root,
                config=config_dict,
            )
        finally:
            sys.argv = real_argv

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({_scalar_name(k): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


REPORT_TARGETS.register("tensorboard", _TensorBoard, help="event files in <run>/tensorboard")
REPORT_TARGETS.register("wandb", _Wandb, help="a Weights & Biases run")


def report_targets(value: str) -> list[str]:
    """The tracker names of a --report-to value (comma-separated); an unknown one is a UserError."""
    names = [t for t in value.split(",") if t]
    for name in names:
        if name not in REPORT_TARGETS:
            raise UserError(f"--report-to {value!r}: {REPORT_TARGETS.advice()}")
    return names


class MetricSinks:
    """metrics.jsonl always; the trackers --report-to names (tensorboard, wandb). Only active ranks write."""

    def __init__(
        self,
        cfg: ReportConfig,
        paths: RunPaths,
        active: bool,
        config_dict: dict[str, Any],
        argv: list[str] | None = None,
    ):
        """`argv`: the command line as trackers may record it (secrets scrubbed); wandb stores sys.argv."""
        self.active = active
        self._jsonl = None
        self._trackers: list[Tracker] = []
        if not active:
            return
        self._jsonl = open(paths.metrics, "a", buffering=1)
        for name in report_targets(cfg.report_to):
            self._trackers.append(REPORT_TARGETS.get(name)(cfg, paths, config_dict, argv))

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        record = {"time": round(time.time(), 3), **record}
        self._jsonl.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        for tracker in self._trackers:
            tracker.log(scalars, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for tracker in self._trackers:
            tracker.close()


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
    digits = len(str(total))
    pct = 100.0 * seen / max(1, total)
    return (
        f"Train Epoch: {epoch} [{seen:>{digits}}/{total} ({pct:.0f}%)] "
        f"Data (t): {data_time:.3f} Batch (t): {batch_time:.3f}, {samples_per_s:#g}/s, {per_gpu:#g}/s/gpu "
        f"LR: {lr:.6f} Logit Scale: {logit_scale:.3f} Loss: {loss_val:#.5g} ({loss_avg:#.5g})"
    )
