"""CoCa: a CLIP whose towers also hand their token states to a multimodal text decoder that captions the image.

OpenCLIP's CoCa (its `coca_*` configs: `multimodal_cfg` beside vision_cfg and text_cfg) with OpenCLIP's parameter
names, so its weights load by the same renames as CLIP's (model/convert.py):

    visual        the ViT with an attentional pooler (vision.py): the image feature, and image tokens (B, Q-1, D)
    text          the text transformer with a class embedding appended (text.py): the text feature, and the token
                  states before ln_final (B, L, width)
    text_decoder  `resblocks.{i}` (causal self-attention over the text) interleaved with `cross_attn.{i}` (the
                  text attends to the image tokens), ln_final, text_projection (width, vocab): next-token logits

The forward returns OpenCLIP's dict: the two normalised features and the logit scale for the contrastive loss,
and the caption logits with their labels (the text shifted by one: teacher forcing) for the caption loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigclip.model.clip import CLIP, DEFAULT_INIT_LOGIT_SCALE
from bigclip.model.layers import QuickGELU, is_checkpointed, run_block
from bigclip.model.text import CausalSelfAttention, ResidualAttentionBlock, init_blocks


class CrossAttention(CausalSelfAttention):
    """Queries from the text, keys and values from the image tokens (same width); the self-attention's parameters
    (nn.MultiheadAttention's names: in_proj_weight stacks [q; k; v])."""

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        w_q, w_kv = self.in_proj_weight.split([width, 2 * width])
        b_q, b_kv = self.in_proj_bias.split([width, 2 * width])
        q = F.linear(x, w_q, b_q).view(batch, length, self.heads, -1).transpose(1, 2)
        k, v = F.linear(context, w_kv, b_kv).view(batch, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(x.transpose(1, 2).reshape(batch, length, width))


class CrossAttentionBlock(ResidualAttentionBlock):
    """OpenCLIP's ResidualAttentionBlock with is_cross_attention: the text attends to the image tokens, which are
    normalised by their own ln_1_kv."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, act_layer: type[nn.Module], ls_init_value=None):
        super().__init__(width, heads, mlp_ratio, act_layer, ls_init_value)
        self.attn = CrossAttention(width, heads)
        self.ln_1_kv = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x), self.ln_1_kv(image_tokens)))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class MultimodalDecoder(nn.Module):
    """OpenCLIP's MultimodalTransformer: per layer a causal self-attention block, then a cross-attention block."""

    def __init__(
        self,
        *,
        width: int,
        layers: int,
        heads: int,
        vocab_size: int,
        context_length: int = 77,
        mlp_ratio: float = 4.0,
        ls_init_value: float | None = None,
        quick_gelu: bool = False,
        # OpenCLIP's MultimodalCfg keys the decoder does not use (its dim_head, n_queries and attn_pooler_heads
        # are read by nothing in OpenCLIP's CoCa either)
        dim_head: int = 64,
        n_queries: int = 256,
        attn_pooler_heads: int = 8,
    ):
        super().__init__()
        act_layer = QuickGELU if quick_gelu else nn.GELU
        self.width = width
        self.context_length = context_length
        self.ls_init_value = ls_init_value
        self.resblocks = nn.ModuleList(
            ResidualAttentionBlock(width, heads, mlp_ratio, act_layer, ls_init_value) for _ in range(layers)
        )
        self.cross_attn = nn.ModuleList(
            CrossAttentionBlock(width, heads, mlp_ratio, act_layer, ls_init_value) for _ in range(layers)
        )
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.empty(width, vocab_size))
        self.checkpoint_every = 0  # 0: no activation checkpointing

    @property
    def blocks(self) -> list[nn.Module]:
        """Every block in the order they run (self-attention, cross-attention, ...)."""
        return [block for pair in zip(self.resblocks, self.cross_attn) for block in pair]

    def set_grad_checkpointing(self, every: int) -> None:
        self.checkpoint_every = every

    def init_weights(self) -> None:
        """The text tower's scheme (OpenCLIP means this one: its MultimodalTransformer.init_parameters is never
        called, leaving PyTorch's defaults); touches every parameter."""
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, nn.Linear)):
                module.reset_parameters()
        # depth: the number of layers (a self- and a cross-attention block each), as OpenCLIP would count it
        init_blocks(self.resblocks, self.width, self.ls_init_value)
        init_blocks(self.cross_attn, self.width, self.ls_init_value)
        nn.init.normal_(self.text_projection, std=self.width**-0.5)

    def forward(self, image_tokens: torch.Tensor, text_states: torch.Tensor) -> torch.Tensor:
        """(B, Q, width) image tokens, (B, L, width) text states -> (B, L, vocab) next-token logits."""
        x = text_states
        for i, block in enumerate(self.blocks):
            recompute = is_checkpointed(i // 2, self.checkpoint_every)
            x = run_block(block, x, recompute) if i % 2 == 0 else run_block(block, x, recompute, image_tokens)
        return self.ln_final(x) @ self.text_projection


class CoCa(CLIP):
    def __init__(
        self,
        embed_dim: int,
        vision_cfg: dict,
        text_cfg: dict,
        multimodal_cfg: dict,
        *,
        quick_gelu: bool = False,
        init_logit_scale: float = DEFAULT_INIT_LOGIT_SCALE,
        init_logit_bias: float | None = None,
        image_size: int | tuple[int, int] | None = None,
        pad_id: int = 0,
    ):
        hf_text = "hf_model_name" in text_cfg  # a Hugging Face text tower pads as its tokenizer says
        super().__init__(
            embed_dim,
            {**vision_cfg, "output_tokens": True},
            {**text_cfg, "output_tokens": True, **({} if hf_text else {"pad_id": pad_id})},
            quick_gelu=quick_gelu,
            init_logit_scale=init_logit_scale,
            init_logit_bias=init_logit_bias,
            image_size=image_size,
        )
        self.pad_id = pad_id
        # the decoder reads the image tokens (embed_dim wide after an attentional pooler, else the ViT's width)
        # and the text states (the text tower's width) as its own width
        pooled = vision_cfg.get("attentional_pool", False)
        widths = {"embed_dim" if pooled else "vision_cfg width": embed_dim if pooled else vision_cfg["width"]}
        widths["text width"] = self.text.width
        widths["multimodal_cfg width"] = multimodal_cfg["width"]
        if len(set(widths.values())) > 1:
            raise ValueError(f"CoCa needs one width for {', '.join(f'{k} {v}' for k, v in widths.items())}")
        # OpenCLIP sizes the decoder's output by the text_cfg's vocabulary, whatever multimodal_cfg says; a Hugging
        # Face tower's text_cfg may leave it out, and then it is the model's (OpenCLIP 3.3 takes its own default,
        # 49408, which RoBERTa's 50265 token ids overflow)
        vocab_size = text_cfg.get("vocab_size") or self.text.config.vocab_size if hf_text else text_cfg["vocab_size"]
        decoder_cfg = {**multimodal_cfg, "vocab_size": vocab_size}
        self.text_decoder = MultimodalDecoder(quick_gelu=quick_gelu, **decoder_cfg)

    def init_weights(self) -> None:
        if self.pretrained_path is None:
            self.text_decoder.init_weights()
        super().init_weights()

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.visual(images)[0]
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.text(tokens)[0]
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, images: torch.Tensor | None = None, texts: torch.Tensor | None = None) -> dict:
        """OpenCLIP's CoCa outputs. With images and texts: the caption logits of texts[:, :-1] (each position
        predicts the next token) and their labels texts[:, 1:]. Caption decoding calls `decode` instead."""
        out: dict = {"logit_scale": self.logit_scale.exp()}
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        image_tokens = None
        if images is not None:
            image_features, image_tokens = self.visual(images)
            out["image_features"] = F.normalize(image_features, dim=-1)
            out["image_tokens"] = image_tokens
        if texts is not None:
            text_features, text_states = self.text(texts)
            out["text_features"] = F.normalize(text_features, dim=-1)
            if image_tokens is not None:
                out["logits"] = self.text_decoder(image_tokens, text_states[:, :-1])
                out["labels"] = texts[:, 1:]
        return out

    def decode(self, image_tokens: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, L, vocab) at every position of `texts` (no shift): for caption decoding."""
        return self.text_decoder(image_tokens, self.text(texts)[1])

    def set_grad_checkpointing(self, enable: bool = True, every: int = 1) -> None:
        super().set_grad_checkpointing(enable, every)
        self.text_decoder.set_grad_checkpointing(every if enable else 0)

    def transformer_blocks(self) -> list[nn.Module]:
        return [*super().transformer_blocks(), *self.text_decoder.blocks]
