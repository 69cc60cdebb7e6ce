"""Sharded, asynchronous checkpoints streamed to object storage and committed by a manifest written last."""

from .manager import CheckpointManager, verify

__all__ = ["CheckpointManager", "verify"]
