"""Random-number-generator state of one rank (torch, CUDA, numpy, python), as bytes for a checkpoint file."""

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


def rng_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    return buf.getvalue()


def load_rng_file(path: str) -> None:
    set_rng_state(torch.load(path, weights_only=False))
