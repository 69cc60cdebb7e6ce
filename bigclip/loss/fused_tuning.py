"""Chunk and tile sizes of the `fused` loss path, and the batch size below which `--loss-impl auto` keeps the
naive loss: read from fused_tuning.json beside this module, which bench/gpu/tune_losses.py writes on a GPU.

The file holds, per loss family and feature dtype, a list of plans ordered by `max_n` (the largest number of
columns, i.e. texts, the plan is for; null for any): the first plan whose max_n is at least the block's
columns is used. Its `source` says where and when the numbers were measured.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, fields

import torch

# The fused path's arithmetics (--loss-precision): exact keeps every result within the chunked path's bounds;
# fast uses TF32 for fp32 features and hands bf16 / fp16 dL/dlogits to the matmuls rounded once.
PRECISIONS = ("exact", "fast")
TUNING_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_tuning.json")


@dataclass(frozen=True)
class LaunchPlan:
    chunk_rows: int  # image rows per cuBLAS chunk: the float32 chunk of logits is chunk_rows x N
    bm: int  # tile of the gradient / SigLIP kernels
    bn: int
    warps: int
    stats_bm: int  # tile of the CLIP statistics kernel, which walks a column block down its rows
    stats_bn: int
    stats_warps: int
    max_groups: int = 8  # row groups of the statistics kernel per chunk (column partials it writes)
    merge_block: int = 1024  # vector width of the merge kernels
    max_n: int | None = None


# The interpreter runs each Triton op in Python: big tiles, small chunks so that tests cross chunk borders.
INTERPRETED = LaunchPlan(chunk_rows=64, bm=32, bn=64, warps=4, stats_bm=16, stats_bn=64, stats_warps=4, max_groups=2)


_in_use: dict | None = None  # a table handed over by use_table (the tuner's candidates), else the file's


@functools.lru_cache(maxsize=1)
def _file_table() -> dict:
    with open(TUNING_FILE) as f:
        return json.load(f)


def _table() -> dict:
    return _in_use if _in_use is not None else _file_table()


def use_table(table: dict | None) -> None:
    """Launch from `table` (same layout as the file) instead of the file; None goes back to the file."""
    global _in_use
    _in_use = table


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def launch_plan(family: str, dtype: torch.dtype, n: int, m: int, device: torch.device, tile: int | None) -> LaunchPlan:
    """The plan for an m x n block of `family` logits with features of `dtype` on `device`; `tile` (tests)
    overrides the chunk rows."""
    if device.type != "cuda" and _in_use is None:
        plan = INTERPRETED
    else:
        key = _dtype_key(dtype if dtype in (torch.float32, torch.float16) else torch.bfloat16)
        plans = _table()["plans"][family][key]
        names = {f.name for f in fields(LaunchPlan)}
        chosen = next((p for p in plans if p.get("max_n") is None or n <= p["max_n"]), plans[-1])
        plan = LaunchPlan(**{key: value for key, value in chosen.items() if key in names})
    if tile is not None:
        plan = LaunchPlan(**{**plan.__dict__, "chunk_rows": tile})
    return plan


def naive_max_logits(family: str, dtype: torch.dtype) -> int:
    """`--loss-impl auto` keeps the naive loss on a GPU up to this many logits (rows x columns), where it was
    measured to be faster than the fused path."""
    table = _table().get("naive_max_logits", {})
    return int(table.get(family, {}).get(_dtype_key(dtype), 0))


def tuning_source() -> str:
    return _table().get("source", "")
