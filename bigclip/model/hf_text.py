"""Hugging Face text towers: OpenCLIP's HFTextEncoder (text_cfg with `hf_model_name`: RoBERTa, XLM-RoBERTa, mT5, NLLB,
BERT, and ModernBERT as OpenCLIP's main branch builds it) built through `transformers` (the optional `hf` extra).

The tower is OpenCLIP's, with its names: `transformer` (the Hugging Face model; an encoder-decoder's encoder only),
OpenCLIP's pooler over the tokens that are not padding (`hf_pooler_type`: mean_pooler, max_pooler, cls_pooler,
cls_last_hidden_state_pooler; open_clip.hf_model's own classes), and `proj` (`hf_proj_type`: mlp, linear, or none
when the widths agree). The architecture comes from `AutoConfig.from_pretrained(hf_model_name)` (a hub name,
through the hub cache, or a local directory), with OpenCLIP main's `hf_model_config` overrides applied and a dtype
the repository pins in it (gte-modernbert: float16) cleared, as OpenCLIP main does (the tower is float32; --precision
decides the rest); the model is built on the meta device like every bigclip tower and
materialised by `init_weights()`: the Hugging Face weights (`hf_model_pretrained`, OpenCLIP's default) or the
model's own random init, read from a CPU copy into each rank's shards. Engines shard and checkpoint the encoder's
layers (`blocks`); activation checkpointing is Hugging Face's own (its layers re-enter their module call, so the
engines' hooks see the recomputation).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from bigclip.errors import UserError, first_line
from bigclip.model.layer_groups import LayerGroups
from bigclip.model.layers import is_checkpointed
from bigclip.model.weights import copy_into

# OpenCLIP's text_cfg keys of its own text transformer, which a Hugging Face tower does not read; and OpenCLIP main's
# variable_text, which lets its data pipeline pad each batch only to its longest caption: the tower masks padding
# either way (attention mask and pooler from the pad id), so padding to the context length gives the same features
_IGNORED = (
    "context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio", "ls_init_value", "quick_gelu",
    "variable_text",
)  # fmt: skip
# OpenCLIP main's arch_dict entries for model types open_clip_torch 3.3's lacks (open_clip/hf_configs.py at commit
# 89fb801, the commit configs/openclip_main/ is copied from)
_MAIN_ARCHS = {
    "modernbert": {
        "config_names": {
            "context_length": "max_position_embeddings",
            "vocab_size": "vocab_size",
            "width": "hidden_size",
            "heads": "num_attention_heads",
            "layers": "num_hidden_layers",
            "layer_attr": "layers",
            "token_embeddings_attr": "embeddings",
        },
        "pooler": "mean_pooler",
    },
}
# The model types whose Hugging Face model takes add_pooling_layer (OpenCLIP main's
# _MODEL_TYPES_WITH_POOLING_LAYER_KWARG; 3.3 passes it to every encoder-only model, which were only these)
_POOLING_LAYER_KWARG = ("bert", "roberta", "xlm-roberta")


def _transformers():
    try:
        import transformers  # optional, and seconds to import: only Hugging Face text towers need it
    except ImportError:
        raise ImportError("Hugging Face text towers need transformers: pip install 'bigclip[hf]'") from None
    return transformers


@contextmanager
def fetch_or_explain(hf_model_name: str, what: str):
    """A hub file that is not cached and cannot be fetched (offline, unreachable, unknown repository) is one
    line naming the repository and how to get it, not transformers' traceback."""
    try:
        yield
    except OSError as err:
        raise UserError(
            f"text tower {hf_model_name}: {what} is not in the Hugging Face cache and could not be fetched "
            f"({first_line(err)}); run `huggingface-cli download {hf_model_name}` where the hub is reachable "
            f"(HF_HOME pointing at that cache), or allow downloads (HF_HUB_OFFLINE unset)"
        ) from None


