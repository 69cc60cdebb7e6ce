"""A DeepSpeed checkpoint engine that stages instead of writing, so DeepSpeed saves asynchronously too.

DeepSpeed's `save_checkpoint` is collective and must run on the main thread; it hands each file's state dict
to its checkpoint engine's `save(state_dict, path)`. DeepSpeed's default engine torch.saves right there,
blocking the loop for the whole serialisation and write. This engine only keeps the state dicts, whose
tensors are the live parameters and optimizer partitions. `copy()` (the layout runs it on a staging thread
while the next forward/backward runs) copies their tensors into host buffers that are allocated on the first
save and reused by every later one (pinned on CUDA); the loop waits for it before the next optimizer step
(CheckpointManager.wait_staged), the only thing that changes those tensors. The save thread then torch.saves
the copies.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


class StagingCheckpointEngine(CheckpointEngine):
    def __init__(self, loader: CheckpointEngine):
        super().__init__()
        self.name = "bigclip-staging"
        self.loader = loader  # DeepSpeed's own engine still reads checkpoints
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._staged: list[tuple[str, Any]] = []
        self._pin = torch.cuda.is_available()

    # -- DeepSpeed's calls
    def create(self, info) -> None:
        self._staged = []

    def save(self, state_dict: Any, path: str) -> None:
        self._staged.append((path, state_dict))  # references only: copy() takes the copy

    def load(self, path: str, map_location=None):
        return self.loader.load(path, map_location=map_location)

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        # Every tensor is copied on its own anyway: DeepSpeed's extra defensive clone would be a second copy.
        return False

    # -- the save thread's side
    def take(self) -> list[tuple[str, Any]]:
        """The files DeepSpeed handed over since the last `create`, as (path, live state dict) pairs."""
        staged, self._staged = self._staged, []
        return staged

    def copy(self, staged: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """(path, state dict) pairs whose tensors are copies in the reused host buffers."""
        out = [(path, self._copy(state, (os.path.basename(path),))) for path, state in staged]
        if self._pin:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        return out

    @property
    def staged_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    # -- copying
    def _copy(self, obj: Any, key: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage_tensor(obj, key)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
            for k, v in obj.items():
                out[k] = self._copy(v, key + (k,))
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, key + (i,)) for i, v in enumerate(obj)]
            if hasattr(obj, "_fields"):  # namedtuple
                return type(obj)(*items)
            return type(obj)(items)
        return copy.deepcopy(obj)  # small bookkeeping (loss scaler, config, shapes)

    def _stage_tensor(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin and t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf
