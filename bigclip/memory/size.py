"""What the memory model needs to know of a model: its parameters, its largest block and tensor, the towers'
activation shapes, or, for an image tower no formula describes, what its forward saves (traced.py). Measured on
the meta device (nothing is allocated), so a ViT-bigG-14 or an EVA02-E-14 costs nothing to plan.

Locked towers (--lock-image, --lock-text; `Locks`): the model's own lock methods freeze the meta model as the
engine freezes the real one, so the frozen parameters are counted exactly (weights only: no gradients, no
optimizer state), and a meta forward tells which blocks save activations for the backward: a block runs under
autograd only if its input or one of its parameters requires a gradient, so the frozen blocks below the first
trainable one keep nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from timm.layers import to_2tuple
from torch import nn
from torch.utils._pytree import tree_leaves

from bigclip.memory.traced import TracedActivations, trace_activations
from bigclip.model import create_model


@dataclass(frozen=True)
class ModelSize:
    """What an engine's memory model needs to know of a model."""

    params: int
    block_params: int  # the largest transformer block
    root_params: int  # parameters outside the blocks (embeddings, projections, norms, logit scale)
    largest_tensor: int = 0  # the largest trainable parameter (the token embedding in CLIP's text towers)
    text_params: int = 0  # the text tower's trainable parameters (its backward runs first: its forward runs last)
    frozen_params: int = 0  # parameters of locked towers (--lock-image, --lock-text): weights only

    @property
    def trainable_params(self) -> int:
        return self.params - self.frozen_params

    @property
    def unit_params(self) -> int:
        """The most parameters one step in the backward updates together: a block's, or those outside the blocks
        (FSDP2's root unit; DDP's in-flight groups are at most that)."""
        return max(self.block_params, self.root_params)


@dataclass(frozen=True)
class ModelFacts(ModelSize):
    name: str = ""
    towers: tuple[tuple[int, int, int, float], ...] = ()  # (layers, tokens, width, mlp ratio) per transformer tower
    # Image towers no formula describes (timm trunks, ResNet): what their forward saves, traced on meta.
    traced: tuple[TracedActivations, ...] = ()
    # A tower whose activations could not be traced (an operation without a meta kernel): its parameters
    # count, its activations do not, so a batch size that "fits" would be a guess.
    uncounted: str | None = None
    embed_dim: int = 0  # the features' width, which the contrastive loss's memory grows with
    # One sample's input on the device: its image's values (3 x H x W) and its text's token ids (the context)
    input_pixels: int = 0
    input_tokens: int = 0


@dataclass(frozen=True)
class Locks:
    """--lock-image / --lock-text with their refinements, as the memory model needs them (None: the tower trains
    whole). BatchNorm statistics (--lock-image-freeze-bn-stats) hold no parameters and change nothing here."""

    image_unlocked_groups: int | None = None
    text_unlocked_layers: int | None = None
    text_freeze_layer_norm: bool = False

    @classmethod
    def of(cls, cfg: Any) -> Locks | None:
        """The locks a run's flags ask for (EngineConfig's fields), or None when both towers train whole."""
        if not (cfg.lock_image or cfg.lock_text):
            return None
        return cls(
            cfg.lock_image_unlocked_groups if cfg.lock_image else None,
            cfg.lock_text_unlocked_layers if cfg.lock_text else None,
            cfg.lock_text_freeze_layer_norm,
        )

    def apply(self, model: nn.Module) -> None:
        """Freeze `model` as the engine does (engine.apply_locks): through the model's own lock methods."""
        if self.image_unlocked_groups is not None:
            model.lock_image_tower(self.image_unlocked_groups)
        if self.text_unlocked_layers is not None:
            model.lock_text_tower(self.text_unlocked_layers, self.text_freeze_layer_norm)


def _requires_grad(module: nn.Module, inputs: Any) -> bool:
    return any(p.requires_grad for p in module.parameters()) or any(
        t.requires_grad for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)
    )


def blocks_kept_for_backward(tower: nn.Module, example: torch.Tensor) -> int:
    """How many of the tower's blocks save activations for the backward: those whose input or own parameters
    require a gradient, found by a forward of `example` on meta. A forward that does not run on meta counts
    every block (the plan errs on the safe side)."""
    seen: list[bool] = []
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(_requires_grad(m, (args, kwargs))), with_kwargs=True
        )
        for block in tower.blocks
    ]
    try:
        tower(example)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return len(tower.blocks)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(seen[: len(tower.blocks)])


def parameter_count(name: str) -> int:
    """The parameters of architecture `name`, built on meta: no activations traced (`bigclip models` counts every
    name; tracing a timm tower's forward took half of that time)."""
    return sum(p.numel() for p in create_model(name, device="meta").parameters())


def model_facts(name: str, image_size: int | None = None, locks: Locks | None = None) -> ModelFacts:
    model = create_model(name, device="meta", image_size=image_size)
    if locks is not None:
        locks.apply(model)
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in model.transformer_blocks()]
    params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    largest = max((p.numel() for p in trainable), default=0)
    text_params = sum(p.numel() for p in model.text.parameters() if p.requires_grad)
    vision, text = model.visual.activation_shape(), model.text.activation_shape()
    image_trains = any(p.requires_grad for p in model.visual.parameters())
    if locks is not None and locks.image_unlocked_groups is not None and vision is not None:
        size = to_2tuple(model.visual.image_size)
        vision = replace_layers(vision, blocks_kept_for_backward(model.visual, torch.zeros(1, 3, *size, device="meta")))
    if locks is not None and locks.text_unlocked_layers is not None and text is not None:
        tokens = torch.zeros(1, text[1], dtype=torch.long, device="meta")
        text = replace_layers(text, blocks_kept_for_backward(model.text, tokens))
    towers = tuple(shape for shape in (vision, text) if shape is not None)
    height, width = to_2tuple(model.visual.image_size)
    traced, uncounted = (), None
    if vision is None and image_trains:  # a wholly frozen image tower keeps nothing for the backward
        try:
            traced = (trace_activations(model.visual, model.visual.image_size, model.visual.blocks),)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:  # no meta kernel for an op
            why = f"its forward does not run on meta, {type(e).__name__}"
            uncounted = f"image tower ({model.visual.description}: {why})"
    return ModelFacts(
        params,
        max(block_sizes),
        params - sum(block_sizes),
        largest_tensor=largest,
        text_params=text_params,
        frozen_params=params - sum(p.numel() for p in trainable),
        name=name,
        towers=towers,
        traced=traced,
        uncounted=uncounted,
        embed_dim=model.embed_dim,
        input_pixels=3 * height * width,
        input_tokens=model.text.context_length,
    )


def replace_layers(shape: tuple[int, int, int, float], layers: int) -> tuple[int, int, int, float]:
    """A tower's activation shape (layers, tokens, width, MLP ratio) with only `layers` blocks saving activations."""
    return (layers, *shape[1:])
