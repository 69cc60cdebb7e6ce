"""What each --precision value means: autocast dtype, weight dtype, and whether a loss scaler is needed.

amp            fp16 autocast + dynamic loss scaling on GPU; on CPU bfloat16 autocast (CPUs have no fast
               fp16 matmul and bfloat16 needs no loss scaling)
amp_bf16       bfloat16 autocast (amp_bfloat16 is the same)
bf16 / fp16    weights and activations in that dtype, no autocast (pure_bf16 / pure_fp16 are the same)
fp32           everything in float32

Each name is registered in PRECISIONS with the function that says what it means on a device.

CPUs without bfloat16 units (AVX2-only x86, which torch reports as capability "AVX2") emulate bf16 matmuls:
95x slower than float32 was measured on one. `slow_bf16_warning` measures the factor at a run's start and
says so once, with the flag to use instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bigclip.registry import Registry


@dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype  # images are fed in param_dtype: pure bf16/fp16 weights need bf16/fp16 inputs
    loss_scaling: bool

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


PRECISIONS: Registry[Callable[[str, torch.device], Precision]] = Registry("--precision")


@PRECISIONS.register("amp", help="fp16 autocast with loss scaling on GPU, bfloat16 autocast on CPU")
def _amp(name: str, device: torch.device) -> Precision:
    if device.type == "cuda":
        return Precision(name, torch.float16, torch.float32, True)
    return Precision(name, torch.bfloat16, torch.float32, False)


@PRECISIONS.register("amp_bf16", aliases=("amp_bfloat16",), help="bfloat16 autocast")
def _amp_bf16(name: str, device: torch.device) -> Precision:
    return Precision(name, torch.bfloat16, torch.float32, False)


@PRECISIONS.register("bf16", aliases=("pure_bf16",), help="bfloat16 weights, no autocast")
def _bf16(name: str, device: torch.device) -> Precision:
    return Precision(name, None, torch.bfloat16, False)


@PRECISIONS.register("fp16", aliases=("pure_fp16",), help="float16 weights, no autocast")
def _fp16(name: str, device: torch.device) -> Precision:
    return Precision(name, None, torch.float16, False)


@PRECISIONS.register("fp32", help="everything in float32")
def _fp32(name: str, device: torch.device) -> Precision:
    return Precision(name, None, torch.float32, False)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """What --precision `name` means on `device`; an unknown name is a UserError listing the registered ones."""
    return PRECISIONS.get(name)(name, device)


SLOW_BF16_FACTOR = 4.0  # a bf16 matmul this many times slower than fp32: the CPU has no bf16 units


def cpu_bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """How many times longer a size x size x size matmul takes in bfloat16 than in float32 on this CPU: the best
    of `repeats` timings of each, the two dtypes interleaved (a busy moment slows both alike), after one untimed
    call of each."""
    operands = {dtype: (torch.ones(size, size, dtype=dtype), torch.ones(size, size, dtype=dtype))
                for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    best = dict.fromkeys(operands, float("inf"))
    for a, b in operands.values():
        torch.mm(a, b)
    for _ in range(repeats):
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.mm(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def slow_bf16_warning(
    precision: Precision, device: torch.device, slowdown: Callable[[], float] = cpu_bf16_slowdown
) -> str | None:
    """One line for the run's start where `precision` computes in bfloat16 on a CPU that emulates it (the
    factor measured by `slowdown`), else None."""
    if device.type != "cpu" or torch.bfloat16 not in (precision.autocast_dtype, precision.param_dtype):
        return None
    factor = slowdown()
    if factor < SLOW_BF16_FACTOR:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"--precision {precision.name}: this CPU (torch capability {capability}) computes bfloat16 {factor:.0f}x "
        f"slower than float32 (no native bf16 units); --precision fp32 will run faster here"
    )
