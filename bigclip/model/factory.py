"""Model registry: architectures are JSON files in `configs/`; `create_model` builds them.

Models are always constructed on the meta device first (no memory, seconds even for
ViT-bigG-14), then materialised on the target device and initialised once, or left on meta
for an engine to shard, materialise and initialise itself.
"""

from __future__ import annotations

import copy
import json
import os
from functools import cache
from pathlib import Path

import torch

from bigclip.errors import UserError
from bigclip.model.clip import CLIP
from bigclip.model.tokenizer import ByteTokenizer
from bigclip.model.weights import load_pretrained

CONFIG_DIR = Path(__file__).parent / "configs"
# Keys of vision_cfg that describe preprocessing, not the network.
_PREPROCESS_KEYS = ("image_mean", "image_std")
QUICKGELU_SUFFIX = "-quickgelu"


@cache
def _load_configs() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(CONFIG_DIR.glob("*.json"))}


def list_models() -> list[str]:
    return list(_load_configs())


def get_model_config(name: str) -> dict:
    """A copy of the architecture config `name` (OpenCLIP's JSON layout).

    As in OpenCLIP, a `-quickgelu` suffix names the same architecture with QuickGELU.
    """
    configs = _load_configs()
    base = name.removesuffix(QUICKGELU_SUFFIX)
    if base not in configs:
        raise UserError(f"--model {name}: unknown architecture; choose one of {', '.join(configs)}")
    cfg = copy.deepcopy(configs[base])
    if base != name:
        cfg["quick_gelu"] = True
    return cfg


def _square(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    height, width = size
    return (int(height), int(width))


def preprocess_cfg(model_name: str, image_size: int | tuple[int, int] | None = None) -> dict:
    """What the data side needs to build image transforms for `model_name`.

    `size` is (height, width); `image_size` overrides the architecture's (--force-image-size).
    """
    vision = get_model_config(model_name)["vision_cfg"]
    return {
        "size": _square(image_size if image_size is not None else vision["image_size"]),
        "mean": tuple(vision["image_mean"]),
        "std": tuple(vision["image_std"]),
        "interpolation": "bicubic",
        "resize_mode": "shortest",
    }


# OpenCLIP's BPE vocabulary: 49,152 merges + 256 bytes + start/end of text.
OPENCLIP_VOCAB_SIZE = 49408


def uses_byte_tokenizer(model_name: str) -> bool:
    """Whether the architecture asks for bigclip's byte tokenizer ("tokenizer": "byte" in its config: test-tiny
    and the offline demo) instead of OpenCLIP's BPE tokenizer."""
    return get_model_config(model_name).get("tokenizer") == "byte"


def get_tokenizer(model_name: str, context_length: int | None = None):
    """A callable (str | list[str]) -> LongTensor (N, context_length) for `model_name`.

    OpenCLIP architectures get OpenCLIP's own tokenizer (open_clip.get_tokenizer: its BPE vocabulary, text
    cleaning, lower-casing, start/end tokens and truncation), so token ids are the ones OpenCLIP weights
    were trained on. context_length (--force-context-length) overrides the architecture's."""
    length = context_length or get_model_config(model_name)["text_cfg"]["context_length"]
    if uses_byte_tokenizer(model_name):
        return ByteTokenizer(length)
    # open_clip takes seconds to import; only runs that tokenize with its vocabulary need it.
    import open_clip

    if model_name in open_clip.list_models():
        return open_clip.get_tokenizer(model_name, context_length=length)
    return open_clip.SimpleTokenizer(context_length=length)  # a bigclip-only architecture: OpenCLIP's default


def create_model(
    name: str,
    *,
    image_size: int | tuple[int, int] | None = None,
    context_length: int | None = None,
    patch_dropout: float | None = None,
    quick_gelu: bool = False,
    siglip: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    pretrained: str | os.PathLike | None = None,
    init: bool = True,
) -> CLIP:
    """Build architecture `name`.

    device="meta" returns an unmaterialised model (for engines that shard before
    materialising; they call `to_empty()` then `init_weights()`). `init=False` skips
    initialisation on a real device (weights are uninitialised memory). `pretrained` is a
    local .pt/.safetensors state dict, bigclip's or OpenCLIP's layout, loaded strictly; on meta
    it is checked now and becomes what `init_weights()` fills the model from, shard by shard.
    """
    cfg = get_model_config(name)
    vision_cfg = {k: v for k, v in cfg["vision_cfg"].items() if k not in _PREPROCESS_KEYS}
    text_cfg = dict(cfg["text_cfg"])
    if image_size is not None:
        vision_cfg["image_size"] = image_size
    if patch_dropout is not None:
        if not 0.0 <= patch_dropout < 1.0:
            raise UserError(f"--force-patch-dropout {patch_dropout}: must be in [0, 1)")
        vision_cfg["patch_dropout"] = patch_dropout
    if context_length is not None:
        if context_length < 2:
            raise UserError(f"--force-context-length {context_length}: must be at least 2 (sot + eot)")
        text_cfg["context_length"] = context_length
    tokenizer_vocab = ByteTokenizer.vocab_size if cfg.get("tokenizer") == "byte" else OPENCLIP_VOCAB_SIZE
    if text_cfg["vocab_size"] < tokenizer_vocab:
        raise UserError(
            f"--model {name}: text vocab_size {text_cfg['vocab_size']} is smaller than the "
            f"tokenizer's {tokenizer_vocab}; raise vocab_size in its config"
        )

    with torch.device("meta"):
        model = CLIP(
            cfg["embed_dim"],
            vision_cfg,
            text_cfg,
            quick_gelu=quick_gelu or cfg.get("quick_gelu", False),
            siglip=siglip,
        )
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
