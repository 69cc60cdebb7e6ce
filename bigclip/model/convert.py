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
    visual.ln_post.*                              visual.trunk.norm.*
    visual.proj                                   visual.proj
    token_embedding / positional_embedding /      text.<same name>
      transformer.* / ln_final.* / text_projection
    logit_scale, logit_bias           ()          logit_scale, logit_bias      (1,)

timm's fused qkv weight stacks [q; k; v] exactly like `nn.MultiheadAttention.in_proj_weight`,
so attention weights need no reordering.
"""

from __future__ import annotations

import re

import torch

# OpenCLIP visual-block suffix -> timm block suffix.
_VISION_BLOCK_NAMES = {
    "ln_1": "norm1",
    "attn.in_proj_weight": "attn.qkv.weight",
    "attn.in_proj_bias": "attn.qkv.bias",
    "attn.out_proj": "attn.proj",
    "ln_2": "norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
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


def is_openclip_state_dict(state_dict: dict) -> bool:
    return "token_embedding.weight" in state_dict or "visual.conv1.weight" in state_dict


def _rename_prefix(name: str, table: dict[str, str]) -> str | None:
    """Map `name` through the first entry of `table` that equals it or prefixes it at a dot."""
    for old, new in table.items():
        if name == old:
            return new
        if name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def _openclip_visual_name(name: str) -> str:
    block = _OPENCLIP_BLOCK.match(name)
    if block:
        index, rest = block.groups()
        renamed = _rename_prefix(rest, _VISION_BLOCK_NAMES)
        if renamed is None:
            raise KeyError(f"unknown OpenCLIP vision block entry visual.{name}")
        return f"trunk.blocks.{index}.{renamed}"
    renamed = _rename_prefix(name, _VISION_TOP_NAMES)
    if renamed is None:
        raise KeyError(f"unknown OpenCLIP vision entry visual.{name}")
    return renamed


def _bigclip_visual_name(name: str) -> str:
    block = _BIGCLIP_BLOCK.match(name)
    if block:
        index, rest = block.groups()
        renamed = _rename_prefix(rest, {v: k for k, v in _VISION_BLOCK_NAMES.items()})
        if renamed is None:
            raise KeyError(f"unknown bigclip vision block entry visual.{name}")
        return f"transformer.resblocks.{index}.{renamed}"
    renamed = _rename_prefix(name, {v: k for k, v in _VISION_TOP_NAMES.items()})
    if renamed is None:
        raise KeyError(f"unknown bigclip vision entry visual.{name}")
    return renamed


def openclip_to_bigclip(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenCLIP `CLIP.state_dict()` -> bigclip `CLIP.state_dict()` (tensors shared, not copied)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.split(".")[-1] in _OPENCLIP_IGNORED:
            continue
        if name in _SCALARS:
            out[name] = tensor.reshape(1)
        elif name.startswith("visual."):
            new = _openclip_visual_name(name[len("visual.") :])
            if new == "trunk.cls_token":
                tensor = tensor.reshape(1, 1, -1)
            elif new == "trunk.pos_embed":
                tensor = tensor.unsqueeze(0)
            out["visual." + new] = tensor
        elif name.split(".")[0] in _TEXT_TOP_NAMES:
            out["text." + name] = tensor
        else:
            raise KeyError(f"unknown OpenCLIP entry {name}")
    return out


def bigclip_to_openclip(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bigclip `CLIP.state_dict()` -> OpenCLIP `CLIP.state_dict()` layout (for export)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name in _SCALARS:
            out[name] = tensor.reshape(())
        elif name.startswith("visual."):
            new = _bigclip_visual_name(name[len("visual.") :])
            if new == "class_embedding":
                tensor = tensor.reshape(-1)
            elif new == "positional_embedding":
                tensor = tensor.squeeze(0)
            out["visual." + new] = tensor
        elif name.startswith("text."):
            out[name[len("text.") :]] = tensor
        else:
            raise KeyError(f"unknown bigclip entry {name}")
    return out
