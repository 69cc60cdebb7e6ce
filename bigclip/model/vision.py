"""Vision tower: a timm `VisionTransformer` trunk plus CLIP's bias-free projection.

The trunk is configured the way CLIP ViTs are: class token, learned positional embedding,
a LayerNorm before the blocks (`pre_norm`, which also drops the patch-embed bias), the final
norm on the pooled class token (OpenCLIP's `ln_post`), and no classifier head. With `ls_init_value`
(OpenCLIP's vision_cfg key, or --layer-scale-init) every block scales both residual branches by a learned
LayerScale (timm's `ls1`/`ls2`, OpenCLIP's `ls_1`/`ls_2`, parameter `gamma`) starting at that value.
"""

from __future__ import annotations

import torch
from timm.layers import LayerScale
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from bigclip.model.layer_groups import LayerGroups, lock_bottom
from bigclip.model.layers import BlockSequence, QuickGELU


def _pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    height, width = size
    return (int(height), int(width))


class VisionTower(nn.Module):
    def __init__(
        self,
        *,
        image_size: int | tuple[int, int],
        patch_size: int,
        width: int,
        layers: int,
        embed_dim: int,
        head_width: int = 64,
        mlp_ratio: float = 4.0,
        patch_dropout: float = 0.0,
        quick_gelu: bool = False,
        ls_init_value: float | None = None,
    ):
        super().__init__()
        if width % head_width:
            raise ValueError(f"vision width {width} is not divisible by head_width {head_width}")
        self.image_size = _pair(image_size)
        self.patch_size = patch_size
        self.width = width
        self.mlp_ratio = mlp_ratio
        self.ls_init_value = ls_init_value
        self.trunk = VisionTransformer(
            img_size=self.image_size,
            patch_size=patch_size,
            embed_dim=width,
            depth=layers,
            num_heads=width // head_width,
            mlp_ratio=mlp_ratio,
            class_token=True,
            pre_norm=True,
            global_pool="token",
            num_classes=0,
            patch_drop_rate=patch_dropout,
            norm_layer=nn.LayerNorm,  # eps 1e-5 as in CLIP (timm's default is 1e-6)
            act_layer=QuickGELU if quick_gelu else nn.GELU,
        )
        if ls_init_value is not None:
            # Added here rather than through timm's init_values: timm's Block builds LayerScale only for a truthy
            # value, so 0 (zero-init layer scale) would silently give plain residuals.
            for block in self.trunk.blocks:
                block.ls1 = LayerScale(width, init_values=ls_init_value)
                block.ls2 = LayerScale(width, init_values=ls_init_value)
        # Same names (blocks.{i}), plus per-block checkpointing that timm's flag cannot space out.
        self.trunk.blocks = BlockSequence(*self.trunk.blocks)
        # Applied as x @ proj (OpenCLIP's `visual.proj` layout), hence (width, embed_dim).
        self.proj = nn.Parameter(torch.empty(width, embed_dim))

    @property
    def blocks(self) -> BlockSequence:
        return self.trunk.blocks

    @property
    def description(self) -> str:
        """What kind of tower this is, for messages ("ResNet", a timm model's name)."""
        return "ViT"

    def activation_shape(self) -> tuple[int, int, int, float]:
        """(layers, tokens, width, MLP ratio): what the memory plan's activation arithmetic needs."""
        h, w = self.image_size
        tokens = (h // self.patch_size) * (w // self.patch_size) + 1  # patches and the class token
        return len(self.blocks), tokens, self.width, float(self.mlp_ratio)

    def set_grad_checkpointing(self, every: int) -> None:
        """Recompute every `every`-th block in backward; 0 turns checkpointing off."""
        self.trunk.blocks.checkpoint_every = every

    def init_weights(self) -> None:
        """timm's ViT init plus CLIP's projection init; touches every parameter."""
        self.trunk.init_weights()  # resets every module (conv, norms), then timm's ViT init
        if self.ls_init_value is not None:
            # Set here, not left to timm's init walk, so the value holds whatever timm's init does to LayerScale.
            for block in self.blocks:
                nn.init.constant_(block.ls1.gamma, self.ls_init_value)
                nn.init.constant_(block.ls2.gamma, self.ls_init_value)
        nn.init.normal_(self.proj, std=self.width**-0.5)

    def layer_groups(self) -> LayerGroups:
        """OpenCLIP's groups of a ViT (model/layer_groups.py): embeddings, each block (the last with ln_post),
        proj."""
        trunk = self.trunk
        groups: LayerGroups = [("embeddings", [trunk.patch_embed, trunk.cls_token, trunk.pos_embed, trunk.norm_pre])]
        groups += [(f"layer.{i}", [block]) for i, block in enumerate(trunk.blocks)]
        groups[-1][1].append(trunk.norm)
        groups.append(("proj", [self.proj]))
        return groups

    def no_weight_decay(self) -> set[str]:
        """Parameters never decayed although their shape would be: OpenCLIP's class embedding is a vector (its
        rule spares every vector), timm's class token the same values shaped (1, 1, width)."""
        return {"trunk.cls_token"}

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """Freeze the tower except its top `unlocked_groups` layer groups. A ViT holds no BatchNorm, so
        `freeze_bn_stats` has nothing to freeze; it is accepted for OpenCLIP flag compatibility."""
        lock_bottom(self.layer_groups(), unlocked_groups)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # The trunk returns the class token after ln_post (global_pool="token", no head).
        return self.trunk(images) @ self.proj
