"""Stochastic rounding of optimizer updates into bf16 weights (--precision pure_bf16).

With bf16 weights and no float32 master copy, round-to-nearest loses every update smaller than half a bf16 step
of the weight (8 significant bits: a weight of 1.0 ignores updates below 2^-9 = 0.002), so late, small learning
rates stop training. Rounding stochastically (up with probability equal to the fraction of the step that the
float32 result lies above the bf16 value below it) keeps each update in expectation: E[round(x)] = x. No
compensation buffer is kept: 0 bytes per parameter (Kahan summation would keep a bf16 one, 2 bytes).

The rounding is torchao's (`_fp32_to_bf16_sr`): a random 16-bit integer against the 16 bits that bf16 drops.
Its random bits are counter-based (Philox4x32-10, philox.py): element j of parameter `index` at optimizer
`step` takes 16 bits of the words of counter (j // 8, index, step, 0) under a key naming the rank's shard. So:

- DDP's replicas, which hold the same weights and gradients, round identically and stay equal;
- FSDP2's shards of one tensor draw different bits (their keys differ);
- a resumed run rounds as the uninterrupted run did (the bits depend on nothing a checkpoint loses);
- the bits do not depend on how updates are batched: one tensor at a time, many packed together, or a tensor
  split across packs draw the same bits, so the optimizer stepped in the backward rounds as the ordinary one;
- no generator is seeded or forked: the training RNG (augmentation, dropout) is never touched.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from bigclip.optim.philox import MASK32, philox4x32

GROUP = 8  # elements per Philox counter: 4 random words of 32 bits, 16 bits per element
KEY_SALT = 0x5EED_B16  # the key's second word: rounding bits apart from any other use of these counters


def shard_key(param: torch.Tensor) -> int:
    """The key word naming the piece of `param` this rank holds: 0 for a whole tensor (every DDP replica alike),
    distinct for each of FSDP2's shards."""
    shard = 0
    if isinstance(param, DTensor):
        for position in param.device_mesh.get_coordinate() or ():
            shard = shard * 1_009 + position + 1
    return shard & MASK32


def random_bits16(group: torch.Tensor, index: torch.Tensor, step: torch.Tensor, key: int) -> torch.Tensor:
    """16-bit random integers (int32) for the elements of the counter groups `group` (j // 8, int64) of parameters
    `index` at steps `step` (int64, broadcast with `group`): shape (*group.shape, 8), element j's at [..., j % 8]."""
    words = philox4x32(group, index, step, torch.zeros_like(group), key, KEY_SALT)
    halves = [half for word in words for half in (word & 0xFFFF, word >> 16)]
    return torch.stack(halves, dim=-1).to(torch.int32)


def round_with_bits(value: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """float32 `value` -> bf16, away from zero with probability (the 16 bits bf16 drops) / 2^16 (torchao's)."""
    as_int = value.view(torch.int32)
    toward_zero = as_int & -65536  # the upper 16 bits: the bf16 value truncated toward zero
    rounded = torch.where(bits16 < (as_int & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).bfloat16()


def round_into_bf16_(param: torch.Tensor, value: torch.Tensor, step: int, index: int, key: int) -> None:
    """param (bf16, a local tensor) <- value (float32, same shape) rounded stochastically with the bits of
    parameter `index` at optimizer `step` under shard `key` (see the module docstring)."""
    flat = value.reshape(-1)
    groups = torch.arange(-(-flat.numel() // GROUP), device=flat.device, dtype=torch.int64)
    index_, step_ = (torch.tensor(v, device=flat.device, dtype=torch.int64) for v in (index, step))
    bits = random_bits16(groups, index_, step_ & MASK32, key).reshape(-1)[: flat.numel()]
    param.copy_(round_with_bits(flat.float(), bits).view(param.shape))
