"""CheckpointConfig: the slice of the flags checkpoints read (where, how often, how long to wait), and their
rules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bigclip.ckpt.storage import is_url
from bigclip.errors import UserError
from bigclip.storage_options import parse_storage_options

# Where a save's files are written and uploaded from: auto (a thread), thread, process (DCP's daemon), off.
ASYNC_MODES = ("auto", "thread", "process", "off")
REMOTE_SYNC_PROTOCOLS = ("s3", "fsspec")


@dataclass(frozen=True)
class CheckpointConfig:
    save_frequency: int = 1
    save_every_n_steps: int = 0
    save_every_minutes: float = 0.0
    save_most_recent: bool = False
    delete_previous_checkpoint: bool = False
    keep_last_k: int = 0
    resume: str | None = None
    remote_sync: str | None = None
    remote_sync_frequency: int = 300
    remote_sync_protocol: str = "s3"
    storage_options: str | dict[str, Any] | None = None
    storage_timeout: float = 60.0
    checkpoint_upload_timeout: float = 600.0
    checkpoint_async: str = "auto"
    logs: str = "./logs/"
    epochs: int = 32  # the last epoch always saves

    def options(self) -> dict[str, Any]:
        """fsspec options for checkpoint and log URLs (--storage-options)."""
        return parse_storage_options(self.storage_options)


def check_checkpoint(cfg: CheckpointConfig) -> None:
    """The checkpoint flags' rules, before any work."""
    for flag, value, allowed in (
        ("--checkpoint-async", cfg.checkpoint_async, ASYNC_MODES),
        ("--remote-sync-protocol", cfg.remote_sync_protocol, REMOTE_SYNC_PROTOCOLS),
    ):
        if value not in allowed:
            raise UserError(f"{flag} {value!r}: choose one of {', '.join(allowed)}")
    if not isinstance(cfg.save_every_minutes, (int, float)) or not (cfg.save_every_minutes >= 0):
        raise UserError(f"--save-every-minutes {cfg.save_every_minutes!r}: must be a non-negative number of minutes")
    cfg.options()
    if cfg.remote_sync and cfg.remote_sync_protocol == "s3" and not cfg.remote_sync.startswith("s3://"):
        raise UserError(
            f"--remote-sync {cfg.remote_sync}: --remote-sync-protocol s3 (the default) needs an "
            f"s3:// URL; add --remote-sync-protocol fsspec for other stores and directories"
        )
    for flag, value in (("--remote-sync", cfg.remote_sync), ("--logs", cfg.logs)):
        if value and str(value).startswith(("http://", "https://")):
            raise UserError(f"{flag} {value!r}: http(s) is read-only; use s3://, gs://, az:// or a directory")
    if cfg.resume and cfg.resume != "latest" and not is_url(cfg.resume) and not os.path.exists(cfg.resume):
        raise UserError(f"--resume {cfg.resume!r}: not found; pass a checkpoint directory or 'latest'")
