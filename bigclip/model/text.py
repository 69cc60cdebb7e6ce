"""OpenCLIP's text transformer: CLIP's causal one with EOT pooling, and the variants its text_cfg keys select.

Parameter names follow OpenCLIP's `TextTransformer` (token_embedding, positional_embedding,
transformer.resblocks.{i}.{ln_1,attn,ln_2,mlp.c_fc,mlp.c_proj}, ln_final, text_projection; with
`ls_init_value`, also ls_1.gamma and ls_2.gamma) so OpenCLIP weights load by renaming only the
top-level prefix. Attention keeps `nn.MultiheadAttention`'s parameter names
(in_proj_weight/in_proj_bias/out_proj) but runs through `F.scaled_dot_product_attention` (`is_causal=True` for
CLIP's causal tower), which needs no mask buffer and picks the fused kernels.

The text_cfg keys OpenCLIP's TextTransformer reads, as it reads them:

    no_causal_mask  bidirectional attention (SigLIP, CLIPA, MobileCLIP): every token sees every other, padding
                    included (OpenCLIP masks padding only with embed_cls)
    pool_type       which state is the text's feature: argmax (the largest token id, CLIP's end of text), eos
                    (the first `eos_id`), first, last, or none (every state)
    proj_type       linear (default) or none (no text_projection: the pooled state is the feature);
    proj_bias       the projection as an nn.Linear (text_projection.weight (embed_dim, width) and .bias) instead of
                    a (width, embed_dim) matrix
    act_kwargs      the GELU's arguments (SigLIP 2: approximate "tanh"); norm_kwargs: the LayerNorms' (eps)

CoCa's text tower (`embed_cls`, OpenCLIP's key) appends a learned class embedding (`cls_emb`) after the tokens and
pools it (the last position, ln_final after pooling); its attention is causal and also masks the padding, with
OpenCLIP's mask exactly (`coca_attention_mask`). With `output_tokens` the tower also returns the token states
(before ln_final), which CoCa's decoder reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import LayerScale
from torch import nn

from bigclip.model.layer_groups import LayerGroups, lock_bottom
from bigclip.model.layers import QuickGELU, run_blocks


class CausalSelfAttention(nn.Module):
    """Self-attention, causal unless `causal=False` (OpenCLIP's no_causal_mask: bidirectional)."""

    def __init__(self, width: int, heads: int, causal: bool = True):
        super().__init__()
        if width % heads:
            raise ValueError(f"text width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.causal = causal
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal, or no mask when not causal), or a boolean (B, 1, L, L) saying which keys each query
        sees (True: attend)."""
        batch, length, width = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        # (B, L, 3, H, Dh) -> 3 x (B, H, L, Dh); same split as nn.MultiheadAttention.
        q, k, v = qkv.view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and self.causal)
        return self.out_proj(x.transpose(1, 2).reshape(batch, length, width))


def layer_scale(width: int, init_value: float | None) -> nn.Module:
    """OpenCLIP's rule: LayerScale whenever a value is given, 0 included (zero-init layer scale), else nothing, so
    a model without it keeps its state dict."""
    return nn.Identity() if init_value is None else LayerScale(width, init_values=init_value)


class ResidualAttentionBlock(nn.Module):
    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: float = 4.0,
        act_layer: Callable[[], nn.Module] = nn.GELU,
        ls_init_value: float | None = None,
        *,
        causal: bool = True,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = norm_layer(width)
        self.attn = CausalSelfAttention(width, heads, causal)
        self.ls_1 = layer_scale(width, ls_init_value)
        self.ln_2 = norm_layer(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, hidden)),
                    ("gelu", act_layer()),
                    ("c_proj", nn.Linear(hidden, width)),
                ]
            )
        )
        self.ls_2 = layer_scale(width, ls_init_value)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x), mask))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


def init_blocks(blocks, width: int, ls_init_value: float | None) -> None:
    """OpenCLIP's init of a stack of attention blocks (its text tower's): attention and MLP weights scaled by the
    width and the depth, zero attention biases, layer scale at its starting value."""
    attn_std = width**-0.5
    proj_std = attn_std * (2 * len(blocks)) ** -0.5
    fc_std = (2 * width) ** -0.5
    for block in blocks:
        nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
        nn.init.zeros_(block.attn.in_proj_bias)
        nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
        nn.init.zeros_(block.attn.out_proj.bias)
        nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
        nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        if ls_init_value is not None:
            nn.init.constant_(block.ls_1.gamma, ls_init_value)
            nn.init.constant_(block.ls_2.gamma, ls_init_value)


class Transformer(nn.Module):
    """A stack of blocks under OpenCLIP's `transformer.resblocks` name."""

    def __init__(
        self,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        act_layer: Callable[[], nn.Module],
        ls_init_value: float | None = None,
        *,
        causal: bool = True,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ):
        super().__init__()
        self.resblocks = nn.ModuleList(
            ResidualAttentionBlock(
                width, heads, mlp_ratio, act_layer, ls_init_value, causal=causal, norm_layer=norm_layer
            )
            for _ in range(layers)
        )
        self.checkpoint_every = 0  # 0: no activation checkpointing

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            return run_blocks(self.resblocks, x, self.checkpoint_every)
        return run_blocks(self.resblocks, x, self.checkpoint_every, mask)


