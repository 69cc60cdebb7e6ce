"""The softmax contrastive (CLIP) loss: module, naive reference, exact fused single-process path.

Meaning (OpenCLIP's): features are L2-normalised (B, D); `logit_scale` is the multiplicative
scale (already exponentiated, shape () or (1,)); with S = scale * I @ T.T the loss is
(CE(S, diag) + CE(S.T, diag)) / 2. On several ranks, `local_loss` and `gather_with_grad` keep
OpenCLIP's meaning; see `bigclip.loss.distributed` for how the fused paths realise them.

The fused path (`chunked`, `triton`) saves only the features and four float32 vectors
(row / column log-sum-exp and softmax-weighted means of the unscaled logits) and recomputes
tiles in backward. The scale gradient comes from those means:
d lse_i / d scale = sum_j softmax_ij x_ij, so no N x N reduction is needed for it.

A logit bias does not change a softmax; `ClipLoss` accepts one (a SigLIP-style model fed to the
CLIP loss) and gives it an exact zero gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigclip.loss import select
from bigclip.loss.chunked import positive_logits
from bigclip.loss.collectives import gather_features
from bigclip.loss.distributed import clip_loss_distributed
from bigclip.loss.family import LOSSES, LossConfig, LossFamily, check_dist_impl


def clip_logits(
    image: torch.Tensor,
    text: torch.Tensor,
    logit_scale: torch.Tensor,
    local_loss: bool = False,
    gather_with_grad: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCLIP's ClipLoss.get_logits: (logits per image, logits per text), gathered across ranks."""
    if world_size > 1:
        all_image, all_text = gather_features(image, text, local_loss, gather_with_grad, rank, world_size)
        if local_loss:
            return logit_scale * image @ all_text.T, logit_scale * text @ all_image.T
        logits_per_image = logit_scale * all_image @ all_text.T
        return logits_per_image, logits_per_image.T
    return logit_scale * image @ text.T, logit_scale * text @ image.T


