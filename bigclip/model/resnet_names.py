"""Names of the ResNet tower's state dict in OpenCLIP (`ModifiedResNet`) and in bigclip (timm's `ByobNet`).

Every tensor keeps its shape and values; only names differ (the mapping is timm's `_convert_openai_clip`):

    OpenCLIP visual.…                         bigclip visual.resnet.…
    conv{n}.weight, bn{n}.*   (n = 1, 2, 3)    stem.conv{n}.conv.weight, stem.conv{n}.bn.*
    layer{s}.{b}.conv1 / bn1                  stages.{s-1}.{b}.conv1_1x1.conv / .bn
    layer{s}.{b}.conv2 / bn2                  stages.{s-1}.{b}.conv2_kxk.conv / .bn
    layer{s}.{b}.conv3 / bn3                  stages.{s-1}.{b}.conv3_1x1.conv / .bn
    layer{s}.{b}.downsample.0 / .1            stages.{s-1}.{b}.shortcut.conv.conv / .bn
    attnpool.positional_embedding  (N+1, C)   head.pos_embed  (N+1, C)
    attnpool.q_proj / k_proj / v_proj         head.q / head.k / head.v
    attnpool.c_proj                           head.proj

BatchNorm buffers (running_mean, running_var, num_batches_tracked) are renamed like the weights. OpenCLIP
models trained with frozen BatchNorm statistics (FrozenBatchNorm2d) have no num_batches_tracked; reading
their state dicts into bigclip supplies a zero count, as torch's BatchNorm does for old state dicts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from bigclip.model.rename import Plan, TowerNames, rename_prefix, renamed

_TOP_NAMES = {
    **{f"conv{n}": f"stem.conv{n}.conv" for n in (1, 2, 3)},
    **{f"bn{n}": f"stem.conv{n}.bn" for n in (1, 2, 3)},
    "attnpool.positional_embedding": "head.pos_embed",
    "attnpool.q_proj": "head.q",
    "attnpool.k_proj": "head.k",
    "attnpool.v_proj": "head.v",
    "attnpool.c_proj": "head.proj",
}
_BLOCK_NAMES = {
    "conv1": "conv1_1x1.conv",
    "bn1": "conv1_1x1.bn",
    "conv2": "conv2_kxk.conv",
    "bn2": "conv2_kxk.bn",
    "conv3": "conv3_1x1.conv",
    "bn3": "conv3_1x1.bn",
    "downsample.0": "shortcut.conv.conv",
    "downsample.1": "shortcut.conv.bn",
}
_OPENCLIP_BLOCK = re.compile(r"^layer([1-4])\.(\d+)\.(.+)$")
_BIGCLIP_BLOCK = re.compile(r"^stages\.([0-3])\.(\d+)\.(.+)$")
_PREFIX = "visual.resnet."


def _openclip_name(name: str) -> str:
    """bigclip's name (without "visual.resnet.") for OpenCLIP's `name` (without "visual.")."""
    block = _OPENCLIP_BLOCK.match(name)
    if block:
        stage, index, rest = block.groups()
        new = rename_prefix(rest, _BLOCK_NAMES)
        if new is None:
            raise KeyError(f"unknown OpenCLIP ResNet block entry visual.{name}")
        return f"stages.{int(stage) - 1}.{index}.{new}"
    new = rename_prefix(name, _TOP_NAMES)
    if new is None:
        raise KeyError(f"unknown OpenCLIP ResNet entry visual.{name}")
    return new


def _bigclip_name(name: str) -> str:
    """OpenCLIP's name (without "visual.") for bigclip's `name` (without "visual.resnet.")."""
    block = _BIGCLIP_BLOCK.match(name)
    if block:
        stage, index, rest = block.groups()
        new = rename_prefix(rest, {v: k for k, v in _BLOCK_NAMES.items()})
        if new is None:
            raise KeyError(f"unknown bigclip ResNet block entry {_PREFIX}{name}")
        return f"layer{int(stage) + 1}.{index}.{new}"
    new = rename_prefix(name, {v: k for k, v in _TOP_NAMES.items()})
    if new is None:
        raise KeyError(f"unknown bigclip ResNet entry {_PREFIX}{name}")
    return new


def _zero_batch_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.long)


def _from_openclip(names: Iterable[str]) -> Plan:
    names = list(names)
    plan: Plan = {}
    for name in names:
        if not name.startswith("visual."):
            raise KeyError(f"not a vision entry: {name}")
        plan[_PREFIX + _openclip_name(name[len("visual.") :])] = renamed(name)
    # FrozenBatchNorm2d (OpenCLIP's --lock-image-freeze-bn-stats) keeps no batch count: start it at zero.
    for name in names:
        if name.endswith(".running_mean"):
            count = _PREFIX + _openclip_name(name[len("visual.") : -len("running_mean")] + "num_batches_tracked")
            plan.setdefault(count, ((), _zero_batch_count))
    return plan


def _to_openclip(names: Iterable[str]) -> Plan:
    plan: Plan = {}
    for name in names:
        if not name.startswith(_PREFIX):
            raise KeyError(f"unknown bigclip ResNet entry {name}")
        plan["visual." + _bigclip_name(name[len(_PREFIX) :])] = renamed(name)
    return plan


RESNET_NAMES = TowerNames(
    kind="resnet",
    is_openclip=lambda names: "visual.layer1.0.conv1.weight" in names,
    is_bigclip=lambda names: "visual.resnet.stem.conv1.conv.weight" in names,
    from_openclip=_from_openclip,
    to_openclip=_to_openclip,
)