# OpenCLIP's text_global_pool: which state of each text is its feature.
POOL_TYPES = ("argmax", "eos", "first", "last", "none")
PROJ_TYPES = ("linear", "none")
# OpenCLIP's custom attention block (its text_cfg block_type and the switches that select it): not built here.
_CUSTOM_BLOCK_KEYS = ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc")


def pool_text(x: torch.Tensor, tokens: torch.Tensor, pool_type: str, eos_id: int) -> torch.Tensor:
    """OpenCLIP's text_global_pool: (B, L, W) states -> (B, W) (pool_type none: the states as they are)."""
    rows = torch.arange(x.shape[0], device=x.device)
    if pool_type == "argmax":  # the end-of-text token has the largest id in CLIP's vocabulary
        return x[rows, tokens.argmax(dim=-1)]
    if pool_type == "eos":  # the first eos_id (a row without one: position 0, as OpenCLIP's argmax of zeros)
        return x[rows, (tokens == eos_id).int().argmax(dim=-1)]
    if pool_type == "first":
        return x[:, 0]
    if pool_type == "last":
        return x[:, -1]
    return x


class TextTransformer(nn.Module):
    def __init__(
        self,
        *,
        context_length: int,
        vocab_size: int,
        width: int,
        heads: int,
        layers: int,
        embed_dim: int,
        mlp_ratio: float = 4.0,
        quick_gelu: bool = False,
        ls_init_value: float | None = None,
        embed_cls: bool = False,
        pad_id: int = 0,
        eos_id: int = 2,
        output_tokens: bool = False,
        no_causal_mask: bool = False,
        pool_type: str = "argmax",
        proj_type: str = "linear",
        proj_bias: bool = False,
        act_kwargs: dict | None = None,
        norm_kwargs: dict | None = None,
        # OpenCLIP's CLIPTextCfg has it, but its text tower reads it nowhere (3.3): the same model without it
        final_ln_after_pool: bool = False,
        block_type: str | None = None,
        **custom_block,
    ):
        super().__init__()
        if pool_type not in POOL_TYPES:
            raise ValueError(f"text_cfg pool_type {pool_type!r}: choose one of {', '.join(POOL_TYPES)}")
        if proj_type not in PROJ_TYPES:
            raise ValueError(f"text_cfg proj_type {proj_type!r}: choose one of {', '.join(PROJ_TYPES)}")
        unknown = set(custom_block) - set(_CUSTOM_BLOCK_KEYS)
        if unknown:
            raise TypeError(f"text_cfg: unexpected keys {sorted(unknown)}")
        custom = sorted(k for k, v in custom_block.items() if v) + (["block_type custom"] * (block_type == "custom"))
        if custom:
            raise ValueError(f"text_cfg {', '.join(custom)} (OpenCLIP's custom attention block) is not built yet")
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.width = width
        self.mlp_ratio = mlp_ratio
        self.ls_init_value = ls_init_value
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.pool_type = pool_type
        self.causal = not no_causal_mask
        self.output_tokens = output_tokens
        self.token_embedding = nn.Embedding(vocab_size, width)
        # CoCa's class embedding, appended after the tokens: one more position.
        self.cls_emb = nn.Parameter(torch.empty(width)) if embed_cls else None
        self.positional_embedding = nn.Parameter(torch.empty(context_length + int(embed_cls), width))
        act_layer = partial(QuickGELU if quick_gelu else nn.GELU, **(act_kwargs or {}))
        norm_layer = partial(nn.LayerNorm, **(norm_kwargs or {}))
        self.transformer = Transformer(
            width, layers, heads, mlp_ratio, act_layer, ls_init_value, causal=self.causal, norm_layer=norm_layer
        )
        self.ln_final = norm_layer(width)
        # OpenCLIP's layouts: x @ text_projection (width, embed_dim), or an nn.Linear with a bias (proj_bias)
        self.text_projection: nn.Parameter | nn.Linear | None = None
        if proj_type == "linear" and embed_dim:
            self.text_projection = (
                nn.Linear(width, embed_dim) if proj_bias else nn.Parameter(torch.empty(width, embed_dim))
            )

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.resblocks

    def activation_shape(self) -> tuple[int, int, int, float]:
        """(layers, tokens, width, MLP ratio): what the memory plan's activation arithmetic needs."""
        return len(self.blocks), len(self.positional_embedding), self.width, float(self.mlp_ratio)

    def set_grad_checkpointing(self, every: int) -> None:
        """Recompute every `every`-th block in backward; 0 turns checkpointing off."""
        self.transformer.checkpoint_every = every

    def init_weights(self) -> None:
        """OpenCLIP's text-tower init; touches every parameter, so it works after `to_empty()`."""
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.Linear, nn.Embedding)):
                module.reset_parameters()
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        if self.cls_emb is not None:
            nn.init.normal_(self.cls_emb, std=0.01)
        init_blocks(self.blocks, self.width, self.ls_init_value)
        if isinstance(self.text_projection, nn.Linear):
            nn.init.normal_(self.text_projection.weight, std=self.width**-0.5)
            nn.init.zeros_(self.text_projection.bias)
        elif self.text_projection is not None:
            nn.init.normal_(self.text_projection, std=self.width**-0.5)

    def layer_groups(self, pooler_in_head: bool = True) -> LayerGroups:
        """OpenCLIP's groups of its text tower (model/layer_groups.py): embeddings, each block (the last with
        ln_final), proj (when there is a projection). (`pooler_in_head`: for the Hugging Face towers' signature;
        this tower has no pooler.)"""
        embeddings = [self.token_embedding, self.positional_embedding]
        if self.cls_emb is not None:
            embeddings.append(self.cls_emb)
        groups: LayerGroups = [("embeddings", embeddings)]
        groups += [(f"layer.{i}", [block]) for i, block in enumerate(self.blocks)]
        groups[-1][1].append(self.ln_final)
        if self.text_projection is not None:
            groups.append(("proj", [self.text_projection]))
        return groups

    def lock(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
        """Freeze the tower except its top `unlocked_layers` layer groups. With freeze_layer_norm=False,
        LayerNorms in frozen groups keep training."""
        lock_bottom(
            self.layer_groups(), unlocked_layers, lambda m: isinstance(m, nn.LayerNorm) and not freeze_layer_norm
        )

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(pooled)
        return pooled if self.text_projection is None else pooled @ self.text_projection

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, L) token ids -> (B, embed_dim) features; with output_tokens, (features, (B, L, width) token states)."""
        length = tokens.shape[1]
        if length > self.context_length:
            raise ValueError(f"text has {length} tokens but the model's context length is {self.context_length}")
        x = self.token_embedding(tokens)
        if self.cls_emb is None:
            x = self.transformer(x + self.positional_embedding[:length])
            states = x = self.ln_final(x)
            pooled = pool_text(x, tokens, self.pool_type, self.eos_id)
        else:  # OpenCLIP: the appended class embedding is the feature, whatever pool_type says
            x = torch.cat([x, self.cls_emb.to(x.dtype).expand(x.shape[0], 1, -1)], dim=1)
            x = x + self.positional_embedding[: length + 1]
            x = self.transformer(x, coca_attention_mask(tokens, self.pad_id, self.causal))
            pooled, states = self.ln_final(x[:, -1]), x[:, :-1]
        features = self.project(pooled)
        return (features, states) if self.output_tokens else features


def coca_attention_mask(tokens: torch.Tensor, pad_id: int, causal: bool = True) -> torch.Tensor:
    """OpenCLIP's attention mask of CoCa's text tower (class embedding appended), as booleans (B, 1, L+1, L+1),
    True where a query attends: causal (unless not `causal`: no_causal_mask), and key j is hidden when token j-1
    is padding. The shift by one is OpenCLIP's (its "legacy" mask, which every released CoCa was trained with: the
    class position's validity is put first, the tokens' after it), kept so OpenCLIP's weights give OpenCLIP's
    outputs. Key 0 is always seen, so no row is empty."""
    batch, length = tokens.shape
    keys = torch.cat([tokens.new_ones(batch, 1, dtype=torch.bool), tokens != pad_id], dim=1)
    if not causal:
        return keys[:, None, None, :].expand(batch, 1, length + 1, length + 1)
    causal_mask = torch.ones(length + 1, length + 1, dtype=torch.bool, device=tokens.device).tril()
    return (causal_mask & keys[:, None, :])[:, None]
