"""Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) in torch integer ops.

A counter-based generator: the random words are a pure function of a 128-bit counter and a 64-bit key, so any
element's bits can be computed where and when it is needed, in any order, by any device, with no generator
state to seed, fork or checkpoint. It is the generator of torch's CUDA random streams and of Triton's
`tl.randint`/`tl.philox`; this implementation gives the same words as Triton's `tl.philox(seed, c0, c1, c2, c3)`
(tested under the Triton interpreter), so a Triton kernel can draw the very bits a torch-op path draws.

Written with int64 tensors of 32-bit values: each 32x32-bit product is formed from two 16-bit halves of the
constant, so no intermediate exceeds 2^50 (signed overflow, which C++ leaves undefined, never happens in eager
or in inductor's generated code).
"""

from __future__ import annotations

import torch

ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # the multipliers of counter words 0 and 2
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # the Weyl sequence that bumps the key after each round
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of multiplier * x, for x holding values in [0, 2^32)."""
    low_half, high_half = multiplier & 0xFFFF, multiplier >> 16
    by_high = x * high_half  # < 2^48
    partial = x * low_half + ((by_high & 0xFFFF) << 16)  # < 2^49
    return (by_high >> 16) + (partial >> 32), partial & MASK32


Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int) -> Words:
    """The four 32-bit random words (int64 tensors in [0, 2^32)) of counters (c0, c1, c2, c3) under key (k0, k1).
    Counters and key words are int64 values in [0, 2^32); tensors broadcast."""
    for _ in range(ROUNDS):
        high0, low0 = _mulhilo(ROUND_A, c0)
        high2, low2 = _mulhilo(ROUND_B, c2)
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, low2, high0 ^ c3 ^ k1, low0
        k0, k1 = (k0 + KEY_A) & MASK32, (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3
