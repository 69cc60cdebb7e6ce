"""Contrastive losses (CLIP softmax, SigLIP sigmoid) that never build the global logit matrix.

    loss = build_loss(LossConfig(loss="siglip", loss_impl="chunked"), rank, world_size)
    value = loss(image_features, text_features, logit_scale, logit_bias=None)

--loss names a family registered in LOSSES (loss/family.py; each family's module registers itself and is
imported here). --loss-impl: naive (OpenCLIP's reference), chunked (exact tiled torch), fused (cuBLAS
chunks + fused Triton kernels, loss/fused.py), triton (fully fused Triton tiles), auto (on CUDA the naive loss
where measured faster and it fits, fused otherwise; chunked elsewhere). --loss-precision: the fused path's
arithmetic (exact | fast). --loss-dist-impl: the family's exchanges between ranks (gather | ring for CLIP,
bidir | shift | reduce | gather for SigLIP).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from bigclip.errors import UserError
from bigclip.flag_fields import idle
from bigclip.loss.caption import CaptionLoss
from bigclip.loss.clip import CLIP, CLIP_DIST_IMPLS, ClipLoss
from bigclip.loss.distill import DistillClipLoss, TeacherOutputs
from bigclip.loss.family import LOSSES, LossConfig, LossFamily, check_dist_impl
from bigclip.loss.select import LOSS_IMPLS, LOSS_PRECISIONS, check_impl, check_precision
from bigclip.loss.siglip import SIGLIP_DIST_IMPLS, SigLipLoss

__all__ = [
    "CaptionLoss",
    "ClipLoss",
    "DistillClipLoss",
    "TeacherOutputs",
    "SigLipLoss",
    "LossConfig",
    "LossFamily",
    "LOSSES",
    "build_loss",
    "check_loss",
    "loss_family",
    "LOSS_IMPLS",
    "LOSS_PRECISIONS",
    "CLIP_DIST_IMPLS",
    "SIGLIP_DIST_IMPLS",
]


def loss_family(cfg: LossConfig) -> LossFamily:
    return LOSSES.get(cfg.loss)


def check_loss(cfg: LossConfig) -> None:
    """The loss flags' rules, before any work: a registered family, an implementation, and an exchange the
    family offers."""
    family = loss_family(cfg)
    check_impl(cfg.loss_impl)
    if check_precision(cfg.loss_precision) != "exact" and cfg.loss_impl not in ("fused", "auto"):
        raise UserError(
            f"--loss-precision {cfg.loss_precision}: only the fused loss has another arithmetic; use --loss-impl "
            f"fused (or auto) or drop --loss-precision (--loss-impl {cfg.loss_impl} is always exact)"
        )
    if check_precision(cfg.loss_precision) != "exact" and cfg.loss_impl == "auto" and cfg.device_type != "cuda":
        raise UserError(
            f"--loss-precision {cfg.loss_precision}: on the CPU --loss-impl auto is the chunked loss, which is always "
            f"exact; drop the flag"
        )
    dist_impl = check_dist_impl(cfg.loss_dist_impl, family)
    if cfg.loss_impl == "naive" and family.naive_dist_impls is not None and dist_impl not in family.naive_dist_impls:
        raise UserError(
            f"--loss-dist-impl {dist_impl}: --loss-impl naive (OpenCLIP's {family.described_as.removeprefix('the ')}) "
            f"exchanges by {' or '.join(family.naive_dist_impls)} only; use --loss-impl chunked (or fused) or drop "
            f"the flag"
        )
    for name, other in LOSSES.items():
        for flag_name in other.flags if other is not family else ():
            if getattr(cfg, flag_name) and flag_name not in family.flags:
                idle(
                    flag_name,
                    f"only applies to {other.described_as} (--loss {name}); this run trains with {family.described_as}",
                )
    if cfg.captioning is False:  # known not to caption (None: an hf-hub: config not fetched yet)
        for f in dataclasses.fields(cfg):
            if f.name.startswith("coca_") and getattr(cfg, f.name) != f.default:
                idle(f.name, "only applies to a captioning model (CoCa)")
    if cfg.distill_model is not None and family is not CLIP:
        # OpenCLIP would silently train this model with the CLIP loss instead of its own.
        raise UserError(
            f"--distill-model: distillation adds to the CLIP loss (OpenCLIP's DistillClipLoss), not to "
            f"{family.described_as}; drop --distill-model or --loss/--siglip"
        )
    if cfg.captioning and family is not CLIP:
        # OpenCLIP would silently train a CoCa with the CLIP loss's contrastive term instead of this family's.
        raise UserError(f"--model: CoCa's loss adds its caption term to the CLIP loss, not to {family.described_as}")
    if cfg.captioning and cfg.distill_model is not None:
        raise UserError("--distill-model: distillation is for CLIP models; a CoCa model trains with its own loss")


def build_loss(cfg: LossConfig, rank: int = 0, world_size: int = 1) -> nn.Module:
    """The loss module for these flags; with a teacher (--distill-model) it also takes the teacher's outputs, for a
    captioning model (CoCa) the caption logits and labels."""
    loss = loss_family(cfg).build(cfg, rank, world_size)
    if cfg.captioning:
        return CaptionLoss(loss, cfg.coca_contrastive_loss_weight, cfg.coca_caption_loss_weight)
    if cfg.distill_model is not None:
        return DistillClipLoss(loss, cfg.local_loss, cfg.gather_with_grad, rank, world_size, cfg.loss_impl)
    return loss
