"""One rank's own state for a checkpoint file: its random-number generators (torch, CUDA, numpy, python) and
its data position (where this rank's loader and its workers are in the epoch; see data/wds_stream.py)."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_state_bytes(data_position: dict[str, Any] | None = None) -> bytes:
    buf = io.BytesIO()
    torch.save({**rng_state(), "data": data_position or {}}, buf)
    return buf.getvalue()


def load_rank_state_file(path: str) -> dict[str, Any]:
    """Restore the generators saved in `path`; returns the data position saved with them ({} if none)."""
    state = torch.load(path, weights_only=False)
    set_rng_state(state)
    return state.get("data") or {}


def read_data_position(path: str) -> dict[str, Any]:
    """The data position saved in a rank file, without touching this process's generators."""
    return torch.load(path, weights_only=False).get("data") or {}
