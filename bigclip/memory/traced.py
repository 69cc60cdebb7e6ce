"""Activations of a tower no formula describes (timm trunks: EVA, ConvNeXt, Swin, ViTamin, MobileCLIP, PE-Core, …;
OpenCLIP's ResNet), measured rather than derived: its forward runs on the meta device (shapes only, nothing is
allocated, a 4.7B-parameter EVA02-E-14 in about a second) under torch.autograd.graph.saved_tensors_hooks, which
sees every tensor autograd keeps for the backward. What is counted is the storage behind each saved tensor, once
(q, k and v are views of one qkv output; a norm's output saved by the next layer too), leaving out the weights and
buffers (they are the state) and the input images (the data's). Each saved storage is charged to the block (the
tower's `blocks`, the units engines shard and checkpoint) running when it was first saved, or to the tower outside
the blocks (stem, downsampling, head); each block's input is recorded too.

So the memory kept from the forward to the backward is, per sample:
- without activation checkpointing: everything saved, blocks and outside;
- with it (one checkpoint per block): what the outside saves, every block's input, and while a block is
  recomputed in the backward, that block's own saved tensors beside what was kept before it (the backward runs
  in reverse: what the forward saved after the block is gone by then).

Sizes are counted in two parts, because the forward runs in bfloat16: values saved in the tower's dtype scale with
the run's activation width (2 bytes under amp and pure bf16, 4 under fp32), values a model computes in float32 on
purpose (rotary tables, norms' statistics) and integer or boolean ones (indices, masks) keep their bytes.
Checked against measurement (the rank's resident memory through a training step) by bench/plan_check.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

TRACE_DTYPE = torch.bfloat16
_TRACE_BATCH = 2  # above 1: BatchNorm in training refuses a single value per channel


@dataclass(frozen=True)
class Saved:
    """Bytes per sample: `values` saved in the tower's dtype (times the activation width) plus `fixed` bytes."""

    values: float = 0.0
    fixed: float = 0.0

    def bytes(self, element_bytes: int) -> float:
        return self.values * element_bytes + self.fixed

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.values + other.values, self.fixed + other.fixed)


@dataclass(frozen=True)
class TracedActivations:
    """What one tower's forward saves for the backward, per sample."""

    outside: Saved  # saved outside the blocks: stem, patch embedding, downsampling, pooling, head
    blocks: tuple[Saved, ...]  # each block's own saved tensors
    inputs: tuple[Saved, ...]  # each block's input (what a checkpointed block keeps)
    # what the outside saved before each block began (the last: after the last block), in the forward's order
    outside_before: tuple[Saved, ...] = ()

    def kept_bytes(self, checkpointing: bool, element_bytes: int) -> float:
        """Per sample, kept through the forward: all of it, or with checkpointing the outside and the inputs."""
        parts = self.inputs if checkpointing else self.blocks
        return self.outside.bytes(element_bytes) + sum(p.bytes(element_bytes) for p in parts)

    def largest_block_bytes(self, element_bytes: int) -> float:
        """Per sample, the most one block saves: what its recomputation holds in a checkpointed backward."""
        return max((b.bytes(element_bytes) for b in self.blocks), default=0.0)

    def checkpointed_peak_bytes(self, element_bytes: int) -> float:
        """Per sample, the most a checkpointed backward holds: everything kept when it starts, or while block i is
        recomputed, its saved tensors beside what the forward kept before it (the inputs of blocks 0..i, the
        outside saved before block i began): the backward runs in reverse, so what was saved after block i is
        gone by then. Uniform blocks peak at the last block (kept + one block); a ConvNeXt's large first-stage
        blocks are recomputed when the later stages' inputs are gone."""
        if len(self.outside_before) != len(self.blocks) + 1:  # no order recorded: at worst all kept + one block
            return self.kept_bytes(True, element_bytes) + self.largest_block_bytes(element_bytes)
        peak, alive = self.kept_bytes(True, element_bytes), 0.0
        for before, block_input, block in zip(self.outside_before, self.inputs, self.blocks, strict=False):
            alive += before.bytes(element_bytes) + block_input.bytes(element_bytes)
            peak = max(peak, alive + block.bytes(element_bytes))
        return peak


class _FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention as a GPU (and torch on CPU) runs it in training: a fused kernel that keeps
    q, k, v, the output and the log-sum-exp for the backward. On meta, torch picks its unfused float32 reference
    instead, which keeps the heads x tokens x tokens scores too: a memory no training run holds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **rest):
    """The flash kernel's outputs and saved tensors (torch's CPU flash attention, which has a meta kernel), or None
    where it does not take these arguments (grouped-query attention, another layout): the reference then runs."""
    if rest.get("enable_gqa") or query.dim() != 4:
        return None
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    except (RuntimeError, TypeError):
        return None


def _size(t: torch.Tensor, nbytes: int) -> Saved:
    return Saved(values=nbytes / t.element_size()) if t.dtype == TRACE_DTYPE else Saved(fixed=nbytes)


def trace_activations(
    tower: nn.Module, image_size: tuple[int, int] | None, blocks: list[nn.Module], inputs: torch.Tensor | None = None
) -> TracedActivations:
    """Run `tower` (on the meta device; it is cast to bfloat16 in place) on a batch of images (or on `inputs`, a
    batch of _TRACE_BATCH on meta: a text tower's token ids) and sort what its forward saves for the backward by
    block. Raises what the forward raises where an operation has no meta kernel."""
    tower.to(TRACE_DTYPE)
    state = {StorageWeakRef(t.untyped_storage()) for t in [*tower.parameters(), *tower.buffers()]}
    batch = inputs
    if batch is None:
        batch = torch.empty(_TRACE_BATCH, 3, *image_size, device="meta", dtype=TRACE_DTYPE)
    state.add(StorageWeakRef(batch.untyped_storage()))
    seen: set[StorageWeakRef] = set()
    outside, per_block, inputs = Saved(), [Saved() for _ in blocks], [Saved() for _ in blocks]
    outside_before = [Saved() for _ in range(len(blocks) + 1)]
    running: list[int] = []  # the block being run (a stack: a block's hooks may nest inside another's)
    entered = [0]  # blocks begun at the top level so far

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in state and ref not in seen:
            seen.add(ref)
            size = _size(t, t.untyped_storage().nbytes())
            if running:
                per_block[running[0]] += size
            else:
                outside += size
                outside_before[min(entered[0], len(blocks))] += size
        return t

    def enter(index: int):
        def hook(module, args):
            if not running:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    inputs[index] += _size(first, first.numel() * first.element_size())
                entered[0] += 1
            running.append(index)

        return hook

    def leave(module, args, output):
        running.pop()

    handles = []
    for index, block in enumerate(blocks):
        handles += [block.register_forward_pre_hook(enter(index)), block.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), _FusedAttention():
            tower(batch)
    finally:
        for handle in handles:
            handle.remove()

    def per_sample(s: Saved) -> Saved:
        return Saved(s.values / _TRACE_BATCH, s.fixed / _TRACE_BATCH)

    return TracedActivations(
        per_sample(outside),
        tuple(map(per_sample, per_block)),
        tuple(map(per_sample, inputs)),
        tuple(map(per_sample, outside_before)),
    )
