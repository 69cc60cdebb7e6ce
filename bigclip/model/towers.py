"""Image tower kinds: which tower an architecture's vision_cfg (OpenCLIP's layout) describes, and what that kind
of tower can do.

OpenCLIP picks the tower from the config's keys (timm_model_name: a timm trunk; a list of stage depths: a
ResNet; otherwise a ViT). Here each kind is registered in IMAGE_TOWERS with the rule that claims a config,
how it is built, and which model options it honours, so the factory asks the kind instead of testing keys.
Every tower offers: forward(images) -> (B, embed_dim); image_size (height, width); width; blocks (the units
engines shard and checkpoint); set_grad_checkpointing(every); init_weights(); lock(groups, bn_stats);
activation_shape() (layers, tokens, width, MLP ratio for the memory plan, or None when not a transformer);
description (what it is, for messages).

To add a kind: a tower class in its own file, and one register() call below.

Text towers are chosen the same way from the text_cfg (TEXT_TOWERS): OpenCLIP's `hf_model_name` means a Hugging
Face model (hf_text.py); `text_arch` "modern" OpenCLIP main's modern text transformer (modern_text.py); otherwise
bigclip's text transformer (text.py). Every text tower offers forward(tokens)
-> (B, embed_dim) (with output_tokens, also the token states), width, context_length, blocks,
set_grad_checkpointing(every), init_weights(), layer_groups(), lock(layers, freeze_layer_norm), activation_shape().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from bigclip.errors import UserError
from bigclip.model.hf_text import HFTextTower
from bigclip.model.modern_text import ModernTextTower
from bigclip.model.resnet import ResNetTower
from bigclip.model.text import TextTransformer
from bigclip.model.timm_tower import TimmVisionTower
from bigclip.model.tokenizer import TOKENIZER_KEYS
from bigclip.model.vision import VisionTower
from bigclip.registry import Registry


@dataclass(frozen=True)
class ImageTowerKind:
    claims: Callable[[dict], bool]  # does this vision_cfg describe this kind?
    # (embed_dim, vision_cfg, quick_gelu, forced image size or None) -> tower
    build: Callable[[int, dict, bool, int | tuple[int, int] | None], nn.Module]
    described_as: str  # "a ResNet image tower", for error lines
    patch_dropout: bool = False  # honours --force-patch-dropout
    layer_scale: bool = False  # honours --layer-scale-init
    pretrained_trunk: bool = False  # honours --pretrained-image (pretrained weights for its trunk)
    default: bool = False  # claims whatever no other kind claims (OpenCLIP: the ViT)


IMAGE_TOWERS: Registry[ImageTowerKind] = Registry("vision_cfg")


def _with_size(vision_cfg: dict, size) -> dict:
    return vision_cfg if size is None else {**vision_cfg, "image_size": size}


def _build_vit(embed_dim: int, vision_cfg: dict, quick_gelu: bool, size) -> nn.Module:
    return VisionTower(embed_dim=embed_dim, quick_gelu=quick_gelu, **_with_size(vision_cfg, size))


def _build_resnet(embed_dim: int, vision_cfg: dict, quick_gelu: bool, size) -> nn.Module:
    return ResNetTower(embed_dim=embed_dim, **_with_size(vision_cfg, size))


def _build_timm(embed_dim: int, vision_cfg: dict, quick_gelu: bool, size) -> nn.Module:
    tower = TimmVisionTower(embed_dim=embed_dim, quick_gelu=quick_gelu, **_with_size(vision_cfg, size))
    if size is not None:
        tower.set_input_size(size)  # as open_clip.create_model does for timm towers
    return tower


IMAGE_TOWERS.register(
    "timm",
    ImageTowerKind(
        lambda v: "timm_model_name" in v,  # OpenCLIP's TimmModel: a timm trunk and OpenCLIP's head
        _build_timm,
        "a timm image tower",
        patch_dropout=True,
        pretrained_trunk=True,
    ),
    help="any timm trunk with OpenCLIP's pooling and projection head",
)
IMAGE_TOWERS.register(
    "resnet",
    ImageTowerKind(
        lambda v: isinstance(v.get("layers"), (list, tuple)),  # OpenCLIP's rule: stage depths mean a ResNet
        _build_resnet,
        "a ResNet image tower",
    ),
    help="OpenCLIP's ModifiedResNet",
)
IMAGE_TOWERS.register(
    "vit",
    ImageTowerKind(lambda v: True, _build_vit, "bigclip's ViT image tower", True, True, default=True),
    help="a CLIP ViT on timm's VisionTransformer",
)


def image_tower_kind(vision_cfg: dict) -> ImageTowerKind:
    """The kind that claims `vision_cfg`: the first specific kind that does, else the default (the ViT)."""
    kinds = [kind for _, kind in IMAGE_TOWERS.items()]
    found = next((k for k in kinds if not k.default and k.claims(vision_cfg)), None)
    found = found or next((k for k in kinds if k.default and k.claims(vision_cfg)), None)
    if found is None:
        raise UserError(f"vision_cfg {sorted(vision_cfg)}: no image tower kind claims it ({', '.join(IMAGE_TOWERS)})")
    return found


def vision_tower(
    embed_dim: int, vision_cfg: dict, *, quick_gelu: bool, image_size: int | tuple[int, int] | None = None
) -> nn.Module:
    """The image tower an architecture config (OpenCLIP's vision_cfg) describes; `image_size` forces a size."""
    return image_tower_kind(vision_cfg).build(embed_dim, vision_cfg, quick_gelu, image_size)


@dataclass(frozen=True)
class TextTowerKind:
    claims: Callable[[dict], bool]  # does this text_cfg describe this kind?
    build: Callable[[int, dict, bool], nn.Module]  # (embed_dim, text_cfg, quick_gelu) -> tower
    default: bool = False  # claims whatever no other kind claims


TEXT_TOWERS: Registry[TextTowerKind] = Registry("text_cfg")
TEXT_TOWERS.register(
    "hf",
    TextTowerKind(
        lambda t: "hf_model_name" in t,
        lambda embed_dim, text_cfg, quick_gelu: HFTextTower(embed_dim=embed_dim, **text_cfg),
    ),
    help="a Hugging Face model through transformers (OpenCLIP's HFTextEncoder: hf_model_name)",
)
TEXT_TOWERS.register(
    "modern",
    TextTowerKind(
        lambda t: t.get("text_arch", "clip") == "modern",
        lambda embed_dim, text_cfg, quick_gelu: ModernTextTower(embed_dim=embed_dim, **text_cfg),
    ),
    help="OpenCLIP main's ModernTextTransformer (text_arch modern: rotary positions, SwiGLU, RMSNorm, gated attention)",
)


def _build_text_transformer(embed_dim: int, text_cfg: dict, quick_gelu: bool) -> nn.Module:
    tower_cfg = {k: v for k, v in text_cfg.items() if k not in TOKENIZER_KEYS}  # the tokenizer's (tokenizer.py)
    return TextTransformer(embed_dim=embed_dim, quick_gelu=quick_gelu, **tower_cfg)


TEXT_TOWERS.register(
    "transformer",
    TextTowerKind(lambda t: True, _build_text_transformer, default=True),
    help="OpenCLIP's TextTransformer: CLIP's causal one, or bidirectional (SigLIP, CLIPA, MobileCLIP), its pooling",
)


def text_tower(embed_dim: int, text_cfg: dict, *, quick_gelu: bool) -> nn.Module:
    """The text tower an architecture config (OpenCLIP's text_cfg) describes."""
    kinds = [kind for _, kind in TEXT_TOWERS.items()]
    kind = next((k for k in kinds if not k.default and k.claims(text_cfg)), None) or next(k for k in kinds if k.default)
    return kind.build(embed_dim, text_cfg, quick_gelu)
