"""The sigmoid (SigLIP) loss: module, naive reference and exact fused path.

Meaning (OpenCLIP's SigLipLoss): with z = scale * I @ T.T + bias and y = +1 on positive pairs,
-1 elsewhere, each rank's loss is -sum(log sigmoid(y z)) / B_local over its B_local images
against every text of the global batch. On several ranks the text features travel between
ranks by one of OpenCLIP's exchanges (`dist_impl`): bidir, shift, reduce, gather.

The fused block (`_FusedSigLipBlock`) computes one image-set x text-set block in tiles and saves
only the features and three numbers: the loss sum and the sums that make the scale and bias
gradients (sum of dz * x and of dz, dz = dloss/dz). Sigmoid terms need no normalisation, so
backward recomputes tiles with no statistics at all.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigclip.loss import select
from bigclip.loss.clip import check_features
from bigclip.loss.distributed import mean_grad_across_ranks, siglip_exchange
from bigclip.loss.family import LOSSES, LossConfig, LossFamily, check_dist_impl


def siglip_block_naive(image, text, logit_scale, logit_bias, negative_only: bool) -> torch.Tensor:
    """OpenCLIP's SigLipLoss._loss: materialises the B x B logits."""
    logits = logit_scale * image @ text.T
    if logit_bias is not None:
        logits = logits + logit_bias
    n = image.shape[0]
    labels = -torch.ones((n, text.shape[0]), device=image.device, dtype=image.dtype)
    if not negative_only:
        labels = labels + 2 * torch.eye(n, text.shape[0], device=image.device, dtype=image.dtype)
    return -F.logsigmoid(labels * logits).sum() / n


class _FusedSigLipBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, image, text, logit_scale, logit_bias, diag, backend):
        n = image.shape[0]
        scale = logit_scale.detach().reshape(()).float()
        bias = None if logit_bias is None else logit_bias.detach().reshape(()).float()
        sums = backend.siglip_block_sums(image, text, scale, bias, diag)
        ctx.save_for_backward(image, text, scale, bias, (sums[1:] / n).float())
        ctx.diag = diag
        ctx.backend = backend
        ctx.scale_meta = (logit_scale.shape, logit_scale.dtype)
        ctx.bias_meta = None if logit_bias is None else (logit_bias.shape, logit_bias.dtype)
        return (sums[0] / n).float()

    @staticmethod
    def backward(ctx, grad):
        image, text, scale, bias, d_scale_bias = ctx.saved_tensors
        coef = grad.float() / image.shape[0]
        d_image, d_text = ctx.backend.siglip_block_grads(
            image,
            text,
            scale,
            bias,
            ctx.diag,
            coef,
            need_image=ctx.needs_input_grad[0],
            need_text=ctx.needs_input_grad[1],
        )
        shape, dtype = ctx.scale_meta
        d_scale = (grad * d_scale_bias[0]).reshape(shape).to(dtype)
        d_bias = None
        if ctx.bias_meta is not None:
            shape, dtype = ctx.bias_meta
            d_bias = (grad * d_scale_bias[1]).reshape(shape).to(dtype)
        return (
            None if d_image is None else d_image.to(image.dtype),
            None if d_text is None else d_text.to(text.dtype),
            d_scale,
            d_bias,
            None,
            None,
        )


def siglip_block_fused(image, text, logit_scale, logit_bias, negative_only: bool, backend) -> torch.Tensor:
    diag = None if negative_only else 0
    return _FusedSigLipBlock.apply(image, text, logit_scale, logit_bias, diag, backend)


class SigLipLoss(nn.Module):
    """SigLIP loss with OpenCLIP's exchanges and an implementation switch.

    impl: naive | chunked | triton | auto. dist_impl: bidir | shift | reduce | gather.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, impl: str = "auto", dist_impl: str | None = "bidir"):
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.impl = select.check_impl(impl)
        self.dist_impl = check_dist_impl(dist_impl, SIGLIP)

    def forward(self, image_features, text_features, logit_scale, logit_bias=None):
        check_features(image_features, text_features)
        impl = select.resolve_impl(self.impl, image_features)
        if impl == "naive":
            block = siglip_block_naive
        else:
            backend = select.backend_for(impl)

            def block(image, text, scale, bias, negative_only):
                return siglip_block_fused(image, text, scale, bias, negative_only, backend)

            if self.world_size > 1:
                # Each rank's scale/bias gradient becomes the mean over ranks: exact and identical
                # everywhere, and unchanged by DDP's averaging.
                logit_scale = mean_grad_across_ranks(logit_scale)
                if logit_bias is not None:
                    logit_bias = mean_grad_across_ranks(logit_bias)
        loss = block(image_features, text_features, logit_scale, logit_bias, False)
        if self.world_size > 1:
            loss = loss + siglip_exchange(
                block,
                image_features,
                text_features,
                logit_scale,
                logit_bias,
                self.rank,
                self.world_size,
                self.dist_impl,
            )
        return loss

    def extra_repr(self) -> str:
        return f"impl={self.impl}, dist_impl={self.dist_impl}, rank={self.rank}, world_size={self.world_size}"


def _build_siglip_loss(cfg: LossConfig, rank: int, world_size: int) -> SigLipLoss:
    # SigLIP has no local_loss / gather_with_grad: OpenCLIP ignores them for it too.
    return SigLipLoss(rank, world_size, cfg.loss_impl, cfg.loss_dist_impl)


# OpenCLIP's SigLIP exchanges of text features between ranks (bidir is its default).
SIGLIP_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
SIGLIP = LOSSES.register(
    "siglip",
    LossFamily(
        _build_siglip_loss,
        SIGLIP_DIST_IMPLS,
        "the SigLIP loss (--siglip)",
        # open_clip_train's --siglip: logit scale log 10, bias -10 (Zhai et al. 2023)
        model_init={"init_logit_scale": math.log(10.0), "init_logit_bias": -10.0},
        selected_by=("siglip",),
    ),
    help="SigLIP's sigmoid loss, logit scale init log 10 and bias -10 (OpenCLIP's --siglip)",
)