@contextmanager
def _parameters_on_meta():
    """Every parameter a module registers goes to the meta device as it is registered (its init then costs nothing),
    while buffers are made where they are (accelerate's init_empty_weights(include_buffers=False))."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# Where OpenCLIP's arch_dict does not say where an architecture keeps its layers and token embeddings (OpenCLIP's
# own lock() then fails on it), the attributes Hugging Face's model has: NLLB's M2M100 encoder, BERT
_LAYOUT_FALLBACKS = {
    "m2m_100": {"layer_attr": "layers", "token_embeddings_attr": "embed_tokens"},
    "bert": {"layer_attr": "layer", "token_embeddings_attr": "embeddings"},
}


class HFTextTower(nn.Module):
    def __init__(
        self,
        *,
        embed_dim: int,
        hf_model_name: str,
        hf_tokenizer_name: str | None = None,
        hf_model_pretrained: bool = True,
        hf_pooler_type: str = "mean_pooler",
        hf_proj_type: str | None = "mlp",
        hf_model_config: dict | None = None,
        pad_id: int | None = None,
        output_tokens: bool = False,
        **ignored,
    ):
        super().__init__()
        unknown = set(ignored) - set(_IGNORED)
        if unknown:
            raise TypeError(f"Hugging Face text tower: unexpected text_cfg keys {sorted(unknown)}")
        from open_clip.hf_configs import arch_dict
        from open_clip.hf_model import _POOLERS

        transformers = _transformers()
        self.hf_model_name = hf_model_name
        self.hf_model_pretrained = hf_model_pretrained
        self.output_tokens = output_tokens
        with fetch_or_explain(hf_model_name, "its config"):
            self.config = transformers.AutoConfig.from_pretrained(hf_model_name)
        for key, value in (hf_model_config or {}).items():  # OpenCLIP main's overrides, before the model is made
            setattr(self.config, key, value)
        # a repository's pinned dtype, which from_config would build in: cleared, as OpenCLIP main does
        setattr(self.config, "dtype" if hasattr(self.config, "dtype") else "torch_dtype", None)  # transformers 5: dtype
        if pad_id is not None and pad_id != self.config.pad_token_id:  # OpenCLIP main checks it against the tokenizer
            raise ValueError(
                f"text_cfg pad_id {pad_id} is not {hf_model_name}'s pad_token_id {self.config.pad_token_id}"
            )
        self.arch = arch_dict.get(self.config.model_type) or _MAIN_ARCHS.get(self.config.model_type)
        if self.arch is not None:
            names = {**_LAYOUT_FALLBACKS.get(self.config.model_type, {}), **self.arch["config_names"]}
            self.arch = {**self.arch, "config_names": names}
        if self.arch is None:
            raise ValueError(f"hf_model_name {hf_model_name}: model type {self.config.model_type!r} is not one of "
                             f"OpenCLIP's ({', '.join([*arch_dict, *_MAIN_ARCHS])})")  # fmt: skip
        with torch.device("cpu"), _parameters_on_meta():
            self.transformer = self._build(transformers, hf_pooler_type)
        # the buffers' values as the model made them (position ids): kept aside, since moving the model off the
        # meta device (to_empty) leaves every buffer empty and the non-persistent ones are in no weights file
        self._buffer_values = {name: b.clone() for name, b in self.transformer.named_buffers()}
        self.transformer.to("meta")  # like every other parameter of a bigclip model before materialisation
        if hf_pooler_type not in _POOLERS:
            raise ValueError(f"hf_pooler_type {hf_pooler_type!r}: choose one of {', '.join(_POOLERS)}")
        self.pooler = _POOLERS[hf_pooler_type]()
        self.width = getattr(self.config, self.arch["config_names"]["width"])
        if self.width == embed_dim and hf_proj_type is None:
            self.proj = nn.Identity()
        elif hf_proj_type == "linear":
            self.proj = nn.Linear(self.width, embed_dim, bias=False)
        elif hf_proj_type == "mlp":
            hidden = (self.width + embed_dim) // 2
            self.proj = nn.Sequential(
                nn.Linear(self.width, hidden, bias=False), nn.GELU(), nn.Linear(hidden, embed_dim, bias=False)
            )
        else:
            raise ValueError(f"hf_proj_type {hf_proj_type!r}: choose mlp, linear, or none with equal widths")

    def _build(self, transformers, pooler_type: str) -> nn.Module:
        if getattr(self.config, "is_encoder_decoder", False):
            return transformers.AutoModel.from_config(self.config).encoder  # OpenCLIP keeps the encoder (mT5)
        if self.config.model_type not in _POOLING_LAYER_KWARG:  # ModernBERT: no pooling layer to add
            return transformers.AutoModel.from_config(self.config)
        return transformers.AutoModel.from_config(self.config, add_pooling_layer=pooler_type == "cls_pooler")

    @property
    def _encoder(self) -> nn.Module:
        return getattr(self.transformer, "encoder", self.transformer)

    @property
    def blocks(self) -> nn.ModuleList:
        """The encoder's layers (OpenCLIP's layer_attr of the architecture)."""
        return getattr(self._encoder, self.arch["config_names"].get("layer_attr", "layer"))

    @property
    def context_length(self) -> int:
        return getattr(self.config, "max_position_embeddings", 77) or 77

    def activation_shape(self) -> tuple[int, int, int, float]:
        hidden = getattr(self.config, "intermediate_size", None) or getattr(self.config, "d_ff", 4 * self.width)
        return len(self.blocks), min(self.context_length, 77), self.width, hidden / self.width

    def set_grad_checkpointing(self, every: int) -> None:
        """Hugging Face's activation checkpointing on every `every`-th layer (0: none). Recent transformers recompute
        a layer's forward inside its module call, so engines' hooks (FSDP2's) run once."""
        if not every:
            getattr(
                self.transformer, "activation_checkpointing_disable", self.transformer.gradient_checkpointing_disable
            )()
            return
        options = {"use_reentrant": False}
        if hasattr(self.transformer, "activation_checkpointing_enable"):  # transformers 5
            self.transformer.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            self.transformer.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        for i, layer in enumerate(self.blocks):
            layer.gradient_checkpointing = is_checkpointed(i, every)

    def buffers_set_by_init(self) -> set[str]:
        """Every buffer: init_weights() and reset_buffers() restore them."""
        return {name for name, _ in self.named_buffers()}

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Restore the buffers' values (after to_empty(), or after loading weights that do not hold them)."""
        for name, buffer in self.transformer.named_buffers():
            buffer.copy_(self._buffer_values[name])

    @torch.no_grad()
    def init_weights(self) -> None:
        """The Hugging Face weights (hf_model_pretrained) or the architecture's own random init, from a CPU copy,
        into every parameter and buffer (each rank's block of a sharded one); the projection's default init."""
        transformers = _transformers()
        if self.hf_model_pretrained:
            with fetch_or_explain(self.hf_model_name, "its weights"):
                # the config as overridden (OpenCLIP main passes it too); the weights read into a float32 model
                reference = transformers.AutoModel.from_pretrained(self.hf_model_name, config=self.config)
        else:
            reference = transformers.AutoModel.from_config(self.config)
        if getattr(self.config, "is_encoder_decoder", False):
            reference = reference.encoder
        source = dict(reference.named_parameters())
        for name, target in self.transformer.named_parameters():
            copy_into(target, source[name].detach())
        self.reset_buffers()
        for module in self.proj.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    @property
    def _embeddings(self) -> nn.Module:
        return getattr(self.transformer, self.arch["config_names"].get("token_embeddings_attr", "embeddings"))

    def layer_groups(self, pooler_in_head: bool = True) -> LayerGroups:
        """OpenCLIP main's groups of a Hugging Face tower (what layer-wise lr decay scales by): the embeddings, each
        layer, then the projection head; the model's own pooler layer (BERT-like models under cls_pooler) rides in
        the head, or with pooler_in_head=False (--text-pooler-own-group) is a group of its own below it. What follows
        the layers (a final norm) is in no group, as in OpenCLIP main: lr scale 1. (--lock-text keeps OpenCLIP 3.3's
        rule: `lock`.)"""
        pooler = getattr(self.transformer, "pooler", None)
        pooler = [pooler] if pooler is not None and next(pooler.parameters(), None) is not None else []
        groups: LayerGroups = [("embeddings", [self._embeddings])]
        groups += [(f"layer.{i}", [layer]) for i, layer in enumerate(self.blocks)]
        if pooler and not pooler_in_head:
            groups.append(("pooler", pooler))
        groups.append(("proj", [*pooler, self.proj] if pooler_in_head else [self.proj]))
        return groups

    def lock(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
        """OpenCLIP's HFTextEncoder.lock: the Hugging Face model frozen except its top `unlocked_layers` layers (the
        embeddings count as one), LayerNorms trainable with freeze_layer_norm=False; the projection always trains."""

        def freeze(module: nn.Module) -> None:
            for n, p in module.named_parameters():
                p.requires_grad = (not freeze_layer_norm) if "LayerNorm" in n.split(".") else False

        if not unlocked_layers:
            freeze(self.transformer)
            return
        for module in [self._embeddings, *self.blocks][:-unlocked_layers]:
            freeze(module)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        mask = (tokens != self.config.pad_token_id).long()
        out = self.transformer(input_ids=tokens, attention_mask=mask)
        features = self.proj(self.pooler(out, mask))
        if not self.output_tokens:
            return features
        states = out.last_hidden_state
        position = getattr(self.pooler, "cls_token_position", None)
        if type(self.pooler).__name__ == "ClsPooler":  # OpenCLIP hands on every token but the pooled one
            states = states[:, torch.arange(states.shape[1], device=states.device) != position]
        return features, states
