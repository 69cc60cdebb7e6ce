"""OpenCLIP main's modern text tower and tiktoken tokenizer, the oracle of tests/test_modern_text.py.

Copied byte for byte from https://github.com/mlfoundations/open_clip at commit
89fb801f1e6087880e951fc8354b8a2077b79c6d (main, 4.2.0.dev; not on PyPI, so it cannot be installed here), under
OpenCLIP's MIT license (Copyright (c) 2012-2021 Gabriel Ilharco, Mitchell Wortsman, Nicholas Carlini, Rohan Taori,
Achal Dave, Vaishaal Shankar, John Miller, Hongseok Namkoong, Hannaneh Hajishirzi, Ali Farhadi, Ludwig Schmidt):

    src/open_clip/model.py        CLIPTextCfg (lines 79-150)
    src/open_clip/transformer.py  SwiGLU .. ModernTextTransformer (lines 957-1576), _set_group_requires_grad and
                                  _lock_layer_groups (lines 2034-2053)
    src/open_clip/tokenizer.py    TikTokenTokenizer (lines 704-804)
    src/open_clip_train/naflex_data.py  collate_variable_text (lines 157-193: how main batches variable_text)

Only the imports below are this file's own (the names those lines use, from open_clip_torch 3.3, whose LayerNorm,
LayerScale, feature_take_indices and get_clean_fn main still has unchanged). The copies are checked against the
mirror by tests/test_modern_text.py where the mirror is at hand.
"""
# ruff: noqa
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from open_clip.tokenizer import get_clean_fn
from open_clip.transformer import LayerNorm, LayerScale
from open_clip.utils import feature_take_indices
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint



@dataclass
class CLIPTextCfg:
    text_arch: str = "clip"  # "clip" (native/HF) or "modern" (dedicated text tower only)
    context_length: int = 77
    variable_text: bool = False
    vocab_size: int = 49408
    hf_tokenizer_name: Optional[str] = None
    tokenizer_mode: Optional[str] = None
    tokenizer_kwargs: Optional[dict] = None

    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    ls_init_value: Optional[float] = None  # layer scale initial value
    embed_cls: bool = False
    pad_id: int = 0
    bos_id: Optional[int] = None
    # Only used for pool_type == 'eos' (and the modern text arch 'argmax' remap). No default on purpose: it must
    # match the tokenizer's eos/eot id (e.g. 1 for mt5, 2 for xlm-v, 50257 for the GenLIP tiktoken vocab), so
    # configs that pool on eos are required to set it explicitly and it is validated against the tokenizer.
    eos_id: Optional[int] = None
    tokenizer_type: str = ''
    tiktoken_name: str = 'cl100k_base'
    no_causal_mask: bool = False  # disable causal masking
    final_ln_after_pool: bool = False  # apply final LayerNorm after pooling
    pool_type: str = 'argmax'
    proj_bias: bool = False
    proj_type: str = 'linear'  # control final text projection, 'none' forces no projection
    output_tokens: bool = False
    act_kwargs: dict = None
    norm_kwargs: dict = None

    # Custom attention block settings
    block_type: Optional[str] = None  # attention block type ('default', 'custom'), auto-selects 'custom' if any custom features enabled
    qk_norm: bool = False  # apply layer norm to q and k in attention
    scaled_cosine_attn: bool = False  # use scaled cosine attention
    scale_heads: bool = False  # learnable head-specific scale applied to attention logits
    scale_attn_inner: bool = False  # apply layer norm on attention context, before output projection
    scale_attn: bool = False  # apply layer norm after full attention block
    scale_fc: bool = False  # apply layer norm in MLP block

    # ModernTextTransformer settings (text_arch == "modern")
    attention_mode: str = "causal"  # "causal" or "bidirectional"
    pos_embed: str = "rope"
    rope_temperature: float = 10000.0
    mlp_type: str = "swiglu"  # "swiglu", "mlp" (GELU), or "relu2" (squared-ReLU)
    # Norm flavor, tri-state (drop-in LayerNorm<->RMSNorm): None = arch default (modern -> rmsnorm, legacy -> layernorm).
    norm_type: Optional[str] = None
    norm_eps: float = 1e-6
    attn_gated: bool = False
    pre_norm: bool = False  # normalize embeddings (after register concat) before block 0 (timm ViT norm_pre)
    # "pre" or "sandwich" (extra norm on sublayer outputs, Gemma-2 style). Sandwich also switches block init
    # to flat N(0, 0.02) (OLMo2-style): the post-norms renormalize sublayer outputs, undoing depth scaling.
    norm_placement: str = "pre"
    zero_init_residual: bool = False  # zero the residual out-projs (attn proj, mlp out): blocks start as identity
    reg_tokens: int = 0  # learned register tokens prepended to the sequence and excluded from pooling
    value_residual: bool = False  # mix each layer's V with layer-0 V via a learned per-layer scalar (ResFormer)
    # Linear biases, tri-state: None = arch default (modern -> off per LLaMA/PaLM, legacy -> on for pretrained).
    # attention_bias: qkv, attn out-proj, gate, MAP-pool q/kv. mlp_bias: the MLP. (text_projection bias is `proj_bias`.)
    attention_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    # Gate-bias override (gated attention only): None inherits attention_bias; True/False force it on/off. Lets the
    # mostly-open gate init (sigmoid(1)~=0.73) survive attention_bias=False -- the one bias worth keeping there.
    gate_bias: Optional[bool] = None

    # HuggingFace specific text tower config
    hf_model_name: Optional[str] = None
    hf_model_pretrained: bool = True
    hf_proj_type: str = 'mlp'
    hf_pooler_type: str = 'mean_pooler'  # attentional pooling for HF models
    hf_model_config: Optional[dict] = None  # HF config overrides, e.g. {"hidden_dropout_prob": 0.0}


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool = True):
        super().__init__()
        self.w12 = nn.Linear(dim, hidden_dim * 2, bias=bias)
        self.w3 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = self.w12(x).chunk(2, dim=-1)
        return self.w3(x * F.silu(gate))


