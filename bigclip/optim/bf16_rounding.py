"""Stochastic rounding of optimizer updates into bf16 weights (--precision pure_bf16).

With bf16 weights and no float32 master copy, round-to-nearest loses every update smaller than half a bf16 step
of the weight (8 significant bits: a weight of 1.0 ignores updates below 2^-9 = 0.002), so late, small learning
rates stop training. Rounding stochastically (up with probability equal to the fraction of the step that the
float32 result lies above the bf16 value below it) keeps each update in expectation: E[round(x)] = x. No
compensation buffer is kept: 0 bytes per parameter (Kahan summation would keep a bf16 one, 2 bytes).

The rounding itself is torchao's (`_fp32_to_bf16_sr`, also what its compiled AdamW update runs): random 16-bit
integers against the 16 bits that bf16 drops. Its random bits come from torch's generator, and the seed is set
before each parameter's update from (optimizer step, parameter index, shard coordinate) so that:

- DDP's replicas, which hold the same weights and gradients, round identically and stay equal;
- FSDP2's shards of one tensor draw different bits;
- a resumed run rounds as the uninterrupted run did (the seed depends on nothing a checkpoint loses);
- the training RNG (augmentation, dropout) is untouched: the optimizer runs inside torch.random.fork_rng.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

SEED_MODULUS = 2**62


def update_seed(step: int, index: int, param: torch.Tensor) -> int:
    """The seed of one parameter's rounding at one optimizer step (the same on every replica of it)."""
    shard = 0
    if isinstance(param, DTensor):
        for position in param.device_mesh.get_coordinate() or ():
            shard = shard * 1_009 + position + 1
    return (step * 1_000_003 + index * 7_919 + shard * 104_729) % SEED_MODULUS


@contextlib.contextmanager
def own_random_stream(params: list[torch.Tensor]):
    """Run the optimizer's rounding on its own random stream: the caller's generators are restored after."""
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def seed_update(step: int, index: int, param: torch.Tensor) -> None:
    torch.manual_seed(update_seed(step, index, param))  # seeds CPU and every CUDA device's generator


def round_into_bf16_(param: torch.Tensor, value: torch.Tensor) -> None:
    """param (bf16, local) <- value (float32) rounded stochastically, from the stream seed_update() set."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    param.copy_(_fp32_to_bf16_sr(value))
