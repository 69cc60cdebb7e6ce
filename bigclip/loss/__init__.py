"""Contrastive losses (CLIP softmax, SigLIP sigmoid) that never build the global logit matrix.

    loss = build_loss(siglip, local_loss, gather_with_grad, impl, dist_impl, rank, world_size)
    value = loss(image_features, text_features, logit_scale, logit_bias=None)

impl (``--loss-impl``): naive (OpenCLIP's reference), chunked (exact tiled torch), triton
(fused kernels), auto (triton on CUDA when Triton imports, chunked elsewhere). dist_impl
(``--loss-dist-impl``): gather | ring for CLIP, bidir | shift | reduce | gather for SigLIP.
"""

from __future__ import annotations

import torch.nn as nn

from bigclip.loss.clip import ClipLoss
from bigclip.loss.select import CLIP_DIST_IMPLS, LOSS_IMPLS, SIGLIP_DIST_IMPLS
from bigclip.loss.siglip import SigLipLoss

__all__ = [
    "ClipLoss",
    "SigLipLoss",
    "build_loss",
    "LOSS_IMPLS",
    "CLIP_DIST_IMPLS",
    "SIGLIP_DIST_IMPLS",
]


def build_loss(
    siglip: bool,
    local_loss: bool,
    gather_with_grad: bool,
    impl: str,
    dist_impl: str | None,
    rank: int,
    world_size: int,
) -> nn.Module:
    """The loss module for these flags (SigLIP ignores local_loss / gather_with_grad, as OpenCLIP does)."""
    if siglip:
        return SigLipLoss(rank=rank, world_size=world_size, impl=impl, dist_impl=dist_impl)
    return ClipLoss(
        local_loss=local_loss,
        gather_with_grad=gather_with_grad,
        rank=rank,
        world_size=world_size,
        impl=impl,
        dist_impl=dist_impl,
    )
