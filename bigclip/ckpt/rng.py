"""One rank's own state for a checkpoint file: its random-number generators (torch, CUDA, numpy, python) and
its data position (where this rank's loader and its workers are in the epoch; see data/wds_stream.py).

Stored as tensors, numbers, strings, lists, tuples and dicts only, so the file loads with
`torch.load(weights_only=True)`: a checkpoint may come from a bucket someone else can write, and unpickling
arbitrary objects from it would run their code. numpy's generator state is kept as its parts (the key
array as a tensor)."""

from __future__ import annotations

import io
import pickle
import random
from typing import Any

import numpy as np
import torch

from bigclip.ckpt.verify import CorruptCheckpoint
from bigclip.errors import first_line


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    _set_numpy_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_state_bytes(data_position: dict[str, Any] | None = None) -> bytes:
    buf = io.BytesIO()
    torch.save({**rng_state(), "data": data_position or {}}, buf)
    return buf.getvalue()


def _load(path: str) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CorruptCheckpoint(
            f"{path}: holds objects other than tensors and plain values ({first_line(e)}); a bigclip rank file "
            f"never does, so it is not loaded — pick another checkpoint"
        ) from None


def load_rank_state_file(path: str) -> dict[str, Any]:
    """Restore the generators saved in `path`; returns the data position saved with them ({} if none)."""
    state = _load(path)
    set_rng_state(state)
    return state.get("data") or {}


def read_data_position(path: str) -> dict[str, Any]:
    """The data position saved in a rank file, without touching this process's generators."""
    return _load(path).get("data") or {}