class ReLUSquared(nn.Module):
    """Squared-ReLU activation (Primer); simpler than SwiGLU and competitive at small model scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class RotaryEmbedding1D(nn.Module):
    def __init__(self, dim: int, temperature: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE head dim must be even, got {dim}.")
        inv_freq = 1.0 / (temperature ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Return cos/sin concatenated as one ``[seq_len, head_dim]`` table (cos | sin halves).

        Computed once per forward in the parent tower and threaded through every block (timm-style cat layout),
        rather than recomputed per layer.
        """
        pos = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(pos, self.inv_freq.to(device=device))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype)


def _apply_rope_1d(x: torch.Tensor, rope_embed: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_embed.chunk(2, dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class ModernTextAttention(nn.Module):
    def __init__(
            self,
            dim: int,
            heads: int,
            qk_norm: bool = False,
            norm_layer: Optional[Callable[[int], nn.Module]] = None,
            gated: bool = False,
            value_residual: bool = False,
            vr_first: bool = False,
            bias: bool = True,
            gate_bias: bool = True,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"text width {dim} must be divisible by heads {heads}.")
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, dim * 3, bias=bias)
        # qk-norm over head_dim follows the model's norm type (norm_layer), default RMSNorm.
        qk_norm_layer = norm_layer if norm_layer is not None else (lambda d: nn.RMSNorm(d, eps=1e-6))
        self.q_norm = qk_norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = qk_norm_layer(self.head_dim) if qk_norm else nn.Identity()
        # Gate bias is decoupled from `bias` so the mostly-open init (init_parameters) can survive bias-free attn.
        self.gate = nn.Linear(dim, dim, bias=gate_bias) if gated else None
        # Value residual (ResFormer): mix this layer's V with layer-0's V via a learned scalar,
        # v = lerp(v_first, v, vr_lambda); init 0.5 = equal mix, lambda -> 1 recovers plain attention.
        # Layer 0 only *produces* v_first (vr_first), so it gets no lambda (an unused param breaks DDP).
        self.value_residual = value_residual
        self.vr_lambda = nn.Parameter(torch.full((1,), 0.5)) if (value_residual and not vr_first) else None
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(
            self,
            x: torch.Tensor,
            rope_embed: Optional[torch.Tensor] = None,
            key_bias: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            v_first: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        b, l, c = x.shape
        qkv = self.qkv(x).reshape(b, l, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        v_out = None
        if self.value_residual:
            # Layer 0 (v_first None) contributes its raw V; later layers mix and propagate v_first unchanged.
            # vr_lambda stays fp32 under static low-precision conversion (convert_weights_to_lp only converts
            # module weights), so cast at use like reg_tokens / norm weights.
            v_out = v if v_first is None else v_first
            if self.vr_lambda is not None and v_first is not None:
                v = torch.lerp(v_first, v, self.vr_lambda.to(v.dtype))
        q, k = self.q_norm(q), self.k_norm(k)
        if rope_embed is not None:
            q = _apply_rope_1d(q, rope_embed)
            k = _apply_rope_1d(k, rope_embed)
        # Causal mode passes is_causal (no mask tensor); bidirectional passes a [B, 1, 1, L] key-pad bias. SDPA
        # forbids both at once, and the two are mutually exclusive here (see ModernTextTransformer._attn_inputs).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias, is_causal=is_causal)
        out = out.transpose(1, 2).reshape(b, l, c)
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj(out), v_out


class ModernTextBlock(nn.Module):
    def __init__(
            self,
            dim: int,
            heads: int,
            mlp_ratio: float,
            norm_layer: Callable[[int], nn.Module],
            qk_norm: bool = False,
            attn_gated: bool = False,
            mlp_type: str = "swiglu",
            norm_placement: str = "pre",
            ls_init_value: Optional[float] = None,
            value_residual: bool = False,
            vr_first: bool = False,
            attn_bias: bool = True,
            gate_bias: bool = True,
            mlp_bias: bool = True,
    ):
        super().__init__()
        if norm_placement not in ("pre", "sandwich"):
            raise ValueError(f"unknown modern text norm_placement={norm_placement!r}")
        sandwich = norm_placement == "sandwich"
        self.norm1 = norm_layer(dim)
        self.attn = ModernTextAttention(
            dim,
            heads,
            qk_norm=qk_norm,
            norm_layer=norm_layer,
            gated=attn_gated,
            value_residual=value_residual,
            vr_first=vr_first,
            bias=attn_bias,
            gate_bias=gate_bias,
        )
        # Sandwich placement (Gemma-2 style): an extra norm on each sublayer *output*, before LayerScale and
        # the residual add; widens the stable-LR range at the cost of two extra norms per block.
        self.norm1_post = norm_layer(dim) if sandwich else nn.Identity()
        self.ls1 = LayerScale(dim, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.norm2 = norm_layer(dim)
        hidden = int(dim * mlp_ratio)
        if mlp_type == "swiglu":
            self.mlp = SwiGLU(dim, hidden, bias=mlp_bias)
        elif mlp_type in ("mlp", "relu2"):
            self.mlp = nn.Sequential(OrderedDict([
                ("c_fc", nn.Linear(dim, hidden, bias=mlp_bias)),
                ("act", nn.GELU() if mlp_type == "mlp" else ReLUSquared()),
                ("c_proj", nn.Linear(hidden, dim, bias=mlp_bias)),
            ]))
        else:
            raise ValueError(f"unknown modern text mlp_type={mlp_type!r}")
        self.norm2_post = norm_layer(dim) if sandwich else nn.Identity()
        self.ls2 = LayerScale(dim, ls_init_value) if ls_init_value is not None else nn.Identity()

    def get_weight_dtype(self) -> torch.dtype:
        return self.attn.qkv.weight.dtype

    def forward(
            self,
            x: torch.Tensor,
            rope_embed: Optional[torch.Tensor] = None,
            key_bias: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            v_first: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        attn_out, v_first = self.attn(
            self.norm1(x), rope_embed=rope_embed, key_bias=key_bias, is_causal=is_causal, v_first=v_first,
        )
        x = x + self.ls1(self.norm1_post(attn_out))
        x = x + self.ls2(self.norm2_post(self.mlp(self.norm2(x))))
        return x, v_first


class ModernTextPool(nn.Module):
    def __init__(
            self,
            width: int,
            pool_type: str = "eos",
            heads: int = 8,
            norm_layer: Optional[Callable[[int], nn.Module]] = None,
            bias: bool = True,
            qk_norm: bool = False,
    ):
        super().__init__()
        self.pool_type = pool_type
        self.heads = heads
        if pool_type == "map":
            if width % heads:
                raise ValueError(f"text width {width} must be divisible by MAP heads {heads}.")
            self.head_dim = width // heads
            self.query = nn.Parameter(torch.empty(1, 1, width))
            self.q = nn.Linear(width, width, bias=bias)
            self.kv = nn.Linear(width, width * 2, bias=bias)
            # qk-norm over head_dim (bf16 logit stability, as in the blocks): model norm type, default RMSNorm.
            # No kv pre-norm -- ln_final already normalises the pool input.
            qk_norm_layer = norm_layer if norm_layer is not None else (lambda d: nn.RMSNorm(d, eps=1e-6))
            self.q_norm = qk_norm_layer(self.head_dim) if qk_norm else nn.Identity()
            self.k_norm = qk_norm_layer(self.head_dim) if qk_norm else nn.Identity()
            nn.init.normal_(self.query, std=width ** -0.5)
        elif pool_type in ("eos", "mean"):
            self.query = None
        else:
            # NOTE: no 'last' here on purpose -- in open_clip 'last' means the last *physical* position
            # (SigLIP / CLIPA fixed-length contract), which is padding for this variable-length tower. The
            # masked equivalent (last valid token) is the no-eos-in-row fallback of the 'eos' branch.
            raise ValueError(f"unknown modern text pool_type={pool_type!r}")

    def forward(
            self,
            x: torch.Tensor,
            text: torch.Tensor,
            valid: torch.Tensor,
            eos_id: Optional[int],
    ) -> torch.Tensor:
        if self.pool_type == "mean":
            weights = valid.to(x.dtype)
            return (x * weights.unsqueeze(-1)).sum(dim=1) / weights.sum(dim=1, keepdim=True).clamp(min=1)
        if self.pool_type == "eos":
            # Pool at the first eos_id occurrence; rows without one (eos lost to truncation) fall back to the
            # last valid (non-pad) token, which is where the eos would sit under the right-padded contract.
            eos = text == eos_id
            last_valid = valid.long().sum(dim=1).sub(1).clamp(min=0)
            idx = torch.where(eos.any(dim=1), eos.int().argmax(dim=1), last_valid)
            return x[torch.arange(x.shape[0], device=x.device), idx]

        b, l, c = x.shape
        # The learned query latent stays fp32 under static low-precision conversion; cast at use.
        q = self.q(self.query.to(x.dtype).expand(b, -1, -1)).reshape(b, 1, self.heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).reshape(b, l, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        attn_bias = x.new_zeros((b, 1, 1, l))
        attn_bias.masked_fill_(~valid[:, None, None, :], torch.finfo(x.dtype).min)
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=False)
        return pooled.transpose(1, 2).reshape(b, c)


class ModernTextTransformer(nn.Module):
    """Dedicated variable-length text tower: RoPE, SwiGLU/ReLU^2, masked pooling, and optional gated attention,
    qk-norm, embedding pre-norm, sandwich norms, register tokens, and layer-0 value residuals."""

    def __init__(
            self,
            cfg: Any,
            output_dim: int,
    ):
        super().__init__()
        self.cfg = cfg
        self.variable_text = bool(getattr(cfg, "variable_text", False))
        # Classic 'argmax' pooling (CLIP picks the EOT as the max token id) maps to 'eos' here: same intent,
        # keyed on the configured eos token id. eos_id has no config default and is validated below (and against
        # the tokenizer in get_tokenizer), so a stale/wrong id fails fast instead of pooling silently wrong.
        pool_type = "eos" if cfg.pool_type == "argmax" else cfg.pool_type
        if pool_type == "eos" and cfg.eos_id is None:
            raise ValueError(
                "modern text 'eos' (or 'argmax') pooling requires text_cfg.eos_id "
                "(must match the tokenizer eos/eot token id)."
            )

        if cfg.attention_mode not in ("causal", "bidirectional"):
            raise ValueError(f"unknown modern text attention_mode={cfg.attention_mode!r}")
        if cfg.pos_embed not in ("rope", "none", ""):
            raise ValueError(f"unknown modern text pos_embed={cfg.pos_embed!r}")
        if cfg.width % cfg.heads != 0:
            raise ValueError(f"modern text width ({cfg.width}) must be divisible by heads ({cfg.heads}).")
        if cfg.pos_embed == "rope" and (cfg.width // cfg.heads) % 2 != 0:
            raise ValueError(
                f"modern text RoPE head dim must be even, got width / heads = {cfg.width // cfg.heads}."
            )

        # Public text-tower API used by CustomTextCLIP/CLAP, tokenizer checks, and training setup. Keep the rest
        # in cfg or private fields so config knobs do not become accidental model attributes.
        self.context_length = cfg.context_length
        self.num_pos = cfg.context_length
        self.vocab_size = cfg.vocab_size
        self.width = cfg.width
        self.layers = cfg.layers
        self.output_dim = output_dim
        self.pad_id = cfg.pad_id
        self.eos_id = cfg.eos_id

        # norm_type is tri-state on the shared cfg (None = arch default); the modern tower defaults to RMSNorm.
        norm_type = cfg.norm_type if cfg.norm_type is not None else "rmsnorm"
        if norm_type == "rmsnorm":
            norm_layer = lambda dim: nn.RMSNorm(dim, eps=cfg.norm_eps)
        elif norm_type == "layernorm":
            norm_layer = lambda dim: LayerNorm(dim, eps=cfg.norm_eps)
        else:
            raise ValueError(f"unknown modern text norm_type={norm_type!r}")

        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width, padding_idx=cfg.pad_id)
        # Learned register tokens: prepended to the sequence (always valid) and excluded from pooling. In
        # bidirectional mode they are true scratch positions (read and write the whole sequence). In causal
        # mode the prefix can only be *attended to*, not read from text, so they act as learned attention
        # sinks -- still useful for soaking up sink/outlier mass, but a weaker mechanism than bidirectional
        # registers, and largely redundant with a BOS token.
        self.num_reg = max(0, int(getattr(cfg, "reg_tokens", 0) or 0))
        self.reg_tokens = nn.Parameter(torch.empty(1, self.num_reg, cfg.width)) if self.num_reg else None
        # One rope module on the tower; the cos/sin table is computed once per forward and threaded through the
        # blocks (ModernTextAttention applies it), instead of being recomputed inside every layer.
        self.rope = RotaryEmbedding1D(
            cfg.width // cfg.heads,
            temperature=cfg.rope_temperature,
        ) if cfg.pos_embed == "rope" else None
        # Embedding norm before block 0 (timm ViT pre_norm / norm_pre; ModernBERT embeddings.norm), applied
        # after register concat.
        self.norm_pre = norm_layer(cfg.width) if getattr(cfg, "pre_norm", False) else nn.Identity()
        # attention_bias/mlp_bias are tri-state on the shared cfg (None = arch default). This is the modern tower,
        # so None resolves off; bool() collapses None/False -> False, True -> True. attention_bias covers
        # qkv/proj/gate + MAP q/kv, mlp_bias the MLP.
        attention_bias = bool(getattr(cfg, "attention_bias", None))
        mlp_bias = bool(getattr(cfg, "mlp_bias", None))
        # Gate-bias override: None inherits attention_bias; True/False force on/off so the mostly-open gate init
        # stays available with attention_bias off (see init_parameters).
        gate_bias_cfg = getattr(cfg, "gate_bias", None)
        gate_bias = attention_bias if gate_bias_cfg is None else bool(gate_bias_cfg)
        self.blocks = nn.ModuleList([
            ModernTextBlock(
                cfg.width,
                cfg.heads,
                mlp_ratio=cfg.mlp_ratio,
                norm_layer=norm_layer,
                qk_norm=cfg.qk_norm,
                attn_gated=cfg.attn_gated,
                mlp_type=cfg.mlp_type,
                norm_placement=getattr(cfg, "norm_placement", "pre"),
                ls_init_value=cfg.ls_init_value,
                value_residual=getattr(cfg, "value_residual", False),
                vr_first=(i == 0),
                attn_bias=attention_bias,
                gate_bias=gate_bias,
                mlp_bias=mlp_bias,
            )
            for i in range(cfg.layers)
        ])
        self.ln_final = norm_layer(cfg.width)
        self.pool = ModernTextPool(
            cfg.width,
            pool_type=pool_type,
            heads=cfg.heads,
            norm_layer=norm_layer,
            bias=attention_bias,
            qk_norm=cfg.qk_norm,
        )
        self.text_projection = (
            None
            if cfg.proj_type == "none" or not output_dim
            else nn.Linear(cfg.width, output_dim, bias=cfg.proj_bias)
        )
        self.grad_checkpointing = False
        self.init_parameters()

    def init_parameters(self):
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        if self.pad_id is not None:
            with torch.no_grad():
                self.token_embedding.weight[self.pad_id].zero_()
        if self.reg_tokens is not None:
            # timm cls/reg token convention: near-zero so registers start as blank slates that attention
            # cannot initially key onto, growing only as needed.
            nn.init.normal_(self.reg_tokens, std=1e-6)

        # Block init scheme:
        # - 'pre' norm (default): GPT-2 / CLIP convention -- inputs at `width**-0.5`, residual out-projs
        #   (`proj`, `w3` / `c_proj`) scaled by `(2*layers)**-0.5` to keep residual variance flat with depth.
        # - 'sandwich' norm: flat N(0, 0.02) (OLMo2-style); the post-norms undo depth scaling anyway.
        # - `zero_init_residual`: out-projs zeroed -> identity blocks at init; supersedes the depth factor
        #   (overlaps with `ls_init_value` -- prefer one or the other).
        # Norm weights stay 1.0 (set in constructors); biases zeroed except the attention gate.
        sandwich = getattr(self.cfg, "norm_placement", "pre") == "sandwich"
        zero_residual = bool(getattr(self.cfg, "zero_init_residual", False))
        attn_std = 0.02 if sandwich else self.width ** -0.5
        fc_std = 0.02 if sandwich else (2 * self.width) ** -0.5
        proj_std = 0.02 if sandwich else attn_std * ((2 * self.layers) ** -0.5)
        # SwiGLU correction ('pre' scheme only): the gate product `u * silu(v)` carries ~2.4x less variance at
        # init than the GELU hidden `fc_std` assumes; 1.22x on `w12` (MC-calibrated, width-independent since
        # pre-act var is exactly 1/2 under this scheme) restores parity.
        swiglu_fc_std = fc_std if sandwich else fc_std * 1.22

        def init_residual_out(weight):
            if zero_residual:
                nn.init.zeros_(weight)
            else:
                nn.init.normal_(weight, std=proj_std)

        for block in self.blocks:
            attn = block.attn
            nn.init.normal_(attn.qkv.weight, std=attn_std)
            if attn.qkv.bias is not None:
                nn.init.zeros_(attn.qkv.bias)
            init_residual_out(attn.proj.weight)
            if attn.proj.bias is not None:
                nn.init.zeros_(attn.proj.bias)
            if attn.gate is not None:
                # Mostly-open gate at init: bias 1 -> sigmoid(1) ~= 0.73, so gating starts near-transparent
                # (a half-open 0.5 gate halves attention output magnitude, fighting the residual init scheme).
                # Needs a gate bias to exist: set gate_bias=True to keep this when attention_bias is off, else the
                # bias-free gate falls back to sigmoid(~0) ~= 0.5.
                nn.init.normal_(attn.gate.weight, std=attn_std)
                if attn.gate.bias is not None:
                    nn.init.ones_(attn.gate.bias)
            if attn.vr_lambda is not None:
                nn.init.constant_(attn.vr_lambda, 0.5)  # equal layer-0 / current-layer value mix at init
            mlp = block.mlp
            if isinstance(mlp, SwiGLU):
                nn.init.normal_(mlp.w12.weight, std=swiglu_fc_std)
                if mlp.w12.bias is not None:
                    nn.init.zeros_(mlp.w12.bias)
                init_residual_out(mlp.w3.weight)
                if mlp.w3.bias is not None:
                    nn.init.zeros_(mlp.w3.bias)
            else:  # nn.Sequential MLP (c_fc, act, c_proj)
                nn.init.normal_(mlp.c_fc.weight, std=fc_std)
                if mlp.c_fc.bias is not None:
                    nn.init.zeros_(mlp.c_fc.bias)
                init_residual_out(mlp.c_proj.weight)
                if mlp.c_proj.bias is not None:
                    nn.init.zeros_(mlp.c_proj.bias)

        # MAP attentive-pool projections (the learned ``query`` is already initialized in ModernTextPool.__init__).
        # The pool/head init is scheme-independent: the block-init choice (flat/sandwich, zero-residual) only
        # governs the residual stream, not the readout.
        if getattr(self.pool, "query", None) is not None:
            nn.init.normal_(self.pool.q.weight, std=self.width ** -0.5)
            if self.pool.q.bias is not None:
                nn.init.zeros_(self.pool.q.bias)
            nn.init.normal_(self.pool.kv.weight, std=self.width ** -0.5)
            if self.pool.kv.bias is not None:
                nn.init.zeros_(self.pool.kv.bias)

        if self.text_projection is not None:
            nn.init.normal_(self.text_projection.weight, std=self.width ** -0.5)
            if self.text_projection.bias is not None:
                nn.init.zeros_(self.text_projection.bias)

    def _valid_mask(self, text: torch.Tensor) -> torch.Tensor:
        if self.pad_id is None:
            return torch.ones_like(text, dtype=torch.bool)
        valid = text != self.pad_id
        # Guarantee at least one valid position per row so degenerate all-pad rows do not yield NaNs at pooling.
        # Done branchlessly (no data-dependent ``if``) so the tower stays torch.compile(fullgraph=True)-friendly:
        # for rows that already have a valid token this is a no-op (the OR'd term is all-False).
        empty = ~valid.any(dim=1, keepdim=True)
        first = torch.zeros_like(valid)
        first[:, 0] = True
        return valid | (empty & first)

    def _attn_inputs(
            self,
            text: torch.Tensor,
            dtype: torch.dtype,
            num_prefix: int = 0,
    ) -> Tuple[bool, Optional[torch.Tensor], torch.Tensor]:
        """Resolve SDPA attention inputs for this batch as ``(is_causal, key_bias, valid)``.

        The branch is on the static attention mode (no data-dependent control flow, so torch.compile
        sees one graph per mode):

        - ``"causal"``: ``is_causal=True`` with **no** mask tensor. Captions are right-padded (the collators fill
          the tail with ``pad_id``), so under the causal constraint real tokens never attend to pad positions and
          pad-position outputs are discarded at pooling -- masking pad keys is a no-op for the pooled output, and
          dropping the ``[B, 1, L, L]`` mask removes the L^2 materialization (the dominant memory + compile cost).
        - ``"bidirectional"``: a ``[B, 1, 1, L]`` additive key-pad bias (broadcast over the query axis); real
          tokens here *can* see pads, so the mask is required.

        ``num_prefix`` always-valid positions (register tokens) are prepended to the key axis of the bias;
        the returned ``valid`` covers the text positions only (it drives pooling, which excludes registers).
        """
        b, l = text.shape
        valid = self._valid_mask(text)
        if self.cfg.attention_mode == "causal":
            return True, None, valid
        key_valid = valid
        if num_prefix:
            key_valid = torch.cat([valid.new_ones(b, num_prefix), valid], dim=1)
        key_bias = torch.zeros((b, 1, 1, l + num_prefix), device=text.device, dtype=dtype)
        key_bias.masked_fill_(~key_valid[:, None, None, :], torch.finfo(dtype).min)
        return False, key_bias, valid

    def get_cast_dtype(self) -> torch.dtype:
        return self.blocks[0].get_weight_dtype() if self.blocks else self.token_embedding.weight.dtype

    def set_grad_checkpointing(self, enable: bool = True, impl: str = "inline"):
        if impl == "composable" and enable:
            from torch.distributed._composable import checkpoint as composable_checkpoint
            for block in self.blocks:
                composable_checkpoint(block)
        else:
            self.grad_checkpointing = enable

    def layer_groups(self, pooler_in_head: bool = True):
        embed = [self.token_embedding]
        if self.reg_tokens is not None:
            embed.append(self.reg_tokens)
        if not isinstance(self.norm_pre, nn.Identity):
            embed.append(self.norm_pre)
        groups = [("embeddings", embed)]
        n = len(self.blocks)
        for i, block in enumerate(self.blocks):
            members = [block]
            if i == n - 1:
                members.append(self.ln_final)
                if not pooler_in_head:
                    members.append(self.pool)
            groups.append((f"layer.{i}", members))
        head = []
        if pooler_in_head:
            head.append(self.pool)
        if self.text_projection is not None:
            head.append(self.text_projection)
        if head:
            groups.append(("proj", head))
        return groups

    def lock(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True, pooler_in_head: bool = True):
        assert freeze_layer_norm, 'Unfreezing normalization layers is not supported.'
        _lock_layer_groups(self.layer_groups(pooler_in_head), unlocked_layers)

    def no_weight_decay(self):
        # Learned token-like params follow the positional_embedding / cls_emb convention: excluded from decay
        # (registers and the MAP pool's query latent); the 1-D rule already covers norms, biases, and scalars.
        no_wd = set()
        if self.reg_tokens is not None:
            no_wd.add("reg_tokens")
        if getattr(self.pool, "query", None) is not None:
            no_wd.add("pool.query")
        return no_wd

    def _encode_tokens(
            self,
            text: torch.Tensor,
            take_indices: Optional[List[int]] = None,
            stop_index: Optional[int] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
        """Run the block stack, returning ``(x, valid, intermediates)`` with ``x`` pre-``ln_final``.

        ``x`` (and collected intermediates) include the ``num_reg`` register prefix when configured; ``valid``
        covers the text positions only. ``take_indices`` collects raw block outputs for
        ``forward_intermediates``; ``stop_index`` truncates the stack (early exit) when only intermediates are
        needed.
        """
        cast_dtype = self.get_cast_dtype()
        x = self.token_embedding(text).to(cast_dtype)
        if self.reg_tokens is not None:
            x = torch.cat([self.reg_tokens.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm_pre(x)
        is_causal, key_bias, valid = self._attn_inputs(text, x.dtype, num_prefix=self.num_reg)
        rope_embed = self.rope(x.shape[1], x.device, x.dtype) if self.rope is not None else None
        blocks = self.blocks if stop_index is None else self.blocks[:stop_index + 1]
        intermediates = []
        v_first = None
        for i, block in enumerate(blocks):
            if self.grad_checkpointing:
                x, v_first = checkpoint(block, x, rope_embed, key_bias, is_causal, v_first, use_reentrant=False)
            else:
                x, v_first = block(
                    x, rope_embed=rope_embed, key_bias=key_bias, is_causal=is_causal, v_first=v_first,
                )
            if take_indices is not None and i in take_indices:
                intermediates.append(x)
        return x, valid, intermediates

    def forward_intermediates(
            self,
            text: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            stop_early: bool = False,
            normalize_intermediates: bool = False,
            intermediates_only: bool = False,
            output_fmt: str = 'NLC',
            output_extra_tokens: bool = False,
    ) -> Dict[str, Union[torch.Tensor, List[torch.Tensor]]]:
        assert output_fmt == 'NLC', 'ModernTextTransformer only supports NLC text intermediates.'
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, valid, intermediates = self._encode_tokens(
            text,
            take_indices=take_indices,
            stop_index=max_index if stop_early else None,
        )
        if normalize_intermediates:
            intermediates = [self.ln_final(t) for t in intermediates]
        # Split the register prefix out of the intermediates: text positions under the usual key, registers
        # (the only "extra" tokens this tower has) under the extra key when requested.
        extra = []
        if self.num_reg:
            extra = [t[:, :self.num_reg] for t in intermediates]
            intermediates = [t[:, self.num_reg:] for t in intermediates]

        output = {"text_intermediates": intermediates}
        if output_extra_tokens:
            output["text_intermediates_extra"] = extra
        if intermediates_only:
            return output

        x = self.ln_final(x)
        pooled = self.pool(x[:, self.num_reg:] if self.num_reg else x, text=text, valid=valid, eos_id=self.eos_id)
        if self.text_projection is not None:
            pooled = self.text_projection(pooled)
        output["text_features"] = pooled
        return output

    def forward(self, text: torch.Tensor):
        x, valid, _ = self._encode_tokens(text)
        x = self.ln_final(x)
        tokens = x[:, self.num_reg:] if self.num_reg else x
        pooled = self.pool(tokens, text=text, valid=valid, eos_id=self.eos_id)
        if self.text_projection is not None:
            pooled = self.text_projection(pooled)
        if self.cfg.output_tokens:
            # NOTE: tokens cover the text positions (registers stripped) but pad positions are NOT masked --
            # consumers of per-token features must mask via `text != pad_id`, like the pooling here does.
            return pooled, tokens
        return pooled


def _set_group_requires_grad(members, requires_grad: bool):
    """Set ``requires_grad`` on a group's members (a mix of ``nn.Module`` and ``nn.Parameter``)."""
    for m in members:
        if isinstance(m, nn.Parameter):
            m.requires_grad = requires_grad
        else:
            for p in m.parameters():
                p.requires_grad = requires_grad


def _lock_layer_groups(groups, unlocked_layers: int = 0):
    """Freeze layer groups bottom-up, leaving the top ``unlocked_layers`` groups trainable.

    Sets every group explicitly (frozen -> False, unlocked -> True) so repeated calls with different counts are
    idempotent (e.g. progressive unfreezing / multi-stage training). Shared by ``lock_text_tower`` and tower
    ``lock`` methods so the freeze policy cannot drift between towers.
    """
    n_freeze = len(groups) if not unlocked_layers else len(groups) - unlocked_layers
    for i, (_, members) in enumerate(groups):
        _set_group_requires_grad(members, requires_grad=(i >= n_freeze))


class TikTokenTokenizer:
    """tiktoken-based tokenizer for generative (autoregressive) captioning.

    Wraps an OpenAI ``tiktoken`` BPE encoding (default ``cl100k_base``) for English-priority, fast tokenization.
    tiktoken handles only the caption body; the control ids (EOS, PAD, BOS) are reserved *above* the base
    vocabulary so they never collide with body tokens. Two output modes are supported:

    - ``pad=True`` (default): a fixed ``[N, context_length]`` tensor padded with ``pad_id`` (CLIP-style contract).
    - ``pad=False``: a list of variable-length 1-D tensors ``[BOS] + body + [EOS]`` for per-sample batching
      (used by the NaFlex GenLIP "rows" data path, which pads within the batch).
    """

    def __init__(
            self,
            encoding_name: str = 'cl100k_base',
            context_length: Optional[int] = 256,
            add_bos: bool = True,
            add_eos: bool = True,
            clean: Optional[str] = None,
    ):
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError("Please install tiktoken to use TikTokenTokenizer (`pip install tiktoken`).") from e

        self.encoding_name = encoding_name
        self.enc = tiktoken.get_encoding(encoding_name)
        self.context_length = context_length
        self.add_bos = add_bos
        self.add_eos = add_eos
        # Optional text cleaning ('canonicalize' / 'lower' / 'whitespace' / 'whitespace_underscore'); default None =
        # verbatim. Verbatim is required for the generative captioning path (cleaning would strip case/punctuation
        # it must reproduce). Contrastive configs can opt in via tokenizer_kwargs: 'canonicalize' (SigLIP-style
        # lowercase + punctuation strip) or 'whitespace_underscore' (case/punctuation-preserving, only snake_case
        # -> spaces -- best for a verbatim-trained model fed machine-formatted labels).
        self.clean_fn = get_clean_fn(clean) if clean else None

        # Reserve control ids above the base vocabulary so they never collide with body tokens.
        base = self.enc.n_vocab
        self.eot_token_id = base  # end-of-text / EOS
        self.pad_token_id = base + 1
        self.bos_token_id = base + 2
        self.sot_token_id = self.bos_token_id  # alias for CLIP-style callers
        self.all_special_ids = [self.eot_token_id, self.pad_token_id, self.bos_token_id]
        self.vocab_size = base + 3

    def encode(self, text: str) -> List[int]:
        # encode_ordinary ignores any special-token markup in the text, treating it as plain bytes.
        if self.clean_fn is not None:
            text = self.clean_fn(text)
        return self.enc.encode_ordinary(text)

    def decode(self, tokens: List[int]) -> str:
        body = [t for t in tokens if t < self.enc.n_vocab]
        return self.enc.decode(body)

    def _wrap(self, ids: List[int]) -> List[int]:
        if self.add_bos:
            ids = [self.bos_token_id] + ids
        if self.add_eos:
            ids = ids + [self.eot_token_id]
        return ids

    def __call__(
            self,
            texts: Union[str, List[str]],
            context_length: Optional[int] = None,
            pad: bool = True,
    ) -> Union[torch.LongTensor, List[torch.LongTensor]]:
        """Tokenize text(s).

        Args:
            texts: A string or list of strings.
            context_length: Max length (including control tokens). Defaults to ``self.context_length``.
                Used for truncation in both modes and for padding in fixed mode.
            pad: When True return a padded ``[N, context_length]`` tensor; when False return a list of
                variable-length 1-D tensors.
        """
        if isinstance(texts, str):
            texts = [texts]
        context_length = context_length or self.context_length

        all_tokens = [self._wrap(self.encode(text)) for text in texts]
        if context_length is not None:
            truncated = []
            for tokens in all_tokens:
                if len(tokens) > context_length:
                    tokens = tokens[:context_length]
                    if self.add_eos:
                        tokens[-1] = self.eot_token_id
                truncated.append(tokens)
            all_tokens = truncated

        if not pad:
            return [torch.tensor(tokens, dtype=torch.long) for tokens in all_tokens]

        assert context_length, 'A context_length is required for padded (pad=True) tokenization.'
        result = torch.full((len(all_tokens), context_length), self.pad_token_id, dtype=torch.long)
        for i, tokens in enumerate(all_tokens):
            result[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return result


def collate_variable_text(
        targets: List[Any],
        pad_id: int,
        pad_multiple: Optional[int] = None,
        pad_cap: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pad a list of variable-length token id sequences into a batch.

    Args:
        targets: List of 1-D token id tensors (or sequences) of differing lengths.
        pad_id: Padding token id used to fill, and to derive the validity mask.
        pad_multiple: When set, round the batch sequence length up to this multiple. Bounds the number of distinct
            ``Lmax`` values across batches so torch.compile recompiles a small fixed set of graphs (the text-axis
            analogue of ``--naflex-pad-multiple`` for audio patches).
        pad_cap: Upper bound for the rounded length (typically the tokenizer truncation cap / context_length), so
            rounding never pads past what absolute-position towers can consume. Sequences longer than the cap
            raise: the tokenizer is expected to have truncated already, and truncating here would silently chop
            the tail (including the EOS that pooling depends on).

    Returns:
        Tuple ``(text, text_valid)`` of shape ``[B, Lmax]``; ``text_valid`` is ``text != pad_id``.
    """
    tensors = [t if torch.is_tensor(t) else torch.as_tensor(t, dtype=torch.long) for t in targets]
    max_len = max((t.shape[0] for t in tensors), default=0)
    if pad_cap and max_len > pad_cap:
        raise ValueError(
            f"variable-text sequence length ({max_len}) exceeds pad_cap ({pad_cap}); "
            "the tokenizer is expected to truncate to the context length."
        )
    if pad_multiple:
        max_len = math.ceil(max_len / pad_multiple) * pad_multiple
        if pad_cap:
            max_len = min(max_len, pad_cap)
    text = torch.full((len(tensors), max_len), pad_id, dtype=torch.long)
    for i, tokens in enumerate(tensors):
        text[i, :tokens.shape[0]] = tokens
    return text, text != pad_id
