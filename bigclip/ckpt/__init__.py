from .manager import CheckpointManager, verify

__all__ = ["CheckpointManager", "verify"]
