"""The sigmoid (SigLIP) loss: module, naive reference and exact fused path.

Meaning (OpenCLIP's SigLipLoss): with z = scale * I @ T.T + bias and y = +1 on positive pairs,
-1 elsewhere, each rank's loss is -sum(log sigmoid(y z)) / B_local over its B_local images
against every text of the global batch. On several ranks the text features travel between
ranks by one of OpenCLIP's exchanges (`dist_impl`): bidir, shift, reduce, gather.

The fused block (`_FusedSigLipBlock`) computes one image-set x text-set block in tiles: the loss sum,
the sums that make the scale and bias gradients (sum of dz * x and of dz, dz = dloss/dz) and, in a
training step, the feature gradients in the same pass (sigmoid terms need no normalisation, so
nothing waits for the whole block): backward only scales them by the incoming gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigclip.loss import select
from bigclip.loss.clip import check_features
from bigclip.loss.collectives import mean_grad_across_ranks
from bigclip.loss.family import LOSSES, LossConfig, LossFamily, check_dist_impl
from bigclip.loss.siglip_exchange import siglip_blocks, siglip_loss_exchanged


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
    """One block's SigLIP loss from a backend's primitives. When gradients are wanted the forward pass computes
    them beside the loss (`siglip_block_sums_and_grads`: the tiles once, not again in backward) and backward
    scales them by the incoming gradient; they are linear in it."""

    @staticmethod
    def forward(ctx, image, text, logit_scale, logit_bias, diag, backend):
        n = image.shape[0]
        scale = logit_scale.detach().reshape(()).float()
        bias = None if logit_bias is None else logit_bias.detach().reshape(()).float()
        need_image, need_text = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_image = d_text = None
        if need_image or need_text:
            coef = torch.tensor(1.0 / n, device=image.device)
            sums, d_image, d_text = backend.siglip_block_sums_and_grads(
                image, text, scale, bias, diag, coef, need_image, need_text
            )
        else:
            sums = backend.siglip_block_sums(image, text, scale, bias, diag)
        ctx.save_for_backward(d_image, d_text, (sums[1:] / n).float())
        ctx.feature_dtypes = (image.dtype, text.dtype)
        ctx.scale_meta = (logit_scale.shape, logit_scale.dtype)
        ctx.bias_meta = None if logit_bias is None else (logit_bias.shape, logit_bias.dtype)
        return (sums[0] / n).float()

    @staticmethod
    def backward(ctx, grad):
        d_image, d_text, d_scale_bias = ctx.saved_tensors
        image_dtype, text_dtype = ctx.feature_dtypes
        g = grad.float()
        shape, dtype = ctx.scale_meta
        d_scale = (grad * d_scale_bias[0]).reshape(shape).to(dtype)
        d_bias = None
        if ctx.bias_meta is not None:
            shape, dtype = ctx.bias_meta
            d_bias = (grad * d_scale_bias[1]).reshape(shape).to(dtype)
        return (
            None if d_image is None else (d_image * g).to(image_dtype),
            None if d_text is None else (d_text * g).to(text_dtype),
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

    impl: naive | chunked | fused | triton | auto. dist_impl: bidir | shift | reduce | gather. precision: the
    fused path's (exact | fast).
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        impl: str = "auto",
        dist_impl: str | None = "bidir",
        precision: str = "exact",
    ):
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.impl = select.check_impl(impl)
        self.dist_impl = check_dist_impl(dist_impl, SIGLIP)
        self.precision = select.check_precision(precision)

    def forward(self, image_features, text_features, logit_scale, logit_bias=None):
        check_features(image_features, text_features)
        # every exchange computes one B x B block at a time
        impl = select.resolve_impl(self.impl, image_features, "siglip", image_features.shape[0] ** 2, self.precision)
        if impl == "naive":
            block = siglip_block_naive
        else:
            backend = select.backend_for(impl, self.precision)

            def block(image, text, scale, bias, negative_only):
                return siglip_block_fused(image, text, scale, bias, negative_only, backend)

            if self.world_size > 1:
                # Each rank's scale/bias gradient becomes the mean over ranks: exact and identical
                # everywhere, and unchanged by DDP's averaging.
                logit_scale = mean_grad_across_ranks(logit_scale)
                if logit_bias is not None:
                    logit_bias = mean_grad_across_ranks(logit_bias)
                if self.dist_impl in ("bidir", "shift"):  # one autograd node for the whole walk: O(B d) memory
                    return siglip_loss_exchanged(
                        image_features, text_features, logit_scale, logit_bias, backend, self.rank,
                        self.world_size, self.dist_impl,
                    )  # fmt: skip
        return siglip_blocks(
            block, image_features, text_features, logit_scale, logit_bias, self.rank, self.world_size, self.dist_impl
        )

    def extra_repr(self) -> str:
        return (
            f"impl={self.impl}, precision={self.precision}, dist_impl={self.dist_impl}, rank={self.rank}, "
            f"world_size={self.world_size}"
        )


def _build_siglip_loss(cfg: LossConfig, rank: int, world_size: int) -> SigLipLoss:
    # SigLIP has no local_loss / gather_with_grad: OpenCLIP ignores them for it too.
    return SigLipLoss(rank, world_size, cfg.loss_impl, cfg.loss_dist_impl, cfg.loss_precision)


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
