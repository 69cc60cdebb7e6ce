"""The RNG participant: one rank's random-number generators (torch, CUDA, numpy, python), saved in the rank's own
checkpoint file under "rng" (ckpt/participants.py) and restored on resume, so a resumed run draws what an
uninterrupted one would.

Stored as tensors, numbers, strings, lists, tuples and dicts only, so the file loads with
`torch.load(weights_only=True)`. numpy's generator state is kept as its parts (the key array as a tensor)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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


class RankRNG:
    """This rank's generators as a checkpoint participant: state_dict() captures them, load_state_dict() sets
    them. A rank the saved run did not have keeps its own (seeded) state."""

    checkpoint_kind = "rank"  # ckpt/participants.py

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)
