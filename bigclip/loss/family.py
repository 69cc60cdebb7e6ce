"""Loss families: the registry of contrastive losses (CLIP's softmax, SigLIP's sigmoid, ...) and the slice of
the config a loss is built from.

A family is one registered name (--loss; OpenCLIP's --siglip selects "siglip") with everything that differs
between families in one place: how the loss module is built, which feature exchanges between ranks it offers
(--loss-dist-impl), and where the model's logit scale and bias start (OpenCLIP's init_logit_scale /
init_logit_bias, which the model factory takes). Each family's module registers itself here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from bigclip.errors import UserError
from bigclip.flag_fields import LOSS, flag, non_negative_number
from bigclip.loss.select import LOSS_IMPLS, LOSS_PRECISIONS
from bigclip.registry import Registry

# --loss NAME -> its LossFamily; each family's module registers itself (loss/__init__.py imports them).
LOSSES: Registry[LossFamily] = Registry("--loss")


@dataclass(frozen=True)
class LossConfig:
    """The loss flags (OpenCLIP's names, plus --loss and --loss-impl)."""

    local_loss: bool = flag(False, "Local features against gathered ones (O(n) logits per rank).", LOSS)
    gather_with_grad: bool = flag(False, "Gradients flow through the feature all-gather.", LOSS)
    loss: str = flag(
        "clip", "The contrastive loss family (new in bigclip; --siglip selects siglip).", LOSS, choices=LOSSES
    )
    siglip: bool = flag(
        False, "Sigmoid loss (logit scale init log 10, bias -10): OpenCLIP's name for --loss siglip.", LOSS
    )
    loss_dist_impl: str | None = flag(
        None,
        "How features move between ranks: gather (default) or ring for clip; bidir (default), shift, reduce or "
        "gather for siglip.",
        LOSS,
    )
    loss_impl: str = flag(
        "auto",
        "naive, chunked, fused, triton or auto: on a GPU the naive loss where measured faster and it fits, fused "
        "otherwise; chunked on CPU (new in bigclip).",
        LOSS,
        choices=LOSS_IMPLS,
    )
    loss_precision: str = flag(
        "exact",
        "The fused loss's arithmetic: exact (every result within the chunked loss's bounds) or fast (TF32 for fp32 "
        "features; bf16 / fp16 dL/dlogits rounded once before its matmuls) (new in bigclip).",
        LOSS,
        choices=LOSS_PRECISIONS,
    )
    coca_contrastive_loss_weight: float = flag(
        1.0, "CoCa: weight of the contrastive term (0 drops it).", LOSS, check=non_negative_number
    )
    coca_caption_loss_weight: float = flag(2.0, "CoCa: weight of the caption term.", LOSS, check=non_negative_number)
    # read here, owned by another slice (its flag is declared there)
    distill_model: str | None = None  # a teacher: the CLIP loss plus OpenCLIP's distillation term
    # decided for the loss by the model (config/sections.py): the model captions (CoCa), so the loss adds
    # OpenCLIP's caption term; None: not known yet (an hf-hub: config the hub cache lacks, decided once fetched)
    captioning: bool | None = False
    # decided by the run: the device type the loss runs on (what --loss-impl auto picks there)
    device_type: str = "cuda"


@dataclass(frozen=True)
class LossFamily:
    build: Callable[[LossConfig, int, int], nn.Module]  # (config, rank, world size) -> loss module
    dist_impls: tuple[str, ...]  # --loss-dist-impl choices; the first is the default
    described_as: str  # how error lines name it: "the CLIP loss"
    model_init: dict[str, Any] = field(default_factory=dict)  # create_model kwargs: init_logit_scale/bias
    selected_by: tuple[str, ...] = ()  # flags (config field names) that select it without --loss (--siglip)
    # flags only this family reads (CLIP: --local-loss, --gather-with-grad): refused under the others
    flags: tuple[str, ...] = ()
    # the exchanges its naive loss (--loss-impl naive, OpenCLIP's reference) makes; None: every one it offers
    naive_dist_impls: tuple[str, ...] | None = None


def check_dist_impl(dist_impl: str | None, family: LossFamily) -> str:
    """The feature exchange between ranks: the family's default, or one it offers."""
    if dist_impl is None:
        return family.dist_impls[0]
    if dist_impl not in family.dist_impls:
        raise UserError(
            f"--loss-dist-impl {dist_impl!r}: choose one of {', '.join(family.dist_impls)} for {family.described_as}"
        )
    return dist_impl
