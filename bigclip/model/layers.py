"""Small pieces both towers share: QuickGELU and per-block activation checkpointing."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the activation OpenAI's original CLIP weights were trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def is_checkpointed(block_index: int, every: int) -> bool:
    """Whether block `block_index` (0-based) is recomputed in backward.

    `every=k` checkpoints the k-th, 2k-th, ... block (1-based counting), so k=1 means all
    blocks and k=0 means none.
    """
    return every > 0 and (block_index + 1) % every == 0


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, checkpoint_every: int, *args) -> torch.Tensor:
    """Apply `blocks` in order (each as block(x, *args): `args` are what every block also takes, an attention
    mask), recomputing every `checkpoint_every`-th one in backward.

    Non-reentrant checkpointing: it works with inputs that do not require grad (a frozen
    tower below) and composes with sharded parameters.
    """
    for i, block in enumerate(blocks):
        x = run_block(block, x, is_checkpointed(i, checkpoint_every), *args)
    return x


def run_block(block: nn.Module, x: torch.Tensor, recompute: bool, *args) -> torch.Tensor:
    """block(x, *args), recomputed in backward when `recompute` (and gradients are being taken)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, *args, use_reentrant=False)
    return block(x, *args)


class BlockSequence(nn.Sequential):
    """nn.Sequential (same state-dict names) that recomputes every k-th block in backward.

    Checkpointing lives inside the container's forward so that each tower still runs through
    its own `forward`: frameworks that gather parameters in module forward hooks see every
    module called.
    """

    checkpoint_every: int = 0  # 0: no activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self, x, self.checkpoint_every)
