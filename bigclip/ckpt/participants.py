"""Checkpoint participants: everything a checkpoint saves besides the engine's model and optimizer, each by its
name, as torchtitan's checkpoint manager holds its `Stateful` states.

A participant is torch.distributed.checkpoint's `Stateful` (state_dict() / load_state_dict()) whose class says
where its state belongs, in `checkpoint_kind`:

    "sharded"  written by the engine's checkpoint layout beside the model and optimizer, and resharded like them
               at another world size (DCP: under `<name>.` in the same files; DeepSpeed: `<name>/rank_R.pt` per
               rank, and load_state_dict gets {"ranks": [every saved rank's state]}). The moving average.
    "rank"     this rank's own small state: the rank's file rng/rank_NNNNN.pt, under its name (read with
               weights_only: tensors and plain values only). At another world size it gets the same rank's
               state (none on a rank the saved run did not have), or, if it has
               `load_state_dicts(by_rank, saved_world_size)`, every saved rank's. The RNG, the data position.
    "record"   one for the run: rank 0 writes it into train_state.json under its name (JSON), every rank
               reads it back. The train state, and the config (for the record only: `Recorded`).

A participant the checkpoint does not hold keeps its state, after its `reset()` if it has one (the moving
average then starts from the resumed weights). The manager (ckpt/manager.py) saves each where its kind says and
the catalog (ckpt/catalog.py) restores each by name; neither knows what any of them is. Adding one is one entry
in the mapping the run hands its Checkpointer (train.py's `_participants`), besides the object's own class.

Checkpoints of format bigclip-checkpoint-2 (before participants had names) are read too: their rank files held
the RNG state's keys at the top and the data position under "data", their train_state.json the train state's
fields at the top beside "config"; `by_name` puts them under the names they have now.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from bigclip.ckpt.manifest import FORMAT_2
from bigclip.ckpt.verify import CorruptCheckpoint
from bigclip.errors import first_line

logger = logging.getLogger("bigclip")

SHARDED, PER_RANK, RECORD = "sharded", "rank", "record"
KINDS = (SHARDED, PER_RANK, RECORD)
NAME = re.compile(r"[A-Za-z_][\w\-]*")  # a file and key name, never a path


class Recorded:
    """A record participant that is only for the record (the run's resolved config): saved, never restored."""

    checkpoint_kind = RECORD

    def __init__(self, value: dict[str, Any]):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def kind_of(name: str, participant: Any) -> str:
    kind = getattr(participant, "checkpoint_kind", None)
    if kind not in KINDS:
        raise ValueError(
            f"checkpoint participant {name!r} ({type(participant).__name__}): its class must say checkpoint_kind, "
            f"one of {', '.join(KINDS)} (got {kind!r})"
        )
    return kind


def check(participants: Mapping[str, Stateful]) -> dict[str, Stateful]:
    """The participants, checked: names that can be file and key names, a kind each, and Stateful."""
    for name, participant in participants.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"checkpoint participant name {name!r}: use letters, digits, _ and -")
        kind_of(name, participant)
        if not isinstance(participant, Stateful):
            raise ValueError(f"checkpoint participant {name!r}: needs state_dict() and load_state_dict()")
    return dict(participants)


def of_kind(participants: Mapping[str, Stateful], kind: str) -> dict[str, Stateful]:
    return {name: p for name, p in participants.items() if kind_of(name, p) == kind}


def absent(name: str, participant: Stateful, directory: str, log: bool = True) -> None:
    """The checkpoint holds no `name`: it keeps its state, after reset() if it has one."""
    reset = getattr(participant, "reset", None)
    if reset is not None:
        reset()
    if log:
        logger.info(f"checkpoint {directory} holds no {name}: it starts afresh")


# ------------------------------------------------------------------------------------------- rank files
def rank_file_bytes(states: dict[str, Any]) -> bytes:
    """One rank's file: its rank participants' states by name."""
    buf = io.BytesIO()
    torch.save(states, buf)
    return buf.getvalue()


def read_rank_file(path: str, fmt: str) -> dict[str, Any]:
    """A rank file's states by name (weights_only: a checkpoint may come from a bucket someone else can write,
    and unpickling arbitrary objects from it would run their code)."""
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CorruptCheckpoint(
            f"{path}: holds objects other than tensors and plain values ({first_line(e)}); a bigclip rank file "
            f"never does, so it is not loaded — pick another checkpoint"
        ) from None
    return by_name(state, fmt, rank_file=True)


# ----------------------------------------------------------------------------------------------- the record
def record_bytes(states: dict[str, Any]) -> bytes:
    return json.dumps(states, indent=1, default=str).encode()


def read_record(path: str, fmt: str) -> dict[str, Any]:
    with open(path) as f:
        return by_name(json.load(f), fmt, rank_file=False)


def by_name(saved: dict[str, Any], fmt: str, rank_file: bool) -> dict[str, Any]:
    """States by participant name, from a rank file or train_state.json of checkpoint format `fmt`."""
    if fmt != FORMAT_2:
        return saved
    saved = dict(saved)
    if rank_file:  # the RNG state's keys at the top, the data position under "data"
        return {"data": saved.pop("data", None) or {}, "rng": saved}
    return {"config": saved.pop("config", {}), "train_state": saved}  # the train state's fields at the top
