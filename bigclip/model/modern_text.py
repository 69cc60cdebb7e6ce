"""OpenCLIP main's "modern" text transformer (text_cfg text_arch "modern", its ModernTextTransformer): rotary
positions, SwiGLU (or GELU / squared-ReLU) MLPs, RMSNorm (or LayerNorm), optional gated attention and qk-norm, and
pooling that knows the padding, for captions padded to any length up to the context length (variable_text).

Parameter names are OpenCLIP's (token_embedding, blocks.{i}.{norm1,attn.{qkv,q_norm,k_norm,gate,proj},norm1_post,
ls1,norm2,mlp.{w12,w3 | c_fc,c_proj},norm2_post,ls2}, ln_final, pool.{query,q,kv,q_norm,k_norm}, text_projection,
reg_tokens, norm_pre), so OpenCLIP main's CustomTextCLIP weights load under `text.` unchanged. The text_cfg keys
are OpenCLIP main's CLIPTextCfg fields, read as its tower reads them:

    attention_mode   causal (is_causal, no mask: captions are right-padded, so no real token sees a pad) or
                     bidirectional (an additive mask hides the pad keys)
    pos_embed        rope (1-D rotary, rope_temperature) or none; norm_type rmsnorm (default) / layernorm, norm_eps
    mlp_type         swiglu (hidden int(width * mlp_ratio)), mlp (GELU) or relu2
    attn_gated       out * sigmoid(gate(x)); qk_norm: the norm over each head's q and k
    attention_bias   biases of qkv, proj, gate and the MAP pool (default off), gate_bias (default: attention_bias),
                     mlp_bias (default off), proj_bias (the projection's)
    pool_type        eos (the first eos_id, else the last non-pad token; argmax means eos here), mean (over the
                     non-pad tokens) or map (a learned query attends over them)
    pre_norm, norm_placement (pre / sandwich), ls_init_value, reg_tokens, zero_init_residual: as OpenCLIP's

value_residual (ResFormer) is refused in one line: its blocks pass layer 0's values along, not built here. The
tokenizer's keys (tokenizer_type, tiktoken_name, bos_id, variable_text) are the tokenizer's and the data's.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from bigclip.model.layer_groups import LayerGroups, lock_bottom
from bigclip.model.layers import run_blocks
from bigclip.model.text import layer_scale

# text_cfg keys that are not the tower's: the tokenizer's, the data pipeline's, or the legacy tower's (OpenCLIP
# main's CLIPTextCfg fields its modern tower does not read)
IGNORED_KEYS = (
    "text_arch", "variable_text", "tokenizer_type", "tiktoken_name", "bos_id", "hf_tokenizer_name", "tokenizer_mode",
    "tokenizer_kwargs", "embed_cls", "no_causal_mask", "final_ln_after_pool", "act_kwargs", "norm_kwargs",
    "block_type", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc",
)  # fmt: skip
POOL_TYPES = ("eos", "argmax", "mean", "map")


def _norm(norm_type: str, eps: float):
    if norm_type == "rmsnorm":
        return lambda dim: nn.RMSNorm(dim, eps=eps)
    if norm_type == "layernorm":
        return lambda dim: nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"text_cfg norm_type {norm_type!r}: choose rmsnorm or layernorm")


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.w12 = nn.Linear(dim, hidden * 2, bias=bias)
        self.w3 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = self.w12(x).chunk(2, dim=-1)
        return self.w3(x * F.silu(gate))


class ReLUSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


def rope_table(length: int, head_dim: int, temperature: float, device, dtype) -> torch.Tensor:
    """OpenCLIP main's RotaryEmbedding1D table, (length, head_dim): cos | sin of position x frequency, computed in
    float32. Computed per forward from the shapes (no buffer: nothing to restore after a meta build)."""
    inv_freq = 1.0 / (temperature ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of each head by the table's angles (OpenCLIP's _apply_rope_1d)."""
    cos, sin = table.chunk(2, dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class ModernTextAttention(nn.Module):
    def __init__(self, dim, heads, *, causal, norm_layer, qk_norm, gated, bias, gate_bias):
        super().__init__()
        if dim % heads:
            raise ValueError(f"text width {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim, self.causal = heads, dim // heads, causal
        self.qkv = nn.Linear(dim, dim * 3, bias=bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.gate = nn.Linear(dim, dim, bias=gate_bias) if gated else None
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, key_bias: torch.Tensor | None) -> torch.Tensor:
        b, length, c = x.shape
        q, k, v = self.qkv(x).reshape(b, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        # causal: no mask tensor (pads come last, after every real token); bidirectional: the pad-key bias
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias, is_causal=self.causal)
        out = out.transpose(1, 2).reshape(b, length, c)
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj(out)


class ModernTextBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, norm_layer, *, causal, qk_norm, attn_gated, mlp_type, norm_placement,
                 ls_init_value, attn_bias, gate_bias, mlp_bias):  # fmt: skip
        super().__init__()
        if norm_placement not in ("pre", "sandwich"):
            raise ValueError(f"text_cfg norm_placement {norm_placement!r}: choose pre or sandwich")
        sandwich = norm_placement == "sandwich"
        self.norm1 = norm_layer(dim)
        self.attn = ModernTextAttention(dim, heads, causal=causal, norm_layer=norm_layer, qk_norm=qk_norm,
                                        gated=attn_gated, bias=attn_bias, gate_bias=gate_bias)  # fmt: skip
        self.norm1_post = norm_layer(dim) if sandwich else nn.Identity()
        self.ls1 = layer_scale(dim, ls_init_value)
        self.norm2 = norm_layer(dim)
        hidden = int(dim * mlp_ratio)
        if mlp_type == "swiglu":
            self.mlp = SwiGLU(dim, hidden, bias=mlp_bias)
        elif mlp_type in ("mlp", "relu2"):
            act = nn.GELU() if mlp_type == "mlp" else ReLUSquared()
            self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(dim, hidden, bias=mlp_bias)), ("act", act),
                                                  ("c_proj", nn.Linear(hidden, dim, bias=mlp_bias))]))  # fmt: skip
        else:
            raise ValueError(f"text_cfg mlp_type {mlp_type!r}: choose swiglu, mlp or relu2")
        self.norm2_post = norm_layer(dim) if sandwich else nn.Identity()
        self.ls2 = layer_scale(dim, ls_init_value)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, key_bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.ls1(self.norm1_post(self.attn(self.norm1(x), rope, key_bias)))
        return x + self.ls2(self.norm2_post(self.mlp(self.norm2(x))))


