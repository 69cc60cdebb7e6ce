"""What the memory model needs to know of a model: its parameters, its largest block and tensor, the towers'
activation shapes, or, for an image tower no formula describes, what its forward saves (traced.py). Measured on
the meta device (nothing is allocated), so a ViT-bigG-14 or an EVA02-E-14 costs nothing to plan."""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.memory.traced import TracedActivations, trace_activations
from bigclip.model import create_model


@dataclass(frozen=True)
class ModelSize:
    """What an engine's memory model needs to know of a model."""

    params: int
    block_params: int  # the largest transformer block
    root_params: int  # parameters outside the blocks (embeddings, projections, norms, logit scale)
    largest_tensor: int = 0  # the largest single parameter (the token embedding in CLIP's text towers)
    text_params: int = 0  # the text tower's parameters (its backward runs first: its forward runs last)

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


def parameter_count(name: str) -> int:
    """The parameters of architecture `name`, built on meta: no activations traced (`bigclip models` counts every
    name; tracing a timm tower's forward took half of that time)."""
    return sum(p.numel() for p in create_model(name, device="meta").parameters())


def model_facts(name: str, image_size: int | None = None) -> ModelFacts:
    model = create_model(name, device="meta", image_size=image_size)
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in model.transformer_blocks()]
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    text_params = sum(p.numel() for p in model.text.parameters())
    vision, text = model.visual.activation_shape(), model.text.activation_shape()
    towers = tuple(shape for shape in (vision, text) if shape is not None)
    traced, uncounted = (), None
    if vision is None:
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
        name=name,
        towers=towers,
        traced=traced,
        uncounted=uncounted,
        embed_dim=model.embed_dim,
    )
