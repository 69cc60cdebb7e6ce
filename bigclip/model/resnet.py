"""ResNet vision tower: OpenAI CLIP's modified ResNet (OpenCLIP's `ModifiedResNet`) as timm's `ByobNet`.

timm's `resnet50_clip` family is the same network as OpenCLIP's RN50 / RN101 / RN50x4 / RN50x16 / RN50x64:
a three-convolution stem with an average pool, bottleneck blocks whose stride is an average pool after the
3x3 convolution (and before the shortcut's 1x1), and an attention pool head (the mean of the feature map as
the query token, a learned absolute positional embedding, separate q/k/v projections, the output projection
to the embedding dimension). The OpenCLIP vision_cfg picks the depths (`layers`) and the width (`width`:
64 for RN50, 80, 96, 128 for x4, x16, x64; timm's `width_factor` is width / 64).

Parameter names are timm's under `visual.resnet.`; resnet_names.py converts them to and from OpenCLIP's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import torch
from timm.layers import AttentionPool2d
from timm.models.byobnet import ByobNet, model_cfgs
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from bigclip.errors import UserError
from bigclip.model.layer_groups import LayerGroups
from bigclip.model.layers import is_checkpointed

# The stem, downsampling, anti-aliasing and attention-pool head of OpenAI's modified ResNet (RN50 depths).
_RESNET_CLIP = model_cfgs["resnet50_clip"]


def _pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    height, width = size
    return (int(height), int(width))


@contextlib.contextmanager
def _batch_norm_stats_kept(module: nn.Module) -> Iterator[None]:
    """Leave the running statistics of `module`'s BatchNorms as they were before the block.

    A checkpointed block runs its forward twice in a training step (the second time in backward, to
    recompute activations); in training mode each BatchNorm would update its running mean, variance and
    batch count twice. The recomputation runs under this, so only the first forward counts."""
    saved = [
        (buffer, buffer.clone())
        for m in module.modules()
        if isinstance(m, _BatchNorm)
        for buffer in m.buffers(recurse=False)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _recompute_contexts(block: nn.Module) -> tuple[contextlib.AbstractContextManager, ...]:
    return contextlib.nullcontext(), _batch_norm_stats_kept(block)


class ResNetTower(nn.Module):
    """OpenCLIP's ModifiedResNet from its vision_cfg: image_size, layers (4 depths), width, head_width."""

    def __init__(
        self,
        *,
        image_size: int | tuple[int, int] | list[int],
        layers: list[int] | tuple[int, ...],
        embed_dim: int,
        width: int = 64,
        head_width: int = 64,
        patch_size: None = None,  # OpenCLIP's RN configs carry "patch_size": null; a ResNet has no patches
    ):
        super().__init__()
        if len(layers) != 4:
            raise ValueError(f"a ResNet tower has 4 stages, got layers={list(layers)}")
        if width % 8:
            # timm rounds channel counts to multiples of 8; OpenCLIP uses width * 2**stage exactly.
            raise ValueError(f"ResNet width {width} must be a multiple of 8")
        features = width * 32  # the channels of the last stage, which the attention pool attends over
        if features % head_width:
            raise ValueError(f"ResNet feature width {features} is not divisible by head_width {head_width}")
        self.image_size = _pair(image_size)
        self.width = width
        self.heads = features // head_width  # OpenCLIP: vision_cfg.width * 32 // vision_cfg.head_width
        cfg = replace(
            _RESNET_CLIP,
            blocks=tuple(replace(stage, d=int(depth)) for stage, depth in zip(_RESNET_CLIP.blocks, layers)),
            width_factor=width / 64,
        )
        self.resnet = ByobNet(cfg, num_classes=embed_dim, img_size=self.image_size)
        head = self.resnet.head
        if head.num_heads != self.heads:  # timm's head uses 64-wide heads; OpenCLIP's head_width may differ
            self.resnet.head = AttentionPool2d(
                features, out_features=embed_dim, feat_size=head.feat_size, num_heads=self.heads, qkv_separate=True
            )
        self.checkpoint_every = 0  # 0: no activation checkpointing
        self.bn_stats_frozen = False

    @property
    def blocks(self) -> list[nn.Module]:
        """The bottleneck blocks of all four stages, in order: the units engines shard, compile and checkpoint."""
        return [block for stage in self.resnet.stages for block in stage]

    @property
    def description(self) -> str:
        """What kind of tower this is, for messages ("ResNet", a timm model's name)."""
        return "ResNet"

    def activation_shape(self) -> None:
        """Not a transformer: no formula describes its activations; the memory plan traces its forward on meta
        instead (memory/traced.py)."""
        return None

    def set_grad_checkpointing(self, every: int) -> None:
        """Recompute every `every`-th bottleneck block (counted across stages) in backward; 0 turns it off."""
        self.checkpoint_every = every

    @torch.no_grad()
    def init_weights(self) -> None:
        """OpenCLIP's ModifiedResNet init, in place; touches every parameter and buffer (BatchNorm running
        statistics and batch counts are reset), so it works after `to_empty()`.

        PyTorch's default init for convolutions, BatchNorms and the head's linear layers, the positional
        embedding ~ N(0, 1/C), q/k/v/output projection weights ~ N(0, 1/C) (C: the pooled feature width), and
        the last BatchNorm of every bottleneck zero-initialised, so each block starts as its shortcut."""
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear, _BatchNorm)):
                module.reset_parameters()
        head = self.resnet.head
        std = head.q.in_features**-0.5
        nn.init.normal_(head.pos_embed, std=head.pos_embed.shape[-1] ** -0.5)
        for linear in (head.q, head.k, head.v, head.proj):
            nn.init.normal_(linear.weight, std=std)
        for block in self.blocks:
            nn.init.zeros_(block.conv3_1x1.bn.weight)

    def layer_groups(self) -> LayerGroups:
        """OpenCLIP's groups of its ModifiedResNet (model/layer_groups.py): the stem, the four stages, the
        attention pool. Locking stays whole-tower (OpenCLIP's ModifiedResNet.lock); layer-wise decay uses them."""
        resnet = self.resnet
        stages = [[stage] for stage in resnet.stages]
        stages[-1].append(resnet.final_conv)
        return [
            ("embeddings", [resnet.stem]),
            *[(f"layer.{i}", members) for i, members in enumerate(stages)],
            ("proj", [resnet.head]),
        ]

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """Freeze the whole tower (OpenCLIP's ModifiedResNet.lock: partial locking is not supported).

        freeze_bn_stats also freezes the BatchNorm statistics: every BatchNorm then normalises with its
        running statistics and never updates them, in training as in eval, which is what OpenCLIP's
        freeze_batch_norm_2d does by swapping in FrozenBatchNorm2d. The modules are kept (set to eval mode
        instead) so that the state dict, its names and its buffers stay the same as an unfrozen tower's."""
        if unlocked_groups:
            raise UserError(
                f"--lock-image-unlocked-groups {unlocked_groups}: not supported for ResNet towers, which lock "
                "whole (as in OpenCLIP); use 0"
            )
        for param in self.parameters():
            param.requires_grad_(False)
        if freeze_bn_stats:
            self.bn_stats_frozen = True
            self.train(self.training)

    def train(self, mode: bool = True) -> ResNetTower:
        super().train(mode)
        if self.bn_stats_frozen:
            for module in self.modules():
                if isinstance(module, _BatchNorm):
                    module.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        resnet = self.resnet
        x = resnet.stem(images)
        for i, block in enumerate(self.blocks):
            if torch.is_grad_enabled() and is_checkpointed(i, self.checkpoint_every):
                x = checkpoint(block, x, use_reentrant=False, context_fn=partial(_recompute_contexts, block))
            else:
                x = block(x)
        x = resnet.final_conv(x)  # nn.Identity for these configs; kept so the trunk runs as timm defines it
        return resnet.head(x)  # attention pool + projection: (B, embed_dim)
