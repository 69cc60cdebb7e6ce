"""What each --precision value means: autocast dtype, weight dtype, and whether a loss scaler is needed.

amp            fp16 autocast + dynamic loss scaling on GPU; on CPU bfloat16 autocast (CPUs have no fast
               fp16 matmul and bfloat16 needs no loss scaling)
amp_bf16       bfloat16 autocast (amp_bfloat16 is the same)
bf16 / fp16    weights and activations in that dtype, no autocast (pure_bf16 / pure_fp16 are the same)
fp32           everything in float32

Each name is registered in PRECISIONS with the function that says what it means on a device.

CPUs without bfloat16 units (AVX2-only x86, which torch reports as capability "AVX2") emulate bf16 matmuls:
40-130x slower than float32 was measured on such machines; most CPUs (all but those with AVX512-FP16 or AMX-FP16)
emulate fp16 alike. `slow_precision_warning` measures the factor at a run's start and says so once, with the flag
to use instead.
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


# A 16-bit matmul this many times slower than a float32 one: the CPU has no units for that dtype and torch
# emulates it. CPUs with bf16 units measure at most about 1x (0.4-0.5x on an AVX512-BF16 EPYC: bf16 is the faster
# one); emulated bf16 measured 40-130x (AVX2-only EPYCs; torch's AVX2 paths on the AVX512 one), emulated fp16
# 80-120x. 4x sits far from both, so neither a busy moment nor a CPU between the two crosses it by accident, and
# from 4x on float32 is the faster choice for any run whose memory it fits.
SLOW_FACTOR = 4.0
_MEASURE_BUDGET_S = 0.1  # once the timed rounds took this long the factor is plain (an emulated dtype's case)


def cpu_matmul_slowdown(dtype: torch.dtype = torch.bfloat16, size: int = 256, rounds: int = 5) -> float:
    """How many times longer a size x size x size matmul takes in `dtype` than in float32 on one core of this CPU:
    the best of up to `rounds` timings of each, the two dtypes interleaved (a busy moment slows both alike),
    after one untimed call of each. Fewer rounds once they took _MEASURE_BUDGET_S: where `dtype` is emulated one
    256^3 matmul takes 30-50 ms, so the whole measurement stays within 0.1-0.35 s (measured on a busy 2-core
    machine, about 0.1 s where `dtype` is native, most of it the first calls).

    One thread: the factor is a property of the cores' arithmetic, and a sub-millisecond matmul split over
    threads on a busy machine measures OpenMP waiting for a descheduled thread instead (256^3 in float32:
    0.45 ms on one thread, 40-70 ms on two beside other work)."""
    operands = {
        dt: (torch.ones(size, size, dtype=dt), torch.ones(size, size, dtype=dt)) for dt in (torch.float32, dtype)
    }
    best = dict.fromkeys(operands, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for a, b in operands.values():
            torch.mm(a, b)
        began = time.perf_counter()
        for _ in range(rounds):
            for dt, (a, b) in operands.items():
                start = time.perf_counter()
                torch.mm(a, b)
                best[dt] = min(best[dt], time.perf_counter() - start)
            if time.perf_counter() - began > _MEASURE_BUDGET_S:
                break
    finally:
        torch.set_num_threads(threads)
    return best[dtype] / max(best[torch.float32], 1e-9)


def compute_dtype(precision: Precision) -> torch.dtype | None:
    """The 16-bit dtype `precision`'s matmuls run in (autocast's, else the weights'), None for float32."""
    for dtype in (precision.autocast_dtype, precision.param_dtype):
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
    return None


def slow_precision_warning(
    precision: Precision, device: torch.device, slowdown: Callable[[torch.dtype], float] = cpu_matmul_slowdown
) -> str | None:
    """One line for the run's start where `precision` computes in a 16-bit dtype that this CPU emulates (the factor
    measured by `slowdown`), else None: said, not refused, since a run may want the memory it saves anyway."""
    dtype = compute_dtype(precision)
    if device.type != "cpu" or dtype is None:
        return None
    factor = slowdown(dtype)
    if factor < SLOW_FACTOR:
        return None
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"--precision {precision.name}: this CPU (torch capability {capability}) computes {name} {factor:.0f}x "
        f"slower than float32 (no {name} units: torch emulates it); use --precision fp32 to run faster here"
    )
