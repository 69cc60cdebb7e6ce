"""Layer groups: each tower's ordered partition of its parameters, from the input to the output.

OpenCLIP partitions a tower the same way for two things, and so does bigclip: freezing the bottom of a tower
(--lock-image-unlocked-groups / --lock-text-unlocked-layers leave the top N groups trainable) and layer-wise
learning-rate decay (--image-layer-decay / --text-layer-decay: the group at depth d below the top trains at
lr * decay**d). The partitions are OpenCLIP's (3.3's lock groups, which its main branch names and reuses for
the decay):

    ViT      embeddings (patch embedding, class token, positional embedding, ln_pre), layer.i (block i; the
             last one with ln_post), proj
    text     embeddings (token and positional embeddings), layer.i (block i; the last one with ln_final), proj
    ResNet   embeddings (the stem), layer.0 .. layer.3 (the stages), proj (the attention pool)
    timm     layer.<id> (timm's own group_matcher over the trunk), proj (the adapter head, when it has weights)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

# (name, members): a member is a module (all its parameters) or a parameter.
LayerGroups = list[tuple[str, list[nn.Module | nn.Parameter]]]


def parameters_of(members: list[nn.Module | nn.Parameter]) -> Iterator[nn.Parameter]:
    for member in members:
        if isinstance(member, nn.Parameter):
            yield member
        else:
            yield from member.parameters()


def depths(groups: LayerGroups) -> dict[int, int]:
    """id(parameter) -> its group's depth below the top group (0: the head)."""
    last = len(groups) - 1
    return {id(p): last - index for index, (_, members) in enumerate(groups) for p in parameters_of(members)}


def lock_bottom(
    groups: LayerGroups, unlocked: int, keeps_training: Callable[[nn.Module], bool] = lambda module: False
) -> None:
    """Freeze every group but the top `unlocked` ones (0: the whole tower). A module for which `keeps_training`
    says so (--lock-text-freeze-layer-norm off: LayerNorms) stays trainable inside frozen groups."""
    unlocked = max(0, min(unlocked, len(groups)))
    for _, members in groups[: len(groups) - unlocked]:
        for member in members:
            if isinstance(member, nn.Parameter):
                member.requires_grad_(False)
                continue
            for module in member.modules():
                keep = keeps_training(module)
                for param in module.parameters(recurse=False):
                    param.requires_grad_(keep)
