"""The run folder: <logs>/<name>/ with its checkpoints, metrics.jsonl, params.yaml, out.log and tensorboard
events; the name OpenCLIP would give a run; and, before any model is built, the checks that a new run takes no
other run's folder, here and in the remote store it will copy to (--remote-sync, or a URL --logs)."""

from __future__ import annotations

import getpass
import os
import tempfile
from dataclasses import dataclass

from bigclip.ckpt.checkpointer import remote_run_root
from bigclip.ckpt.config import CheckpointConfig
from bigclip.ckpt.storage import Storage, StorageUnavailable, is_url, unreachable
from bigclip.dist import raise_together
from bigclip.errors import UserError


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


def local_logs_dir(logs: str) -> str:
    """Where the run writes locally. --logs may be a URL (s3://bucket/runs): then the run writes to a local
    staging folder (BIGCLIP_LOCAL_LOGS, default <tmp>/bigclip-logs-<user>) and everything goes to the URL,
    exactly as --remote-sync does."""
    if not is_url(logs):
        return logs
    return os.environ.get("BIGCLIP_LOCAL_LOGS") or os.path.join(
        tempfile.gettempdir(), f"bigclip-logs-{getpass.getuser()}"
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


def preflight(cfg: CheckpointConfig, name: str, world) -> None:
    """Before any model is built: can the remote store be written? Bad credentials, a missing bucket or an
    unreachable endpoint stop every rank here with one line. Collective."""
    root = remote_run_root(cfg, name)
    if not root:
        return

    def check() -> None:
        store = Storage(root, cfg.options(), cfg.storage_timeout, bounded=True)
        store.check_writable()
        try:
            taken = cfg.resume is None and store.exists("params.yaml")
        except StorageUnavailable as e:
            raise unreachable(e) from None
        if taken:
            raise UserError(
                f"--name {name}: {store.display} already holds a run; pass a new --name, or "
                f"--resume latest to continue that run"
            )

    raise_together(world, check)