class ModernTextPool(nn.Module):
    """eos: the first eos_id of each row, else its last non-pad token; mean: over the non-pad tokens; map: a learned
    query attending over them."""

    def __init__(self, width: int, pool_type: str, heads: int, norm_layer, bias: bool, qk_norm: bool):
        super().__init__()
        self.pool_type, self.heads = pool_type, heads
        if pool_type == "map":
            if width % heads:
                raise ValueError(f"text width {width} is not divisible by the map pool's heads {heads}")
            self.head_dim = width // heads
            self.query = nn.Parameter(torch.empty(1, 1, width))
            self.q = nn.Linear(width, width, bias=bias)
            self.kv = nn.Linear(width, width * 2, bias=bias)
            self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
            self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, eos_id: int | None):
        if self.pool_type == "mean":
            weights = valid.to(x.dtype)
            return (x * weights.unsqueeze(-1)).sum(dim=1) / weights.sum(dim=1, keepdim=True).clamp(min=1)
        if self.pool_type == "eos":
            eos = tokens == eos_id
            last_valid = valid.long().sum(dim=1).sub(1).clamp(min=0)
            index = torch.where(eos.any(dim=1), eos.int().argmax(dim=1), last_valid)
            return x[torch.arange(x.shape[0], device=x.device), index]
        b, length, c = x.shape
        q = self.q(self.query.to(x.dtype).expand(b, -1, -1)).reshape(b, 1, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(b, length, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        bias = x.new_zeros((b, 1, 1, length)).masked_fill_(~valid[:, None, None, :], torch.finfo(x.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, c)


class ModernTextTower(nn.Module):
    def __init__(
        self, *, embed_dim: int, context_length: int, vocab_size: int, width: int, heads: int, layers: int,
        mlp_ratio: float = 4.0, ls_init_value: float | None = None, pad_id: int | None = 0, eos_id: int | None = None,
        pool_type: str = "argmax", proj_type: str = "linear", proj_bias: bool = False, output_tokens: bool = False,
        attention_mode: str = "causal", pos_embed: str = "rope", rope_temperature: float = 10000.0,
        mlp_type: str = "swiglu", norm_type: str | None = None, norm_eps: float = 1e-6, attn_gated: bool = False,
        qk_norm: bool = False, pre_norm: bool = False, norm_placement: str = "pre", zero_init_residual: bool = False,
        reg_tokens: int = 0, value_residual: bool = False, attention_bias: bool | None = None,
        mlp_bias: bool | None = None, gate_bias: bool | None = None, quick_gelu: bool = False, **ignored,
    ):  # fmt: skip
        super().__init__()
        unknown = sorted(set(ignored) - set(IGNORED_KEYS))
        if unknown:
            raise TypeError(f"text_cfg: unexpected keys {unknown} for the modern text tower")
        if pool_type not in POOL_TYPES:
            raise ValueError(f"text_cfg pool_type {pool_type!r}: choose one of {', '.join(POOL_TYPES)}")
        pool_type = "eos" if pool_type == "argmax" else pool_type  # OpenCLIP main: the same intent, by eos_id
        if pool_type == "eos" and eos_id is None:
            raise ValueError("text_cfg pool_type eos needs eos_id (the tokenizer's end-of-text id)")
        if attention_mode not in ("causal", "bidirectional"):
            raise ValueError(f"text_cfg attention_mode {attention_mode!r}: choose causal or bidirectional")
        if pos_embed not in ("rope", "none", ""):
            raise ValueError(f"text_cfg pos_embed {pos_embed!r}: choose rope or none")
        if width % heads or (pos_embed == "rope" and (width // heads) % 2):
            raise ValueError(f"text width {width} / heads {heads}: must divide into an even head width for rope")
        if value_residual:
            raise ValueError("text_cfg value_residual (OpenCLIP main's ResFormer values) is not built yet")
        self.context_length, self.vocab_size, self.width, self.mlp_ratio = context_length, vocab_size, width, mlp_ratio
        self.pad_id, self.eos_id, self.output_tokens = pad_id, eos_id, output_tokens
        self.causal, self.ls_init_value = attention_mode == "causal", ls_init_value
        self.sandwich, self.zero_init_residual = norm_placement == "sandwich", zero_init_residual
        self.rope_temperature = rope_temperature if pos_embed == "rope" else None
        norm_layer = _norm(norm_type or "rmsnorm", norm_eps)
        attention_bias, mlp_bias = bool(attention_bias), bool(mlp_bias)  # None: off in the modern tower
        gate_bias = attention_bias if gate_bias is None else bool(gate_bias)
        self.token_embedding = nn.Embedding(vocab_size, width, padding_idx=pad_id)
        self.num_reg = max(0, int(reg_tokens or 0))
        self.reg_tokens = nn.Parameter(torch.empty(1, self.num_reg, width)) if self.num_reg else None
        self.norm_pre = norm_layer(width) if pre_norm else nn.Identity()
        self.blocks = nn.ModuleList(
            ModernTextBlock(
                width,
                heads,
                mlp_ratio,
                norm_layer,
                causal=self.causal,
                qk_norm=qk_norm,
                attn_gated=attn_gated,
                mlp_type=mlp_type,
                norm_placement=norm_placement,
                ls_init_value=ls_init_value,
                attn_bias=attention_bias,
                gate_bias=gate_bias,
                mlp_bias=mlp_bias,
            )  # fmt: skip
            for _ in range(layers)
        )
        self.ln_final = norm_layer(width)
        self.pool = ModernTextPool(width, pool_type, heads, norm_layer, attention_bias, qk_norm)
        use_proj = proj_type != "none" and embed_dim
        self.text_projection = nn.Linear(width, embed_dim, bias=proj_bias) if use_proj else None
        self.checkpoint_every = 0

    def activation_shape(self) -> tuple[int, int, int, float]:
        """(layers, tokens, width, MLP ratio) as the memory plan's block formula reads them: the longest caption
        (context_length), and the ratio that makes the formula's 8 + 2 x ratio widths per token what this block
        keeps for the backward (a SwiGLU keeps its two halves, the product and the silu: 4 x hidden; the gate, its
        sigmoid and product: 2 more widths; rope's rotated q and k: 2 more), checked against a meta trace
        (tests/test_modern_text.py)."""
        block = self.blocks[0]
        mlp = 4 if isinstance(block.mlp, SwiGLU) else 2
        extra = 2 * (block.attn.gate is not None) + 2 * (self.rope_temperature is not None)
        return len(self.blocks), self.context_length, self.width, (mlp * self.mlp_ratio + extra) / 2

    def set_grad_checkpointing(self, every: int) -> None:
        self.checkpoint_every = every

    @torch.no_grad()
    def init_weights(self) -> None:
        """OpenCLIP main's init (its init_parameters, norms at one, layer scale at its value); touches every
        parameter, so it works after `to_empty()`."""
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        if self.pad_id is not None:
            self.token_embedding.weight[self.pad_id].zero_()
        if self.reg_tokens is not None:
            nn.init.normal_(self.reg_tokens, std=1e-6)
        layers = len(self.blocks)
        attn_std = 0.02 if self.sandwich else self.width**-0.5
        fc_std = 0.02 if self.sandwich else (2 * self.width) ** -0.5
        proj_std = 0.02 if self.sandwich else attn_std * (2 * layers) ** -0.5
        swiglu_fc_std = fc_std if self.sandwich else fc_std * 1.22  # OpenCLIP main's SwiGLU variance correction

        def linear(layer: nn.Linear, std: float, residual_out: bool = False, bias: float = 0.0) -> None:
            if residual_out and self.zero_init_residual:
                nn.init.zeros_(layer.weight)
            else:
                nn.init.normal_(layer.weight, std=std)
            if layer.bias is not None:
                nn.init.constant_(layer.bias, bias)

        for block in self.blocks:
            linear(block.attn.qkv, attn_std)
            linear(block.attn.proj, proj_std, residual_out=True)
            if block.attn.gate is not None:
                linear(block.attn.gate, attn_std, bias=1.0)  # a mostly open gate: sigmoid(1)
            if isinstance(block.mlp, SwiGLU):
                linear(block.mlp.w12, swiglu_fc_std)
                linear(block.mlp.w3, proj_std, residual_out=True)
            else:
                linear(block.mlp.c_fc, fc_std)
                linear(block.mlp.c_proj, proj_std, residual_out=True)
            for ls in (block.ls1, block.ls2):
                if self.ls_init_value is not None:
                    nn.init.constant_(ls.gamma, self.ls_init_value)
        if self.pool.pool_type == "map":
            nn.init.normal_(self.pool.query, std=self.width**-0.5)
            linear(self.pool.q, self.width**-0.5)
            linear(self.pool.kv, self.width**-0.5)
        if self.text_projection is not None:
            linear(self.text_projection, self.width**-0.5)

    def layer_groups(self, pooler_in_head: bool = True) -> LayerGroups:
        """OpenCLIP main's groups: embeddings (with the registers and the pre-norm), each block (the last with
        ln_final, and the pool unless it is in the head), proj (the pool and the projection)."""
        embeddings = [self.token_embedding, *([self.reg_tokens] if self.reg_tokens is not None else [])]
        if not isinstance(self.norm_pre, nn.Identity):
            embeddings.append(self.norm_pre)
        groups: LayerGroups = [("embeddings", embeddings)]
        groups += [(f"layer.{i}", [block]) for i, block in enumerate(self.blocks)]
        groups[-1][1].extend([self.ln_final] + ([] if pooler_in_head else [self.pool]))
        head = ([self.pool] if pooler_in_head else []) + ([self.text_projection] if self.text_projection else [])
        if head:
            groups.append(("proj", head))
        return groups

    def lock(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
        """Freeze the tower but its top `unlocked_layers` groups, as main; with freeze_layer_norm=False (which main
        refuses) the norms of frozen groups keep training, as in bigclip's other text towers."""
        norms = (nn.LayerNorm, nn.RMSNorm)
        lock_bottom(self.layer_groups(), unlocked_layers, lambda m: isinstance(m, norms) and not freeze_layer_norm)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, L) token ids, right-padded with pad_id to any L -> (B, embed_dim) features; with output_tokens also
        the (B, L, width) token states after ln_final (pads not masked)."""
        valid = torch.ones_like(tokens, dtype=torch.bool) if self.pad_id is None else tokens != self.pad_id
        first = torch.zeros_like(valid)
        first[:, 0] = True
        valid = valid | (~valid.any(dim=1, keepdim=True) & first)  # an all-pad row pools its first position
        x = self.token_embedding(tokens)
        if self.reg_tokens is not None:
            x = torch.cat([self.reg_tokens.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm_pre(x)
        key_bias = None
        if not self.causal:  # the registers are always seen
            keys = torch.cat([valid.new_ones(valid.shape[0], self.num_reg), valid], dim=1)
            key_bias = x.new_zeros((x.shape[0], 1, 1, x.shape[1]))
            key_bias = key_bias.masked_fill(~keys[:, None, None, :], torch.finfo(x.dtype).min)
        rope = None
        if self.rope_temperature is not None:
            head_dim = self.width // self.blocks[0].attn.heads if len(self.blocks) else 2
            rope = rope_table(x.shape[1], head_dim, self.rope_temperature, x.device, x.dtype)
        x = self.ln_final(run_blocks(self.blocks, x, self.checkpoint_every, rope, key_bias))
        states = x[:, self.num_reg :]
        pooled = self.pool(states, tokens, valid, self.eos_id)
        features = pooled if self.text_projection is None else self.text_projection(pooled)
        return (features, states) if self.output_tokens else features
