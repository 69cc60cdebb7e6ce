"""Distillation from a frozen teacher (OpenCLIP's --distill-model / --distill-pretrained, DistillClipLoss).

The loss is the student's CLIP loss plus OpenCLIP's distillation term: the cross-entropy of the student's
softmax over each row of its logits against the teacher's softmax over the same row, for the image rows and the
text rows, averaged:

    distill = (H(softmax(T_img), log_softmax(S_img)) + H(softmax(T_txt), log_softmax(S_txt))) / 2

where S and T are the student's and the teacher's logits as OpenCLIP's ClipLoss.get_logits builds them (each
with its own features and logit scale; gathered across ranks with --local-loss / --gather-with-grad meaning what
they mean for the CLIP loss). The contrastive part is bigclip's CLIP loss with the run's --loss-impl. The
distillation term follows it: `naive` materialises the logits (B x B_global with --local-loss, B_global x
B_global without), as OpenCLIP's does; every other implementation computes it exactly in blocks of rows
(`_SoftCrossEntropyRows`: float32, at most ROW_BLOCK_ELEMENTS logits of each model at a time, recomputed in the
backward), so the term never holds the whole matrix either.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from bigclip.loss import select
from bigclip.loss.clip import clip_logits
from bigclip.loss.collectives import gather_features

# Logits per block of rows in the blocked term (per model): 4M float32 values, 16 MB.
ROW_BLOCK_ELEMENTS = 1 << 22


class TeacherOutputs(NamedTuple):
    """What the loss needs of the teacher's forward on the same batch (no gradient)."""

    image_features: torch.Tensor
    text_features: torch.Tensor
    logit_scale: torch.Tensor


