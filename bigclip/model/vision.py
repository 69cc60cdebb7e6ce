"""Vision tower: a timm `VisionTransformer` trunk plus CLIP's bias-free projection.

The trunk is configured the way CLIP ViTs are: class token, learned positional embedding,
a LayerNorm before the blocks (`pre_norm`, which also drops the patch-embed bias), the final
norm on the pooled class token (OpenCLIP's `ln_post`), and no classifier head. With `ls_init_value`
(OpenCLIP's vision_cfg key, or --layer-scale-init) every block scales both residual branches by a learned
LayerScale (timm's `ls1`/`ls2`, OpenCLIP's `ls_1`/`ls_2`, parameter `gamma`) starting at that value.

CLIPA's towers (OpenCLIP's vision_cfg keys): `no_ln_pre` drops the norm before the blocks; `pool_type` avg pools the
mean of the patch tokens (class token left out) instead of the class token; `final_ln_after_pool` applies `ln_post`
(timm's `norm`, the same name) to the pooled vector instead of every token (`_NormAfterPool`).

CoCa's image tower (`attentional_pool`, OpenCLIP's key) pools differently: no norm after the blocks; an attentional
pooler (`attn_pool`: learned queries attending over every token) maps the tokens to `attn_pooler_queries` vectors of
embed_dim, `ln_post` normalises them, the first is the image feature (times `proj`) and the others are the image
tokens CoCa's decoder reads (`output_tokens`). Names and layout are OpenCLIP's (`nn.MultiheadAttention`'s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        attentional_pool: bool = False,
        attn_pooler_heads: int = 8,
        attn_pooler_queries: int = 256,
        output_tokens: bool = False,
        no_ln_pre: bool = False,
        pool_type: str = "tok",
        final_ln_after_pool: bool = False,
    ):
        super().__init__()
        if pool_type not in POOL_TYPES:
            raise ValueError(f"vision_cfg pool_type {pool_type!r}: bigclip builds {', '.join(POOL_TYPES)}")
        # OpenCLIP ignores final_ln_after_pool under an attentional pooler, and so does bigclip
        final_ln_after_pool = final_ln_after_pool and not attentional_pool
        if final_ln_after_pool and output_tokens:
            raise ValueError("vision_cfg final_ln_after_pool with output_tokens (CoCa) is not built yet")
        if attentional_pool not in (False, True):
            # OpenCLIP's "parallel" / "cascade" poolers (two poolers) are marked work in progress there.
            raise ValueError(f"attentional_pool {attentional_pool!r}: bigclip builds OpenCLIP's CoCa pooler (true)")
        if width % head_width:
            raise ValueError(f"vision width {width} is not divisible by head_width {head_width}")
        self.image_size = _pair(image_size)
        self.patch_size = patch_size
        self.width = width
        self.mlp_ratio = mlp_ratio
        self.ls_init_value = ls_init_value
        self.output_tokens = output_tokens
        self.pool_type = pool_type
        trunk_pool = "token" if pool_type == "tok" else "avg"  # timm's avg leaves the class token out, as OpenCLIP's
        self.trunk = (_NormAfterPool if final_ln_after_pool else VisionTransformer)(
            img_size=self.image_size,
            patch_size=patch_size,
            embed_dim=width,
            depth=layers,
            num_heads=width // head_width,
            mlp_ratio=mlp_ratio,
            class_token=True,
            pre_norm=True,
            # CoCa's pooler reads every token, and normalises after it instead; CoCa without a pooler (OpenCLIP's
            # coca_base) reads the normalised tokens beside the class token
            global_pool="" if attentional_pool or output_tokens else trunk_pool,
            final_norm=not attentional_pool,
            fc_norm=False,  # ln_post is timm's `norm` (timm would move it after an avg pool as `fc_norm`)
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
        if no_ln_pre:  # (built with pre_norm all the same: it is what leaves the patch embedding without a bias)
            self.trunk.norm_pre = nn.Identity()
        # Same names (blocks.{i}), plus per-block checkpointing that timm's flag cannot space out.
        self.trunk.blocks = BlockSequence(*self.trunk.blocks)
        if attentional_pool:
            self.attn_pool = AttentionalPooler(embed_dim, width, attn_pooler_heads, attn_pooler_queries)
            self.ln_post = nn.LayerNorm(embed_dim)
        else:
            self.attn_pool = None
        pooled_width = embed_dim if attentional_pool else width
        # Applied as x @ proj (OpenCLIP's `visual.proj` layout), hence (pooled width, embed_dim).
        self.proj = nn.Parameter(torch.empty(pooled_width, embed_dim))

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
        if self.attn_pool is not None:
            self.attn_pool.init_weights()
            self.ln_post.reset_parameters()
        nn.init.normal_(self.proj, std=self.width**-0.5)

    def layer_groups(self) -> LayerGroups:
        """OpenCLIP's groups of a ViT (model/layer_groups.py): embeddings, each block (the last with ln_post, also
        CoCa's, which follows the pooler), proj (with CoCa's attentional pooler, which OpenCLIP leaves out of every
        group: never frozen by --lock-image with groups unlocked, lr scale 1 under layer decay)."""
        trunk = self.trunk
        groups: LayerGroups = [("embeddings", [trunk.patch_embed, trunk.cls_token, trunk.pos_embed, trunk.norm_pre])]
        groups += [(f"layer.{i}", [block]) for i, block in enumerate(trunk.blocks)]
        groups[-1][1].append(trunk.norm if self.attn_pool is None else self.ln_post)
        groups.append(("proj", [self.proj] if self.attn_pool is None else [self.attn_pool, self.proj]))
        return groups

    def no_weight_decay(self) -> set[str]:
        """Parameters never decayed although their shape would be: OpenCLIP's class embedding is a vector (its
        rule spares every vector), timm's class token the same values shaped (1, 1, width)."""
        return {"trunk.cls_token"}

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """Freeze the tower except its top `unlocked_groups` layer groups. A ViT holds no BatchNorm, so
        `freeze_bn_stats` has nothing to freeze (--lock-image-freeze-bn-stats is refused for it before the towers
        are locked)."""
        lock_bottom(self.layer_groups(), unlocked_groups)

    def forward(self, images: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) -> (B, embed_dim) features; with output_tokens, (features, image tokens)."""
        if self.attn_pool is None and not self.output_tokens:
            # The trunk returns the class token after ln_post (global_pool="token", no head).
            pooled = self.trunk(images)
            tokens = None
        elif self.attn_pool is None:
            x = self.trunk(images)  # every token after ln_post (global_pool="", no head): OpenCLIP's _global_pool
            pooled, tokens = (x[:, 0] if self.pool_type == "tok" else x[:, 1:].mean(dim=1)), x[:, 1:]
        else:
            # (the trunk's own forward, not forward_features: engines gather its parameters in its forward hooks)
            x = self.ln_post(self.attn_pool(self.trunk(images)))  # every token (global_pool="", no norm)
            pooled, tokens = x[:, 0], x[:, 1:]
        features = pooled @ self.proj
        return (features, tokens) if self.output_tokens else features


# OpenCLIP's vision pool_type values bigclip builds (its "none", every token as the feature, is not one).
POOL_TYPES = ("tok", "avg")


class _NormAfterPool(VisionTransformer):
    """timm's VisionTransformer with OpenCLIP's final_ln_after_pool: the tokens are pooled (timm's global_pool)
    first, then normalised by `norm` (OpenCLIP's ln_post). The trunk's own forward, so engines' forward hooks on
    the trunk (its class token and positional embedding) run as for the plain trunk."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        return self.norm(self.pool(self.blocks(x)))


class AttentionalPooler(nn.Module):
    """OpenCLIP's AttentionalPooler: `n_queries` learned queries (width d_model) attend over the tokens (width
    context_dim), both sides normalised first."""

    def __init__(self, d_model: int, context_dim: int, heads: int = 8, n_queries: int = 256):
        super().__init__()
        self.query = nn.Parameter(torch.empty(n_queries, d_model))
        self.attn = KeyValueAttention(d_model, context_dim, heads)
        self.ln_q = nn.LayerNorm(d_model)
        self.ln_k = nn.LayerNorm(context_dim)

    def init_weights(self) -> None:
        nn.init.normal_(self.query)  # OpenCLIP's torch.randn
        self.attn.init_weights()
        self.ln_q.reset_parameters()
        self.ln_k.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_k(x)
        return self.attn(self.ln_q(self.query).unsqueeze(0).expand(x.shape[0], -1, -1), x)


class KeyValueAttention(nn.Module):
    """nn.MultiheadAttention(width, heads, kdim=context_dim, vdim=context_dim, batch_first=True) as OpenCLIP's pooler
    uses it, with its parameter names (in_proj_weight when the widths agree, else q/k/v_proj_weight; in_proj_bias;
    out_proj), computed with scaled_dot_product_attention and calling out_proj as a module, so that every module
    owning parameters runs its own forward (what ZeRO-3's parameter hooks need; nn.MultiheadAttention reads
    out_proj's weight without calling it)."""

    def __init__(self, width: int, context_dim: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"attentional pooler width {width} is not divisible by attn_pooler_heads {heads}")
        self.heads = heads
        self.width = width
        self.fused = context_dim == width
        if self.fused:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(width, width))
            self.k_proj_weight = nn.Parameter(torch.empty(width, context_dim))
            self.v_proj_weight = nn.Parameter(torch.empty(width, context_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def init_weights(self) -> None:
        """nn.MultiheadAttention's: xavier-uniform projections, zero biases."""
        weights = [self.in_proj_weight] if self.fused else [self.q_proj_weight, self.k_proj_weight, self.v_proj_weight]
        for weight in weights:
            nn.init.xavier_uniform_(weight)
        self.out_proj.reset_parameters()
        nn.init.zeros_(self.in_proj_bias)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, query: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        if self.fused:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)

        def heads(x: torch.Tensor) -> torch.Tensor:  # (B, L, width) -> (B, H, L, width / H)
            return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

        q = heads(F.linear(query, w_q, b_q))
        k, v = heads(F.linear(context, w_k, b_k)), heads(F.linear(context, w_v, b_v))
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(query.shape[0], -1, self.width)
        return self.out_proj(x)
