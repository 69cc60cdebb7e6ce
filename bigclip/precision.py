"""What each --precision value means: autocast dtype, weight dtype, and whether a loss scaler is needed.

amp            fp16 autocast + dynamic loss scaling on GPU; on CPU bfloat16 autocast (CPUs have no fast
               fp16 matmul and bfloat16 needs no loss scaling)
amp_bf16       bfloat16 autocast (amp_bfloat16 is the same)
bf16 / fp16    weights and activations in that dtype, no autocast (pure_bf16 / pure_fp16 are the same)
fp32           everything in float32
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype
    loss_scaling: bool  # images are fed in param_dtype: pure bf16/fp16 weights need bf16/fp16 inputs

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    on_gpu = device.type == "cuda"
    if name == "amp":
        if on_gpu:
            return Precision(name, torch.float16, torch.float32, True)
        return Precision(name, torch.bfloat16, torch.float32, False)
    if name in ("amp_bf16", "amp_bfloat16"):
        return Precision(name, torch.bfloat16, torch.float32, False)
    if name in ("bf16", "pure_bf16"):
        return Precision(name, None, torch.bfloat16, False)
    if name in ("fp16", "pure_fp16"):
        return Precision(name, None, torch.float16, False)
    return Precision(name, None, torch.float32, False)
