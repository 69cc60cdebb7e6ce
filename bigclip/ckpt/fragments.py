"""Parameters saved as fragments of their flattened values, one set per rank (the DeepSpeed engine's moving
average of its ZeRO partitions, engine/deepspeed_ema.py): reassembled for another world size or whole.

A rank's saved state: {"params": {name: 1-D float32 fragment}, "starts": {name: offset of the fragment in the
flattened parameter}, "shapes": {name: shape}, "buffers": {name: tensor}, "updates": int}.
"""

from __future__ import annotations

import glob
import os

import torch

EMA_DIR = "ema"  # the moving average's participant name, and so its folder


def participant_file(directory: str, name: str, rank: int) -> str:
    """Where a DeepSpeed checkpoint keeps rank `rank`'s state of sharded participant `name` (ema/rank_00000.pt)."""
    return os.path.join(directory, name, f"rank_{rank:05d}.pt")


def read_saved(directory: str, name: str = EMA_DIR) -> list[dict]:
    """Every rank's saved state of participant `name` (directory/<name>/), in rank order, memory-mapped (only
    the parts read are paged in); [] when the checkpoint holds none."""
    paths = sorted(glob.glob(os.path.join(directory, name, "rank_*.pt")))
    return [torch.load(path, map_location="cpu", weights_only=True, mmap=True) for path in paths]


def fill_range(target: torch.Tensor, start: int, name: str, saved: list[dict]) -> None:
    """target = elements [start, start + numel) of the flattened parameter `name`, from the saved fragments."""
    end = start + target.numel()
    for state in saved:
        fragment = state["params"].get(name)
        if fragment is None:
            continue
        s = state["starts"][name]
        lo, hi = max(start, s), min(end, s + fragment.numel())
        if lo < hi:
            target[lo - start : hi - start].copy_(fragment[lo - s : hi - s])


def assemble(saved: list[dict]) -> dict[str, torch.Tensor]:
    """The whole averaged parameters (and the buffers) from every rank's saved state: `bigclip export --ema`."""
    shapes = saved[0]["shapes"]
    out = {}
    for name, shape in shapes.items():
        whole = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
        fill_range(whole, 0, name, saved)
        out[name] = whole.view(shape)
    out.update(saved[0]["buffers"])
    return out
