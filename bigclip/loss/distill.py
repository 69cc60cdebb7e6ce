"""Distillation from a frozen teacher (OpenCLIP's --distill-model / --distill-pretrained, DistillClipLoss).

The loss is the student's CLIP loss plus OpenCLIP's distillation term: the cross-entropy of the student's
softmax over each row of its logits against the teacher's softmax over the same row, for the image rows and the
text rows, averaged:

    distill = (H(softmax(T_img), log_softmax(S_img)) + H(softmax(T_txt), log_softmax(S_txt))) / 2

where S and T are the student's and the teacher's logits as OpenCLIP's ClipLoss.get_logits builds them (each
with its own features and logit scale; gathered across ranks with --local-loss / --gather-with-grad meaning what
they mean for the CLIP loss). The contrastive part is bigclip's CLIP loss with the run's --loss-impl; the
distillation term materialises the logits (B x B_global with --local-loss), as OpenCLIP's does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from bigclip.loss.clip import clip_logits


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


class DistillClipLoss(nn.Module):
    """The CLIP loss (any implementation) plus the distillation term; called with the teacher's outputs."""

    def __init__(self, contrastive: nn.Module, local_loss: bool, gather_with_grad: bool, rank: int, world_size: int):
        super().__init__()
        self.contrastive = contrastive
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.rank = rank
        self.world_size = world_size

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, teacher: TeacherOutputs = None):
        if teacher is None:
            raise ValueError("the distillation loss needs the teacher's outputs on the same batch")
        contrastive = self.contrastive(image_features, text_features, logit_scale, logit_bias)
        return contrastive + self.distill(image_features, text_features, logit_scale, teacher)

    def distill(self, image_features, text_features, logit_scale, teacher: TeacherOutputs) -> torch.Tensor:
        return distill_term(
            image_features,
            text_features,
            logit_scale,
            teacher,
            self.local_loss,
            self.gather_with_grad,
            self.rank,
            self.world_size,
        )
