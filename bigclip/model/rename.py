"""Rename plans: how the tensors of one state-dict layout are made from another's, without touching them yet.

A plan maps each output name to (source names, function of those source tensors). Most entries are a rename
with at most a reshape (a view); a few combine several sources (a fused qkv from q, k and v). Because a plan
only names its sources, it can be applied eagerly to a dict (`apply_plan`) or lazily, one tensor at a time,
to a file that is never read whole (weights.py streams giant checkpoints this way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

Rule = tuple[tuple[str, ...], Callable[..., torch.Tensor]]
Plan = dict[str, Rule]


def same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def renamed(source: str, fn: Callable[..., torch.Tensor] = same) -> Rule:
    return (source,), fn


def apply_plan(plan: Plan, source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: fn(*(source[s] for s in sources)) for name, (sources, fn) in plan.items()}


def rename_prefix(name: str, table: Mapping[str, str]) -> str | None:
    """Map `name` through the first entry of `table` that equals it or prefixes it at a dot."""
    for old, new in table.items():
        if name == old:
            return new
        if name.startswith(old + "."):
            return new + name[len(old) :]
    return None


@dataclass(frozen=True)
class TowerNames:
    """How one kind of vision tower's parameters are named in OpenCLIP and in bigclip.

    Names passed in and produced are whole state-dict names ("visual.…"); the detectors see the set of a
    state dict's "visual." names and say whether they are this tower's (OpenCLIP's or bigclip's layout)."""

    kind: str
    is_openclip: Callable[[set[str]], bool]
    is_bigclip: Callable[[set[str]], bool]
    from_openclip: Callable[[Iterable[str]], Plan]
    to_openclip: Callable[[Iterable[str]], Plan]