def soft_cross_entropy(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """OpenCLIP's DistillClipLoss.dist_loss: mean over rows of -sum_j softmax(teacher)_j log_softmax(student)_j."""
    return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean(dim=0)


def distill_term(
    image: torch.Tensor,
    text: torch.Tensor,
    logit_scale: torch.Tensor,
    teacher: TeacherOutputs,
    local_loss: bool = False,
    gather_with_grad: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> torch.Tensor:
    student_per_image, student_per_text = clip_logits(
        image, text, logit_scale, local_loss, gather_with_grad, rank, world_size
    )
    with torch.no_grad():
        teacher_per_image, teacher_per_text = clip_logits(
            teacher.image_features, teacher.text_features, teacher.logit_scale, local_loss, False, rank, world_size
        )
    return (
        soft_cross_entropy(teacher_per_image, student_per_image)
        + soft_cross_entropy(teacher_per_text, student_per_text)
    ) / 2


class _SoftCrossEntropyRows(torch.autograd.Function):
    """mean_i [logsumexp_j s_ij - sum_j p_ij s_ij] with s = scale * a @ b.T and p = softmax_j(t_scale * ta @ tb.T),
    which is soft_cross_entropy(teacher logits, student logits), one block of rows at a time, in float32 (outside
    any autocast region). The gradient of a row's term with respect to its logits is softmax(s_i) - p_i; the
    backward recomputes each block."""

    @staticmethod
    def forward(ctx, a, b, scale, ta, tb, t_scale):
        ctx.save_for_backward(a, b, scale, ta, tb, t_scale)
        with torch.autocast(a.device.type, enabled=False):
            total = torch.zeros((), dtype=torch.float32, device=a.device)
            for s, p, _x, _start, _a in _blocks(a, b, scale, ta, tb, t_scale):
                total += (s.logsumexp(dim=1) - (p * s).sum(dim=1)).sum()
        return total / a.shape[0]

    @staticmethod
    def backward(ctx, grad):
        a, b, scale, ta, tb, t_scale = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        with torch.autocast(a.device.type, enabled=False):
            weight = grad.float() / a.shape[0]
            s_scale = scale.float().reshape(())
            d_a = torch.empty(a.shape, dtype=torch.float32, device=a.device) if need_a else None
            d_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None
            d_scale = torch.zeros((), dtype=torch.float32, device=a.device)
            b32 = b.float()
            for s, p, x, start, a_block in _blocks(a, b, scale, ta, tb, t_scale):
                g = (s.softmax(dim=1) - p) * weight  # d loss / d s for these rows
                d_scale += (g * x).sum()
                if d_a is not None:
                    d_a[start : start + len(a_block)] = s_scale * (g @ b32)
                if d_b is not None:
                    d_b += s_scale * (g.T @ a_block)
        return (
            None if d_a is None else d_a.to(a.dtype),
            None if d_b is None else d_b.to(b.dtype),
            d_scale.reshape(scale.shape).to(scale.dtype),
            None,
            None,
            None,
        )


def _blocks(a, b, scale, ta, tb, t_scale):
    """Per block of rows: (student logits s, teacher probabilities p, unscaled student logits x, first row, the
    block of a), all float32."""
    rows = _rows_per_block(b.shape[0])
    s_scale, t_scale32 = scale.detach().float().reshape(()), t_scale.detach().float().reshape(())
    b32, tb32 = b.detach().float(), tb.detach().float()
    for start in range(0, a.shape[0], rows):
        a_block = a[start : start + rows].detach().float()
        x = a_block @ b32.T
        p = (t_scale32 * (ta[start : start + rows].detach().float() @ tb32.T)).softmax(dim=1)
        yield s_scale * x, p, x, start, a_block


def _rows_per_block(columns: int) -> int:
    return max(1, ROW_BLOCK_ELEMENTS // max(1, columns))


def distill_term_blocked(
    image: torch.Tensor,
    text: torch.Tensor,
    logit_scale: torch.Tensor,
    teacher: TeacherOutputs,
    local_loss: bool = False,
    gather_with_grad: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> torch.Tensor:
    """distill_term without the logit matrices: the same rows and columns, gathered the same way."""
    t_image, t_text, t_scale = (t.detach() for t in teacher)
    if world_size > 1:
        all_image, all_text = gather_features(image, text, local_loss, gather_with_grad, rank, world_size)
        t_all_image, t_all_text = gather_features(t_image, t_text, local_loss, False, rank, world_size)
        if local_loss:
            per_image = (image, all_text, t_image, t_all_text)
            per_text = (text, all_image, t_text, t_all_image)
        else:
            per_image = (all_image, all_text, t_all_image, t_all_text)
            per_text = (all_text, all_image, t_all_text, t_all_image)
    else:
        per_image, per_text = (image, text, t_image, t_text), (text, image, t_text, t_image)
    a, b, ta, tb = per_image
    by_image = _SoftCrossEntropyRows.apply(a, b, logit_scale, ta, tb, t_scale)
    a, b, ta, tb = per_text
    by_text = _SoftCrossEntropyRows.apply(a, b, logit_scale, ta, tb, t_scale)
    return (by_image + by_text) / 2


class DistillClipLoss(nn.Module):
    """The CLIP loss (any implementation) plus the distillation term; called with the teacher's outputs. `parts`:
    the two terms of the last call (detached), which the training loop logs beside the loss."""

    def __init__(
        self,
        contrastive: nn.Module,
        local_loss: bool,
        gather_with_grad: bool,
        rank: int,
        world_size: int,
        impl: str = "auto",
    ):
        super().__init__()
        self.contrastive = contrastive
        self.impl = select.check_impl(impl)
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.rank = rank
        self.world_size = world_size

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, teacher: TeacherOutputs = None):
        if teacher is None:
            raise ValueError("the distillation loss needs the teacher's outputs on the same batch")
        contrastive = self.contrastive(image_features, text_features, logit_scale, logit_bias)
        distill = self.distill(image_features, text_features, logit_scale, teacher)
        # the two terms of the last call, for the log lines and records (OpenCLIP logs them by these names)
        self.parts = {"contrastive_loss": contrastive.detach(), "distill_loss": distill.detach()}
        return contrastive + distill

    def distill(self, image_features, text_features, logit_scale, teacher: TeacherOutputs) -> torch.Tensor:
        naive = select.resolve_impl(self.impl, image_features) == "naive"
        return (distill_term if naive else distill_term_blocked)(
            image_features,
            text_features,
            logit_scale,
            teacher,
            self.local_loss,
            self.gather_with_grad,
            self.rank,
            self.world_size,
        )
