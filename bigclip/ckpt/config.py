"""CheckpointConfig: the slice of the flags checkpoints read (where, how often, how long to wait), and their
rules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bigclip.ckpt.storage import is_url
from bigclip.errors import UserError
from bigclip.flag_fields import CKPT, LOG, Applies, flag, non_negative_int, positive_seconds
from bigclip.storage_options import parse_storage_options

# Where a save's files are written and uploaded from: auto (a thread), thread, process (DCP's daemon), off.
ASYNC_MODES = ("auto", "thread", "process", "off")
# What auto means: the writer the GPU kit's `ckpt` part marks as the default (bench/gpu/part_ckpt.py measures both).
DEFAULT_WRITER = "thread"
REMOTE_SYNC_PROTOCOLS = ("s3", "fsspec")
# OpenCLIP main's --fsdp-checkpoint: bigclip's checkpoints are sharded under every engine; full adds the
# consolidated weights to each of them.
CHECKPOINT_KINDS = ("sharded", "full")


# Flags about a remote store act only where the run has one (flag_fields.Applies)
WITH_REMOTE_SYNC = Applies(lambda c: bool(c.remote_sync), "with --remote-sync")
WITH_REMOTE_RUN = Applies(lambda c: bool(c.remote_sync) or is_url(c.logs), "with --remote-sync (or a URL --logs)")
WITH_STORE = Applies(
    lambda c: bool(c.remote_sync) or any(is_url(v) for v in (c.logs, c.resume, c.train_data, c.val_data) if v),
    "with a remote store (--remote-sync, or a URL --logs, --resume, --train-data or --val-data)",
)


@dataclass(frozen=True)
class CheckpointConfig:
    save_frequency: int = flag(1, "Save a checkpoint every N epochs (0: never).", CKPT, check=non_negative_int)
    save_every_n_steps: int = flag(
        0, "Also save every N optimizer steps, mid-epoch (0: never; new in bigclip).", CKPT, check=non_negative_int
    )
    save_every_minutes: float = flag(0.0, "Also save every N minutes of training (0: never; new in bigclip).", CKPT)
    save_most_recent: bool = flag(False, "Also keep the newest state as epoch_latest.", CKPT)
    delete_previous_checkpoint: bool = flag(
        False, "Delete the previous local checkpoint after a save (remote copies are kept; see --keep-last-k).", CKPT
    )
    keep_last_k: int = flag(
        0,
        "Keep only the K newest numbered checkpoints in the remote store (locally when "
        "there is no --remote-sync); 0 keeps all (new in bigclip).",
        CKPT,
        check=non_negative_int,
    )
    fsdp_checkpoint: str = flag(
        "sharded",
        "OpenCLIP main's checkpoint kind, under every engine. sharded: each rank writes its own shards "
        "(resumable at any world size). full: each checkpoint also holds openclip_state_dict.pt, the "
        "consolidated weights in OpenCLIP's names ({'state_dict': ..., 'epoch', 'step'}; open_clip's "
        "--pretrained loads it), written by rank 0 from the shards before the commit (host memory: the whole "
        "model in float32; no optimizer state: resume from the checkpoint itself).",
        CKPT,
        choices=CHECKPOINT_KINDS,
    )
    resume: str | None = flag(
        None,
        "Checkpoint to resume from: a directory, a URL (s3://, gs://, az://, "
        "https://) of one, or 'latest' (local and --remote-sync).",
        CKPT,
    )
    remote_sync: str | None = flag(
        None,
        "Remote run root (s3://bucket/runs, gs://, az://, or a directory): "
        "checkpoints are uploaded as they are written and committed by a "
        "manifest; logs are copied every --remote-sync-frequency seconds.",
        CKPT,
    )
    remote_sync_frequency: int = flag(
        300,
        "Seconds between copies of logs and metrics (with --remote-sync).",
        CKPT,
        check=non_negative_int,
        applies=WITH_REMOTE_RUN,
    )
    remote_sync_protocol: str = flag(
        "s3",
        "s3 (needs an s3:// URL) or fsspec (any fsspec URL); both use the same parallel, retried uploads.",
        CKPT,
        choices=REMOTE_SYNC_PROTOCOLS,
        applies=WITH_REMOTE_SYNC,
    )
    storage_options: str | dict[str, Any] | None = flag(
        None,
        "JSON of fsspec options for remote paths, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\'; '
        "credentials may go here or in AWS_* variables (never logged).",
        CKPT,
        applies=WITH_STORE,
    )
    storage_timeout: float = flag(
        60.0,
        "Seconds a remote store may go unanswered or failing when bigclip first reaches it (the start-of-run "
        "write check, --resume, bigclip export) before every rank stops with one line; checkpoint uploads "
        "retry longer, see --checkpoint-upload-timeout (new in bigclip).",
        CKPT,
        check=positive_seconds,
        applies=WITH_STORE,
    )
    checkpoint_upload_timeout: float = flag(
        600.0,
        "Seconds one checkpoint upload step retries an unreachable or failing store before that checkpoint is "
        "given up (training goes on, the next save tries again); also the longest the final and the "
        "preemption checkpoint are waited for (new in bigclip).",
        CKPT,
        check=positive_seconds,
        applies=WITH_REMOTE_RUN,
    )
    checkpoint_async: str = flag(
        "auto",
        f"Where checkpoint files are written and uploaded: auto ({DEFAULT_WRITER}), thread, "
        "process (DCP's daemon process; DDP/FSDP only) or off (the loop waits; "
        "new in bigclip).",
        CKPT,
        choices=ASYNC_MODES,
    )
    logs: str = flag(
        "./logs/",
        "Where logs, metrics and checkpoints go: a directory, or a URL (s3://, gs://, "
        "az://) written through a local staging folder as with --remote-sync.",
        LOG,
    )
    # read here, owned by another slice (its flag is declared there)
    epochs: int = 32  # the last epoch always saves

    def options(self) -> dict[str, Any]:
        """fsspec options for checkpoint and log URLs (--storage-options)."""
        return parse_storage_options(self.storage_options)


def check_checkpoint(cfg: CheckpointConfig) -> None:
    """The checkpoint flags' rules beyond each flag's own choices and check, before any work."""
    if not isinstance(cfg.save_every_minutes, (int, float)) or not (cfg.save_every_minutes >= 0):
        raise UserError(f"--save-every-minutes {cfg.save_every_minutes!r}: must be a non-negative number of minutes")
    cfg.options()
    if cfg.remote_sync and cfg.remote_sync_protocol == "s3" and not cfg.remote_sync.startswith("s3://"):
        raise UserError(
            f"--remote-sync {cfg.remote_sync}: --remote-sync-protocol s3 (the default) needs an "
            f"s3:// URL; add --remote-sync-protocol fsspec for other stores and directories"
        )
    for option, value in (("--remote-sync", cfg.remote_sync), ("--logs", cfg.logs)):
        if value and str(value).startswith(("http://", "https://")):
            raise UserError(f"{option} {value!r}: http(s) is read-only; use s3://, gs://, az:// or a directory")
    if cfg.resume and cfg.resume != "latest" and not is_url(cfg.resume) and not os.path.exists(cfg.resume):
        raise UserError(f"--resume {cfg.resume!r}: not found; pass a checkpoint directory or 'latest'")
