"""ModelConfig: the slice of the flags the model factory reads, and their rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bigclip.errors import UserError
from bigclip.flag_fields import MISC, MODEL, TRAIN, flag, optional, positive_int, unit_interval
from bigclip.model import zoo
from bigclip.model.factory import get_tokenizer
from bigclip.model.fp8_linear import FP8_RECIPES, check_fp8_device
from bigclip.model.pretrained import check_pretrained, check_pretrained_image
from bigclip.model.registry import config_at_hand, get_model_config, hub_offline, is_schema_name, list_models
from bigclip.model.switchback import SWITCHBACK_VARIANTS
from bigclip.model.tokenizer import hub_tokenizer


@dataclass(frozen=True)
class ModelConfig:
    """The model flags (OpenCLIP's names), and where the loss family wants the logit scale and bias to start."""

    model: str = flag(
        "RN50",
        "Architecture name (see `bigclip models`), or OpenCLIP's local-dir:DIR / hf-hub:ORG/NAME (an "
        "open_clip_config.json and the weights beside it); the demo uses test-tiny.",
        MODEL,
    )
    pretrained: str | None = flag(
        None,
        "One of OpenCLIP's pretrained tags for --model (fetched through the Hugging Face hub into --cache-dir), "
        "or a local bigclip or OpenCLIP state dict (.pt/.bin/.safetensors).",
        MODEL,
    )
    pretrained_image: bool = flag(
        False,
        "timm's ImageNet weights for a timm image tower's trunk (fetched through the Hugging Face hub into "
        "--cache-dir); whole-model weights (--pretrained, local-dir:/hf-hub: models) replace them.",
        MODEL,
    )
    force_image_size: list[int] | None = flag(
        None, "Override the image size (one or two ints).", MODEL, nargs="+", type=int
    )
    force_context_length: int | None = flag(
        None, "Override the text context length.", MODEL, check=optional(positive_int)
    )
    force_patch_dropout: float | None = flag(
        None, "Override patch dropout (0 disables it).", MODEL, check=optional(unit_interval)
    )
    force_quick_gelu: bool = flag(False, "Use QuickGELU (for weights trained with it).", MODEL)
    force_custom_text: bool = flag(
        False,
        "Separate text tower (OpenCLIP's CustomTextCLIP); bigclip's text tower is always separate, so this changes "
        "only the layout of exports and consolidated checkpoints: the text tower under text.*, as OpenCLIP saves it.",
        MODEL,
    )
    layer_scale_init: float | None = flag(
        None,
        "LayerScale on both residual branches of every transformer block of both towers, starting at this value "
        "(0: zero-init layer scale; new in bigclip). Default: the architecture's own ls_init_value, if any.",
        MODEL,
    )
    use_bnb_linear: str | None = flag(
        None,
        "int8 SwitchBack linear layers for the transformer blocks' MLPs: SwitchBackLinearGlobal, "
        "SwitchBackLinearVectorwise, SwitchBackLinearGlobalMemEfficient or StandardLinear (bigclip's own kernels; "
        "bitsandbytes no longer ships them).",
        TRAIN,
        choices=SWITCHBACK_VARIANTS,
    )
    use_fp8_linear: str | None = flag(
        None,
        "fp8 training (torchao.float8) for the same MLP linear layers as --use-bnb-linear, on GPUs with fp8 "
        "tensor cores (compute capability 8.9+): tensorwise or rowwise scaling (new in bigclip).",
        TRAIN,
        choices=FP8_RECIPES,
    )
    distill_model: str | None = flag(
        None,
        "Teacher architecture for distillation (OpenCLIP's DistillClipLoss: the CLIP loss plus the cross-entropy "
        "of the student's logits against the frozen teacher's, in eval mode); needs --distill-pretrained. The "
        "teacher is placed like the student (FSDP: sharded) and never saved.",
        TRAIN,
    )
    distill_pretrained: str | None = flag(
        None, "The teacher's weights: a pretrained tag of --distill-model or a local state dict.", TRAIN
    )
    cache_dir: str | None = flag(
        None,
        "Hugging Face hub cache for --pretrained tags, hf-hub: models and --pretrained-image "
        "(default: the hub's own, HF_HUB_CACHE).",
        MISC,
    )
    # read here, owned by another slice (its flag is declared there)
    init: dict[str, Any] = field(default_factory=dict)  # the loss family's model_init (init_logit_scale/bias)
    device_type: str = "cpu"  # where the run trains (--device, and whether a GPU is present): fp8 needs one

    @property
    def image_size(self) -> int | tuple[int, int] | None:
        """--force-image-size as create_model takes it: one int, (height, width), or None."""
        size = self.force_image_size
        return size[0] if size is not None and len(size) == 1 else (tuple(size) if size else None)


def captions(cfg: ModelConfig, local_files_only: bool = False) -> bool:
    """Whether --model captions as well as embeds (CoCa: a multimodal_cfg), so its loss has a caption term
    (local_files_only: an hf-hub: config only from the hub cache, UserError where it holds none)."""
    return "multimodal_cfg" in get_model_config(cfg.model, cfg.cache_dir, local_files_only)


def check_model(cfg: ModelConfig) -> None:
    """The model flags' rules, before any work: a known architecture (OpenCLIP's local-dir:/hf-hub: configs there
    and well formed), weights that exist, overrides in range.

    Reads configs without side effects: an hf-hub: config only from the hub cache, never fetched. Where the cache
    does not hold it yet, only the name's form is checked here, and the checks that need the config run again
    where the model is built, once it is fetched (build.py). With downloads off (HF_HUB_OFFLINE), the Hugging Face
    tokenizer a text_cfg names is read from the hub cache here too, so a run without it stops before any work."""
    _check_architecture("--model", cfg.model, cfg.cache_dir)
    if cfg.use_bnb_linear is not None:
        SWITCHBACK_VARIANTS.entry(cfg.use_bnb_linear)
    if cfg.use_fp8_linear is not None:
        FP8_RECIPES.entry(cfg.use_fp8_linear)
        if cfg.use_bnb_linear is not None:
            raise UserError(
                "--use-fp8-linear: the MLP linears are int8 already (--use-bnb-linear); choose one of the two"
            )
        check_fp8_device(cfg.device_type)
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
    if hub_offline() and config_at_hand(cfg.model, cfg.cache_dir):
        # downloads are off: a tokenizer the hub cache lacks stops the run now, not after the model is built
        if hub_tokenizer(cfg.model, get_model_config(cfg.model, cfg.cache_dir, local_files_only=True)):
            get_tokenizer(cfg.model, cache_dir=cfg.cache_dir)  # reads the cache only; one line where it lacks it
    if cfg.pretrained:
        check_pretrained(cfg.model, cfg.pretrained)
    if cfg.pretrained_image and config_at_hand(cfg.model, cfg.cache_dir):
        check_pretrained_image(cfg.model, cfg.cache_dir, local_files_only=True)
    if (cfg.distill_model is None) != (cfg.distill_pretrained is None):
        given, missing = (
            ("--distill-model", "--distill-pretrained") if cfg.distill_pretrained is None else
            ("--distill-pretrained", "--distill-model")
        )  # fmt: skip
        raise UserError(f"{given}: distillation needs the teacher's {missing} too (OpenCLIP ignores one alone)")
    if cfg.distill_model is not None:
        _check_architecture("--distill-model", cfg.distill_model, cfg.cache_dir)
        check_pretrained(cfg.distill_model, cfg.distill_pretrained, "--distill-pretrained", "--distill-model")


def _check_architecture(flag: str, name: str, cache_dir: str | None) -> None:
    models = list_models()
    if is_schema_name(name):
        if config_at_hand(name, cache_dir):  # else the form of its name only (checked by config_at_hand)
            get_model_config(name, cache_dir, local_files_only=True)  # open_clip_config.json: there, well formed
        models = [*models, name]
    if name not in models:
        raise UserError(f"{flag} {name!r}: unknown architecture; choose one of {', '.join(models)}")
    if config_at_hand(name, cache_dir):
        refused = zoo.refusal(name, get_model_config(name, cache_dir, local_files_only=True), flag)
        if refused is not None:  # a family bigclip has no towers for: said now, not when the model is built
            raise UserError(refused)
