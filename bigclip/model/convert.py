"""Rename state dicts between OpenCLIP's `CLIP` layout and bigclip's.

Only names and a few shapes differ; every tensor keeps its values:

    OpenCLIP                                      bigclip
    visual.conv1.weight                           visual.trunk.patch_embed.proj.weight
    visual.class_embedding            (D,)        visual.trunk.cls_token       (1, 1, D)
    visual.positional_embedding       (N, D)      visual.trunk.pos_embed       (1, N, D)
    visual.ln_pre.*                               visual.trunk.norm_pre.*
    visual.transformer.resblocks.{i}.ln_1.*       visual.trunk.blocks.{i}.norm1.*
        ...attn.in_proj_weight / in_proj_bias         ...attn.qkv.weight / qkv.bias
        ...attn.out_proj.*                            ...attn.proj.*
        ...ln_2.* / mlp.c_fc.* / mlp.c_proj.*         ...norm2.* / mlp.fc1.* / mlp.fc2.*
        ...ls_1.gamma / ls_2.gamma (layer scale)      ...ls1.gamma / ls2.gamma
    visual.ln_post.*                              visual.trunk.norm.*
    visual.proj                                   visual.proj
    token_embedding / positional_embedding /      text.<same name>
      transformer.* / ln_final.* / text_projection
    logit_scale, logit_bias           ()          logit_scale, logit_bias      (1,)

CoCa (model/coca.py) keeps OpenCLIP's names everywhere except the ViT's trunk: its image tower's attn_pool.* and
ln_post.* (after the pooler), its text.* (OpenCLIP's CoCa keeps the text tower under `text.`, unlike CLIP) and
text_decoder.* pass through unchanged; so does a Hugging Face text tower's text.* and OpenCLIP main's modern text
tower's (OpenCLIP's CustomTextCLIP).

timm's fused qkv weight stacks [q; k; v] exactly like `nn.MultiheadAttention.in_proj_weight`,
so attention weights need no reordering. Other vision towers bring their own tables (`TowerNames`); the
state dict's visual names say which tower it holds. Conversions are plans (rename.py), so a checkpoint can
also be converted one tensor at a time while it streams in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from bigclip.model.rename import Plan, TowerNames, apply_plan, rename_prefix, renamed, same
from bigclip.model.resnet_names import RESNET_NAMES
from bigclip.model.timm_tower import TIMM_NAMES

# OpenCLIP visual-block suffix -> timm block suffix.
_VISION_BLOCK_NAMES = {
    "ln_1": "norm1",
    "attn.in_proj_weight": "attn.qkv.weight",
    "attn.in_proj_bias": "attn.qkv.bias",
    "attn.out_proj": "attn.proj",
    "ln_2": "norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "ls_1": "ls1",  # layer scale (ls_init_value, --layer-scale-init)
    "ls_2": "ls2",
}
_VISION_TOP_NAMES = {
    "conv1.weight": "trunk.patch_embed.proj.weight",
    "class_embedding": "trunk.cls_token",
    "positional_embedding": "trunk.pos_embed",
    "ln_pre": "trunk.norm_pre",
    "ln_post": "trunk.norm",
    "proj": "proj",
}
_TEXT_TOP_NAMES = ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection")
_SCALARS = ("logit_scale", "logit_bias")
# Non-parameter entries older OpenCLIP checkpoints carry (causal mask buffer, OpenAI metadata).
_OPENCLIP_IGNORED = ("attn_mask", "input_resolution", "context_length", "vocab_size")

_OPENCLIP_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)$")
_BIGCLIP_BLOCK = re.compile(r"^trunk\.blocks\.(\d+)\.(.+)$")


def _to_cls_token(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1, -1)


def _to_pos_embed(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0)


def _to_class_embedding(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _to_positional_embedding(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(0)


def _to_vector(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1)


def _to_scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(())


# CoCa's attentional pooler and the norm after it: the same names on both sides.
_POOLER_NAMES = ("attn_pool.", "ln_post.")


def _pooled(names: Iterable[str]) -> bool:
    return "visual.attn_pool.query" in names


def _openclip_vit_name(name: str, pooled: bool = False) -> str:
    if pooled and name.startswith(_POOLER_NAMES):
        return name
    block = _OPENCLIP_BLOCK.match(name)
    if block:
        index, rest = block.groups()
        new = rename_prefix(rest, _VISION_BLOCK_NAMES)
        if new is None:
            raise KeyError(f"unknown OpenCLIP vision block entry visual.{name}")
        return f"trunk.blocks.{index}.{new}"
    new = rename_prefix(name, _VISION_TOP_NAMES)
    if new is None:
        raise KeyError(f"unknown OpenCLIP vision entry visual.{name}")
    return new


def _bigclip_vit_name(name: str, pooled: bool = False) -> str:
    if pooled and name.startswith(_POOLER_NAMES):
        return name
    block = _BIGCLIP_BLOCK.match(name)
    if block:
        index, rest = block.groups()
        new = rename_prefix(rest, {v: k for k, v in _VISION_BLOCK_NAMES.items()})
        if new is None:
            raise KeyError(f"unknown bigclip vision block entry visual.{name}")
        return f"transformer.resblocks.{index}.{new}"
    new = rename_prefix(name, {v: k for k, v in _VISION_TOP_NAMES.items()})
    if new is None:
        raise KeyError(f"unknown bigclip vision entry visual.{name}")
    return new


def _vit_from_openclip(names: Iterable[str]) -> Plan:
    names = list(names)
    pooled = _pooled(names)
    plan: Plan = {}
    for name in names:
        new = _openclip_vit_name(name[len("visual.") :], pooled)
        fn = {"trunk.cls_token": _to_cls_token, "trunk.pos_embed": _to_pos_embed}.get(new, same)
        plan["visual." + new] = renamed(name, fn)
    return plan


def _vit_to_openclip(names: Iterable[str]) -> Plan:
    names = list(names)
    pooled = _pooled(names)
    plan: Plan = {}
    for name in names:
        new = _bigclip_vit_name(name[len("visual.") :], pooled)
        fn = {"class_embedding": _to_class_embedding, "positional_embedding": _to_positional_embedding}.get(new, same)
        plan["visual." + new] = renamed(name, fn)
    return plan


VIT_NAMES = TowerNames(
    kind="vit",
    is_openclip=lambda names: "visual.class_embedding" in names,
    is_bigclip=lambda names: "visual.trunk.cls_token" in names,
    from_openclip=_vit_from_openclip,
    to_openclip=_vit_to_openclip,
)
# Every vision tower bigclip builds; the first whose detector accepts a state dict's visual names converts it.
# The timm tower comes first: its detector (every visual entry under visual.trunk./visual.head.) is the strict
# one, while a timm ViT trunk also has the visual.trunk.cls_token that marks bigclip's own ViT tower.
VISION_TOWER_NAMES: tuple[TowerNames, ...] = (TIMM_NAMES, VIT_NAMES, RESNET_NAMES)


def is_openclip_state_dict(names: Iterable[str], logit_scale_shape: tuple[int, ...] | None = None) -> bool:
    """Whether a state dict is in OpenCLIP's layout: its text tower at the top level, its own ViT, or (a
    CustomTextCLIP with a timm tower, whose names are bigclip's) its 0-dim logit_scale (bigclip's has shape
    (1,))."""
    names = set(names)
    return "token_embedding.weight" in names or "visual.conv1.weight" in names or logit_scale_shape == ()


def _tower(visual: set[str], openclip: bool) -> TowerNames:
    for tower in VISION_TOWER_NAMES:
        if (tower.is_openclip if openclip else tower.is_bigclip)(visual):
            return tower
    layout = "OpenCLIP" if openclip else "bigclip"
    raise KeyError(f"unknown {layout} vision tower (entries like {sorted(visual)[:3]})")


# OpenCLIP keeps a text tower under `text.` when it is not CLIP's own (CustomTextCLIP: a Hugging Face tower) and in
# CoCa (with its caption decoder): those names are the same in both layouts.
_SEPARATE_TEXT = ("text.", "text_decoder.")


def _openclip_separate_text(names: Iterable[str]) -> bool:
    return any(name.startswith(_SEPARATE_TEXT) for name in names)


def _bigclip_separate_text(names: Iterable[str]) -> bool:
    names = set(names)
    coca = any(name.startswith("text_decoder.") for name in names)
    modern = any(name.startswith("text.blocks.") for name in names)  # OpenCLIP main's modern text tower
    return coca or modern or "text.token_embedding.weight" not in names  # or a Hugging Face tower


def plan_openclip_to_bigclip(names: Iterable[str]) -> Plan:
    """The plan that makes bigclip's `CLIP.state_dict()` from OpenCLIP's entries `names`."""
    names = [n for n in names if n.split(".")[-1] not in _OPENCLIP_IGNORED]
    visual = {n for n in names if n.startswith("visual.")}
    plan: Plan = _tower(visual, openclip=True).from_openclip(sorted(visual)) if visual else {}
    separate = _openclip_separate_text(names)
    for name in names:
        if separate and name.startswith(_SEPARATE_TEXT):
            plan[name] = renamed(name)
        elif name in _SCALARS:
            plan[name] = renamed(name, _to_vector)
        elif name.split(".")[0] in _TEXT_TOP_NAMES:
            plan["text." + name] = renamed(name)
        elif not name.startswith("visual."):
            raise KeyError(f"unknown OpenCLIP entry {name}")
    return plan


def plan_bigclip_to_openclip(names: Iterable[str], separate_text: bool = False) -> Plan:
    """The plan that makes OpenCLIP's `CLIP.state_dict()` layout from bigclip's entries `names` (export).
    separate_text: OpenCLIP builds the architecture as CustomTextCLIP (registry.openclip_separate_text), so
    the text tower stays under `text.`; the names alone tell it for Hugging Face towers and CoCa only."""
    names = list(names)
    visual = {n for n in names if n.startswith("visual.")}
    plan: Plan = _tower(visual, openclip=False).to_openclip(sorted(visual)) if visual else {}
    separate = separate_text or _bigclip_separate_text(names)
    for name in names:
        if separate and name.startswith(_SEPARATE_TEXT):
            plan[name] = renamed(name)
        elif name in _SCALARS:
            plan[name] = renamed(name, _to_scalar)
        elif name.startswith("text."):
            plan[name[len("text.") :]] = renamed(name)
        elif not name.startswith("visual."):
            raise KeyError(f"unknown bigclip entry {name}")
    return plan


def openclip_to_bigclip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenCLIP `CLIP.state_dict()` -> bigclip `CLIP.state_dict()` (tensors shared, not copied)."""
    return apply_plan(plan_openclip_to_bigclip(state_dict.keys()), state_dict)


def bigclip_to_openclip(state_dict: Mapping[str, torch.Tensor], separate_text: bool = False) -> dict[str, torch.Tensor]:
    """bigclip `CLIP.state_dict()` -> OpenCLIP's layout of it (for export; separate_text: see the plan)."""
    return apply_plan(plan_bigclip_to_openclip(state_dict.keys(), separate_text), state_dict)
