"""The checkpoint-layout contract: how one engine's state becomes files, and files become its state again.

The checkpoint manager owns everything around it (when to save, the .partial folder, the per-rank and record
participants' files, uploads, the manifest, retention, finding `latest`); a layout owns only the engine's own
state and the sharded participants (ckpt/participants.py) it is handed, saved beside it under their names and
resharded like it. An engine names its layout (`engine.checkpoint_layout(group, mode, participants)`), so the
manager never asks which engine it has. Two exist: DCP (ckpt/dcp_layout.py, for DDP and FSDP2) and DeepSpeed's
ZeRO files (ckpt/deepspeed_layout.py).

One save:   handle = layout.stage(directory)            main thread, collective; returns quickly (the model's
                                                        buffers copied already: buffers_copied_now)
            ...the loop's next forward/backward runs...
            handle.result()                             before the next optimizer step (the copy is taken)
            layout.write(handle, directory, sink)       save thread, collective on the checkpoint group:
                                                        writes this rank's files, sink.submit(path) for each
One load:   layout.load(directory, saved_world_size, saved_extra)   collective; reshards or converts when
                                                        the world size differs
"""

from __future__ import annotations

import abc
import copy
from concurrent.futures import Future
from typing import Any, Protocol

import torch


def buffers_copied_now(tree: Any, module: torch.nn.Module) -> Any:
    """`tree` (a state dict, or nested dicts and lists of them) with each tensor that is one of `module`'s buffers
    replaced by a copy made now, in the loop's thread. The background copy of a save runs beside the next
    forward, which changes no parameter or optimizer state but does change buffers (BatchNorm's running
    statistics): copied later, a checkpoint held the next step's statistics, some layers' or all. Buffers are
    small (statistics, not weights), so copying them here costs the loop next to nothing."""
    owned = {b.untyped_storage().data_ptr() for b in module.buffers() if b.numel()}
    if not owned:
        return tree

    def copied(obj: Any) -> Any:
        if type(obj) is torch.Tensor:  # a buffer is a plain tensor (never a DTensor shard)
            return obj.clone() if obj.numel() and obj.untyped_storage().data_ptr() in owned else obj
        if isinstance(obj, dict):
            out = copy.copy(obj)  # the mapping's own type (OrderedDict keeps its metadata)
            out.update((k, copied(v)) for k, v in obj.items())
            return out
        if isinstance(obj, list):
            return [copied(v) for v in obj]
        return obj

    return copied(tree)


class FileSubmitter(Protocol):
    def submit(self, path: str) -> None:
        """Take a finished, closed file of the checkpoint (it is hashed, uploaded and listed in the manifest)."""


class CheckpointLayout(abc.ABC):
    name: str  # recorded in the manifest; a checkpoint loads only into an engine whose layout has this name
    # True when stage() itself creates files in `directory` (DeepSpeed writes small companions there), so the
    # manager prepares the directory before staging rather than in the save thread.
    writes_while_staging: bool = False
    mode: str = "thread"  # the writer actually used: "thread" or "process"

    @abc.abstractmethod
    def stage(self, directory: str) -> Future:
        """Collective. Start copying this rank's state into host buffers; the future resolves when the copy
        is complete (nothing may change parameters or optimizer state before that; what the forward changes,
        the model's buffers, is copied before stage() returns: buffers_copied_now)."""

    @abc.abstractmethod
    def write(self, staged: Future, directory: str, sink: FileSubmitter) -> None:
        """Collective on the checkpoint group, in the save thread: write this rank's files of the staged state
        into `directory`, handing each to `sink` as soon as it is complete."""

    def describe(self) -> dict:
        """What a resuming run must match beyond the layout name (recorded in the manifest's `extra`)."""
        return {}

    @abc.abstractmethod
    def load(self, directory: str, saved_world_size: int, saved_extra: dict) -> None:
        """Collective: restore the engine's state from a verified local checkpoint directory, resharding (or
        converting) when it was written by another number of ranks. UserError when it does not fit."""

    def close(self) -> None:
        """Release staging buffers and threads."""

    @staticmethod
    @abc.abstractmethod
    def read_model_state(directory: str, ema: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights (`ema`: their moving average, --ema-decay) in a verified checkpoint of this
        layout, read in one process with no process group and no engine (what `bigclip export` needs)."""
