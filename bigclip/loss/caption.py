"""CoCa's loss (OpenCLIP's CoCaLoss): a weighted contrastive term plus a weighted caption term.

    loss = coca_contrastive_loss_weight * contrastive + coca_caption_loss_weight * caption

The contrastive term is the run's CLIP loss (any --loss-impl, across ranks as the flags say). The caption term is
the cross-entropy of the decoder's next-token logits against the labels (the text shifted by one), averaged over
the tokens that are not padding, on each rank's own batch (OpenCLIP's: nothing is gathered for it). With
--accum-freq the loop hands it every micro-batch's logits and labels, so it is the mean over the whole
accumulated batch, as OpenCLIP's accumulation computes it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CaptionLoss(nn.Module):
    """The contrastive loss module (built by its family) plus the caption term. `model_outputs`: the model's
    outputs besides the features that the loop must hand over (and cache across micro-batches); `parts`: the two
    terms of the last call (detached), which the loop logs beside the loss (OpenCLIP's names)."""

    model_outputs = ("logits", "labels")

    def __init__(self, contrastive: nn.Module, contrastive_weight: float, caption_weight: float, pad_id: int = 0):
        super().__init__()
        self.contrastive = contrastive
        self.contrastive_weight = contrastive_weight
        self.caption_weight = caption_weight
        self.pad_id = pad_id

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, *, logits, labels):
        if self.contrastive_weight:
            contrastive = self.contrastive_weight * self.contrastive(
                image_features, text_features, logit_scale, logit_bias
            )
        else:  # OpenCLIP's: no contrastive term at all (the logit scale gets no gradient)
            contrastive = torch.zeros((), device=logits.device)
        caption = self.caption_weight * caption_loss(logits, labels, self.pad_id)
        self.parts = {"contrastive_loss": contrastive.detach(), "caption_loss": caption.detach()}
        return contrastive + caption


def caption_loss(logits: torch.Tensor, labels: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not padding: logits (B, L, vocab), labels (B, L)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=pad_id)