def clip_loss_naive(
    image: torch.Tensor,
    text: torch.Tensor,
    logit_scale: torch.Tensor,
    local_loss: bool = False,
    gather_with_grad: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> torch.Tensor:
    """OpenCLIP's ClipLoss: materialises the logits (B x B, or B_global x B_global)."""
    logits_per_image, logits_per_text = clip_logits(
        image, text, logit_scale, local_loss, gather_with_grad, rank, world_size
    )
    labels = torch.arange(logits_per_image.shape[0], device=image.device)
    if world_size > 1 and local_loss:
        labels = labels + logits_per_image.shape[0] * rank
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


class _FusedClipLoss(torch.autograd.Function):
    """Single-process exact CLIP loss from tile primitives (see `bigclip.loss.chunked`)."""

    @staticmethod
    def forward(ctx, image, text, logit_scale, backend):
        n = image.shape[0]
        scale = logit_scale.detach().reshape(()).float()
        row_lse, row_mean, col_lse, col_mean = backend.clip_block_stats(image, text, scale)
        pos = positive_logits(image, text).sum()
        loss = (row_lse.sum() + col_lse.sum() - 2 * scale * pos) / (2 * n)
        d_scale = (row_mean.sum() + col_mean.sum() - 2 * pos) / (2 * n)
        ctx.save_for_backward(image, text, scale, row_lse, col_lse, d_scale)
        ctx.backend = backend
        ctx.scale_meta = (logit_scale.shape, logit_scale.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        image, text, scale, row_lse, col_lse, d_scale = ctx.saved_tensors
        n = image.shape[0]
        weight = (grad.float() / (2 * n)).expand(n)
        d_image, d_text = ctx.backend.clip_block_grads(
            image,
            text,
            scale,
            row_lse,
            col_lse,
            (weight, weight),
            None,
            diag=0,
            need_image=ctx.needs_input_grad[0],
            need_text=ctx.needs_input_grad[1],
        )
        shape, dtype = ctx.scale_meta
        return (
            None if d_image is None else d_image.to(image.dtype),
            None if d_text is None else d_text.to(text.dtype),
            (grad * d_scale).reshape(shape).to(dtype),
            None,
        )


def clip_loss_fused(image, text, logit_scale, backend) -> torch.Tensor:
    return _FusedClipLoss.apply(image, text, logit_scale, backend)


def check_features(image: torch.Tensor, text: torch.Tensor) -> None:
    if image.dim() != 2 or image.shape != text.shape:
        raise ValueError(
            f"image and text features must both be (batch, dim); got {tuple(image.shape)} and {tuple(text.shape)}"
        )


class ClipLoss(nn.Module):
    """CLIP loss with OpenCLIP's flags and an implementation switch.

    impl: naive | chunked | fused | triton | auto. dist_impl (tiled paths only; naive always uses
    OpenCLIP's all-gather): gather | ring. precision: the fused path's (exact | fast).
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        rank: int = 0,
        world_size: int = 1,
        impl: str = "auto",
        dist_impl: str | None = None,
        precision: str = "exact",
    ):
        super().__init__()
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.rank = rank
        self.world_size = world_size
        self.impl = select.check_impl(impl)
        self.dist_impl = check_dist_impl(dist_impl, CLIP)
        self.precision = select.check_precision(precision)

    def naive_logits(self, batch: int) -> int:
        """How many logits OpenCLIP's loss builds on this rank for a local batch."""
        rows = batch * self.world_size
        return 2 * batch * rows if self.local_loss and self.world_size > 1 else rows * rows

    def forward(self, image_features, text_features, logit_scale, logit_bias=None):
        check_features(image_features, text_features)
        impl = select.resolve_impl(
            self.impl,
            image_features,
            "clip",
            self.naive_logits(image_features.shape[0]),
            self.precision,
            naive_ok=self.dist_impl in CLIP.naive_dist_impls,
        )
        if impl == "naive":
            loss = clip_loss_naive(
                image_features,
                text_features,
                logit_scale,
                self.local_loss,
                self.gather_with_grad,
                self.rank,
                self.world_size,
            )
        elif self.world_size > 1:
            loss = clip_loss_distributed(
                image_features,
                text_features,
                logit_scale,
                local_loss=self.local_loss,
                gather_with_grad=self.gather_with_grad,
                rank=self.rank,
                world_size=self.world_size,
                dist_impl=self.dist_impl,
                backend=select.backend_for(impl, self.precision),
            )
        else:
            loss = clip_loss_fused(image_features, text_features, logit_scale, select.backend_for(impl, self.precision))
        if logit_bias is not None:
            # A constant shift leaves every softmax unchanged: the bias gradient is exactly zero,
            # but keeping the bias in the graph spares DDP an "unused parameter" error.
            loss = loss + 0.0 * logit_bias.sum()
        return loss

    def extra_repr(self) -> str:
        return (
            f"impl={self.impl}, precision={self.precision}, dist_impl={self.dist_impl}, local_loss={self.local_loss}, "
            f"gather_with_grad={self.gather_with_grad}, rank={self.rank}, world_size={self.world_size}"
        )


def _build_clip_loss(cfg: LossConfig, rank: int, world_size: int) -> ClipLoss:
    return ClipLoss(
        cfg.local_loss, cfg.gather_with_grad, rank, world_size, cfg.loss_impl, cfg.loss_dist_impl, cfg.loss_precision
    )


# gather: all-gather features, reduce-scatter gradients; ring: features travel rank to rank.
CLIP_DIST_IMPLS = ("gather", "ring")
CLIP = LOSSES.register(
    "clip",
    LossFamily(
        _build_clip_loss,
        CLIP_DIST_IMPLS,
        "the CLIP loss",
        flags=("local_loss", "gather_with_grad"),
        naive_dist_impls=("gather",),  # OpenCLIP's loss all-gathers the features
        model_init={"init_logit_scale": math.log(1 / 0.07), "init_logit_bias": None},  # OpenAI CLIP's temperature
    ),
    help="CLIP's softmax contrastive loss (OpenCLIP's default)",
)
