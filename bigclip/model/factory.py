"""Build models: `create_model` makes the architecture a name stands for (model/registry.py says where its
config comes from: a built-in JSON file, OpenCLIP's local-dir:DIR or hf-hub:ORG/NAME), `get_tokenizer` its
tokenizer.

Models are always constructed on the meta device first (no memory, seconds even for
ViT-bigG-14), then materialised on the target device and initialised once, or left on meta
for an engine to shard, materialise and initialise itself.
"""

from __future__ import annotations

import math
import os

import torch

from bigclip.errors import UserError
from bigclip.model import fp8_linear as fp8_linear_module
from bigclip.model import switchback, zoo
from bigclip.model.clip import CLIP, DEFAULT_INIT_LOGIT_SCALE
from bigclip.model.coca import CoCa
from bigclip.model.meta_build import meta_construction
from bigclip.model.pretrained import model_weights, resolve_pretrained_image, timm_model_name
from bigclip.model.registry import (
    CONFIG_DIR,
    PREPROCESS_KEYS,
    QUICKGELU_SUFFIX,
    _load_configs,
    get_model_config,
    is_schema_name,
    list_models,
    openclip_separate_text,
    preprocess_cfg,
)
from bigclip.model.tokenizer import (
    DEFAULT_CONTEXT_LENGTH,
    OPENCLIP_VOCAB_SIZE,
    ByteTokenizer,
    known_vocab_size,
    openclip_tokenizer,
    tokenizer_at_hand,
)
from bigclip.model.towers import image_tower_kind
from bigclip.model.weights import load_pretrained

# Re-exported: callers that knew them here keep working (the registry lives in model/registry.py).
__all__ = [
    "CONFIG_DIR",
    "OPENCLIP_VOCAB_SIZE",
    "QUICKGELU_SUFFIX",
    "_load_configs",
    "create_model",
    "get_model_config",
    "get_tokenizer",
    "list_models",
    "load_pretrained",
    "preprocess_cfg",
    "uses_byte_tokenizer",
]
_PREPROCESS_KEYS = PREPROCESS_KEYS


def uses_byte_tokenizer(model_name: str, cache_dir: str | None = None) -> bool:
    """Whether the architecture asks for bigclip's byte tokenizer ("tokenizer": "byte" in its config: test-tiny
    and the offline demo) instead of OpenCLIP's tokenizers."""
    return get_model_config(model_name, cache_dir).get("tokenizer") == "byte"


def get_tokenizer(model_name: str, context_length: int | None = None, cache_dir: str | None = None):
    """A callable (str | list[str]) -> LongTensor (N, context_length) for `model_name`.

    Architectures get what open_clip.get_tokenizer gives for them (model/tokenizer.py: OpenCLIP's BPE vocabulary
    with its cleaning, start/end tokens and truncation; the Hugging Face tokenizer a text_cfg names, SigLIP's
    included), so token ids are the ones OpenCLIP weights were trained on; local-dir: and hf-hub: names get what
    open_clip.get_tokenizer makes of the same name. cache_dir: the hub cache. context_length
    (--force-context-length) overrides the architecture's. A tokenizer that cannot be had is one line naming what
    to fetch."""
    cfg = get_model_config(model_name, cache_dir)
    if cfg.get("tokenizer") == "byte":
        return ByteTokenizer(context_length or cfg["text_cfg"].get("context_length", DEFAULT_CONTEXT_LENGTH))
    # (OpenCLIP main's tiktoken tokenizer: open_clip_torch 3.3 has none, for a local-dir: name either)
    if not is_schema_name(model_name) or cfg["text_cfg"].get("tokenizer_type") == "tiktoken":
        return openclip_tokenizer(model_name, cfg, context_length, cache_dir)
    # open_clip takes seconds to import; only runs that tokenize with its tokenizers need it.
    import open_clip

    length = context_length or cfg["text_cfg"].get("context_length", DEFAULT_CONTEXT_LENGTH)
    what = f"its tokenizer {cfg['text_cfg'].get('hf_tokenizer_name') or 'OpenCLIP BPE'}"
    remedy = f"fetch it where the hub is reachable (`bigclip fetch --model {model_name}`, same --cache-dir)"
    with tokenizer_at_hand(model_name, what, remedy):
        return open_clip.get_tokenizer(model_name, context_length=length, cache_dir=cache_dir)


