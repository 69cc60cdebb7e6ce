"""ModelConfig: the slice of the flags the model factory reads, and their rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bigclip.errors import UserError
from bigclip.model.pretrained import check_pretrained, check_pretrained_image
from bigclip.model.registry import get_model_config, is_schema_name, list_models
from bigclip.model.switchback import SWITCHBACK_VARIANTS

# OpenCLIP families whose towers bigclip does not build yet: named as such, not as unknown architectures.
NOT_YET_BUILT = ("convnext", "coca", "EVA", "mt5", "xlm")


@dataclass(frozen=True)
class ModelConfig:
    """The model flags (OpenCLIP's names), and where the loss family wants the logit scale and bias to start."""

    model: str = "RN50"
    pretrained: str | None = None
    pretrained_image: bool = False
    force_image_size: list[int] | None = None
    force_context_length: int | None = None
    force_patch_dropout: float | None = None
    force_quick_gelu: bool = False
    layer_scale_init: float | None = None
    use_bnb_linear: str | None = None
    cache_dir: str | None = None
    init: dict[str, Any] = field(default_factory=dict)  # the loss family's model_init (init_logit_scale/bias)

    @property
    def image_size(self) -> int | tuple[int, int] | None:
        """--force-image-size as create_model takes it: one int, (height, width), or None."""
        size = self.force_image_size
        return size[0] if size is not None and len(size) == 1 else (tuple(size) if size else None)


def check_model(cfg: ModelConfig) -> None:
    """The model flags' rules, before any work: a known architecture (OpenCLIP's local-dir:/hf-hub: configs there
    and well formed), weights that exist, overrides in range."""
    models = list_models()
    if is_schema_name(cfg.model):
        get_model_config(cfg.model, cfg.cache_dir)  # OpenCLIP's open_clip_config.json: there and well formed
        models = [*models, cfg.model]
    if cfg.model not in models and cfg.model.startswith(NOT_YET_BUILT):
        raise UserError(
            f"--model {cfg.model}: not supported yet (bigclip builds ViT, ResNet and timm image towers); "
            f"choose one of {', '.join(models)}"
        )
    if cfg.model not in models:
        raise UserError(f"--model {cfg.model!r}: unknown architecture; choose one of {', '.join(models)}")
    if cfg.use_bnb_linear is not None:
        SWITCHBACK_VARIANTS.entry(cfg.use_bnb_linear)
    if cfg.layer_scale_init is not None and (
        isinstance(cfg.layer_scale_init, bool)
        or not isinstance(cfg.layer_scale_init, (int, float))
        or not math.isfinite(cfg.layer_scale_init)
    ):
        raise UserError(
            f"--layer-scale-init {cfg.layer_scale_init!r}: must be a finite number (0 for zero-init layer scale)"
        )
    size = cfg.force_image_size
    if size is not None and (len(size) not in (1, 2) or min(size) < 1):
        raise UserError(f"--force-image-size {size!r}: give one or two positive integers")
    if cfg.pretrained:
        check_pretrained(cfg.model, cfg.pretrained)
    if cfg.pretrained_image:
        check_pretrained_image(cfg.model, cfg.cache_dir)
