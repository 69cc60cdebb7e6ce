"""Sharded, asynchronous checkpoints streamed to object storage and committed by a manifest written last."""

from bigclip.ckpt.catalog import verify
from bigclip.ckpt.manager import CheckpointManager

__all__ = ["CheckpointManager", "verify"]
