"""Sharded, asynchronous checkpoints streamed to object storage and committed by a manifest written last."""

from bigclip.ckpt.manager import CheckpointManager, verify

__all__ = ["CheckpointManager", "verify"]