def use_int8_linears(model: CLIP, variant: str, name: str) -> None:
    """Swap the transformer blocks' MLP linears for `variant` in place (before any engine wraps the model). The
    variant name is checked where the flag is validated (config) and by replace_linears."""
    swapped = sum(switchback.replace_linears(block, variant) for block in model.transformer_blocks())
    if not swapped:
        raise UserError(f"--use-bnb-linear {variant}: --model {name} has no transformer MLP linear layer to replace")


def use_fp8_linears(model: CLIP, recipe: str, name: str) -> None:
    """Swap the transformer blocks' MLP linears for torchao's Float8Linear (`recipe`) in place, before any engine
    wraps the model."""
    if not sum(fp8_linear_module.replace_linears_fp8(block, recipe) for block in model.transformer_blocks()):
        raise UserError(
            f"--use-fp8-linear {recipe}: --model {name} has no transformer MLP linear layer whose widths are "
            f"multiples of 16"
        )


def create_model(
    name: str,
    *,
    image_size: int | tuple[int, int] | None = None,
    context_length: int | None = None,
    patch_dropout: float | None = None,
    quick_gelu: bool = False,
    custom_text: bool = False,
    init_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
    layer_scale_init: float | None = None,
    int8_linear: str | None = None,
    fp8_linear: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    pretrained: str | os.PathLike | None = None,
    pretrained_image: bool | str | os.PathLike = False,
    load_weights: bool = True,
    cache_dir: str | None = None,
    init: bool = True,
) -> CLIP:
    """Build architecture `name`: a built-in, local-dir:DIR or hf-hub:ORG/NAME (cache_dir: the hub cache).

    device="meta" returns an unmaterialised model (for engines that shard before
    materialising; they call `to_empty()` then `init_weights()`). `init=False` skips
    initialisation on a real device (weights are uninitialised memory). `pretrained` is a
    local .pt/.safetensors state dict, bigclip's or OpenCLIP's layout, loaded strictly; on meta
    it is checked now and becomes what `init_weights()` fills the model from, shard by shard.

    Without `pretrained`, a local-dir:/hf-hub: name's own weights are loaded when `load_weights` (OpenCLIP's
    default). `pretrained_image` (a timm image tower only): timm's pretrained trunk weights, fetched through
    the hub cache (True) or from a file already fetched; used only when no whole-model weights are loaded,
    as in OpenCLIP.

    `init_logit_scale` / `init_logit_bias` (OpenCLIP's names; the loss family's model_init): where the learned
    temperature starts and, when given, a learned logit bias starting there (SigLIP). None: the config's, as
    OpenCLIP's (SigLIP's configs have a bias; else CLIP's 1/0.07 and no bias).

    `layer_scale_init` (--layer-scale-init) gives every transformer block of both towers LayerScale on both
    residual branches starting at that value (0: zero-init layer scale), replacing the config's ls_init_value;
    None keeps the config's (absent: no layer scale).

    `int8_linear` (--use-bnb-linear): a SwitchBack variant (switchback.VARIANTS) for the MLP linear layers of
    every transformer block of both towers, OpenCLIP's choice of layers (switchback.py says which). The
    parameters stay nn.Linear's, so weights, checkpoints and exports are unchanged.

    `custom_text` (--force-custom-text): bigclip's text tower is separate either way; its exports take the
    layout OpenCLIP gives such a model (CustomTextCLIP: the text tower under `text.`).

    `fp8_linear` (--use-fp8-linear): a torchao.float8 recipe (fp8_linear.FP8_RECIPES) for the same layers;
    refused on a device without fp8 tensor cores.
    """
    cfg = get_model_config(name, cache_dir)
    refused = zoo.refusal(name, cfg)  # a family bigclip has no towers for (OpenCLIP main's audio, NaFlex, ...)
    if refused is not None:
        raise UserError(refused)
    tower = image_tower_kind(cfg["vision_cfg"])
    if pretrained_image and not tower.pretrained_trunk:
        raise UserError(
            f"--pretrained-image: pretrained image towers currently only supported for timm models; "
            f"--model {name} has {tower.described_as}"
        )
    if pretrained is None and load_weights and is_schema_name(name):
        pretrained = model_weights(name, cache_dir)
    vision_cfg = {k: v for k, v in cfg["vision_cfg"].items() if k not in _PREPROCESS_KEYS}
    text_cfg = dict(cfg["text_cfg"])
    multimodal_cfg = dict(cfg["multimodal_cfg"]) if "multimodal_cfg" in cfg else None  # CoCa's caption decoder
    if patch_dropout is not None:
        if not tower.patch_dropout:
            raise UserError(f"--force-patch-dropout: --model {name} has {tower.described_as} (no patches); omit it")
        if not 0.0 <= patch_dropout < 1.0:
            raise UserError(f"--force-patch-dropout {patch_dropout}: must be in [0, 1)")
        vision_cfg["patch_dropout"] = patch_dropout
    if layer_scale_init is not None:
        if not tower.layer_scale:
            raise UserError(
                f"--layer-scale-init: --model {name} has {tower.described_as}, which bigclip does not give layer "
                f"scale; use a ViT architecture or omit it"
            )
        if not math.isfinite(layer_scale_init):
            raise UserError(f"--layer-scale-init {layer_scale_init}: must be a finite number")
        vision_cfg["ls_init_value"] = text_cfg["ls_init_value"] = float(layer_scale_init)
        if multimodal_cfg is not None:
            multimodal_cfg["ls_init_value"] = float(layer_scale_init)
    if context_length is not None:
        if context_length < 2:
            raise UserError(f"--force-context-length {context_length}: must be at least 2 (sot + eot)")
        text_cfg["context_length"] = context_length
    # (a Hugging Face tokenizer's vocabulary is its config's business: it is not read from the hub here)
    tokenizer_vocab = known_vocab_size(name, cfg, is_schema_name(name))
    if "hf_model_name" not in text_cfg and tokenizer_vocab and text_cfg["vocab_size"] < tokenizer_vocab:
        raise UserError(
            f"--model {name}: text vocab_size {text_cfg['vocab_size']} is smaller than the "
            f"tokenizer's {tokenizer_vocab}; raise vocab_size in its config"
        )

    with meta_construction():
        try:
            towers = (vision_cfg, text_cfg) if multimodal_cfg is None else (vision_cfg, text_cfg, multimodal_cfg)
            model = (CLIP if multimodal_cfg is None else CoCa)(
                cfg["embed_dim"],
                *towers,
                quick_gelu=quick_gelu or cfg.get("quick_gelu", False),
                init_logit_scale=cfg.get("init_logit_scale", DEFAULT_INIT_LOGIT_SCALE)
                if init_logit_scale is None
                else init_logit_scale,
                init_logit_bias=cfg.get("init_logit_bias") if init_logit_bias is None else init_logit_bias,
                image_size=image_size,
            )
        except (TypeError, ValueError) as err:  # a config key or value bigclip's towers do not take
            raise UserError(f"--model {name}: this architecture config cannot be built by bigclip ({err})") from None
        model.openclip_separate_text = openclip_separate_text(cfg, custom_text)
        if int8_linear is not None:
            use_int8_linears(model, int8_linear, name)
        if fp8_linear is not None:
            fp8_linear_module.check_fp8_device(device)
            use_fp8_linears(model, fp8_linear, name)
    if pretrained_image and pretrained is None:
        if not isinstance(pretrained_image, (str, os.PathLike)):
            pretrained_image, _ = resolve_pretrained_image(timm_model_name(name, cache_dir), cache_dir)
        model.visual.use_pretrained(pretrained_image)
    if torch.device(device).type == "meta":
        if pretrained is not None:
            model.init_from(pretrained)
        return model if dtype is None else model.to(dtype)

    model.to_empty(device=device)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    elif init:
        model.init_weights()
    if dtype is not None:
        model.to(dtype)
    return model
