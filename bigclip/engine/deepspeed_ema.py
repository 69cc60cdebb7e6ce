"""--ema-decay under DeepSpeed: the moving average of the float32 master weights, kept where ZeRO keeps them.

Each rank averages what its optimizer holds of every parameter, as a float32 fragment of the flattened parameter
with its offset:
    ZeRO-3       the rank's partition of each parameter (DeepSpeed's `safe_get_local_fp32_param`);
    ZeRO-1/2     the fragment of the parameter in the rank's fp32 master partition (`_hp_mapping`);
    ZeRO-0 fp32, frozen parameters    the whole parameter, replicated: rank 0 keeps it.
So the average costs 4 bytes per parameter divided by the world size, like the masters, and is never gathered
for training. The decays are WeightsEMA's (engine/ema.py); buffers are copied, not averaged.

The checkpoint holds one file per rank (the fragments, their offsets, the parameters' shapes and the count of
updates; ckpt/deepspeed_layout.py writes them beside DeepSpeed's own files). Loading reads, for each parameter,
the parts of the saved fragments that overlap the fragment this rank now holds, so a run resumes exactly at the
same world size and reshards to another one; `bigclip export --ema` assembles the whole parameters.

`swapped_in()` (--eval-ema) writes the average into the weights the forward reads: ZeRO-3's partitions (and
parameters it keeps gathered), or the whole replicated weights of ZeRO-0/1/2, assembled with an all-reduce of
the fragments one parameter at a time; the live weights wait in host memory meanwhile (engine/ema.py's `stash`)
and go back after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from bigclip.ckpt.fragments import fill_range
from bigclip.dist import World
from bigclip.engine.ema import WeightsEMA, float32_windows, stash


def _zero3_fragment(p: nn.Parameter, rank: int) -> tuple[torch.Tensor, int]:
    partition = p.ds_tensor.ds_numel
    start = rank * partition
    numel = max(0, min(partition, p.ds_numel - start))
    if p.requires_grad:
        from deepspeed.utils import safe_get_local_fp32_param

        local = safe_get_local_fp32_param(p)
    else:
        local = p.ds_tensor
    return local.flatten()[:numel], start


def master_fragment(p: nn.Parameter, rank: int) -> tuple[torch.Tensor | None, int]:
    """(the float32 master values this rank's optimizer holds of p, flattened; their offset in p), or (None, 0)."""
    if hasattr(p, "ds_id"):
        return _zero3_fragment(p, rank)
    if hasattr(p, "_hp_mapping"):  # ZeRO-1/2 and DeepSpeed's bf16 optimizer: None where this rank holds none
        if p._hp_mapping is None:
            return None, 0
        return p._hp_mapping.get_hp_fragment(), p._hp_mapping.lp_fragment_address.start
    return (p.detach().flatten(), 0) if rank == 0 else (None, 0)


class PartitionEMA(WeightsEMA):
    """WeightsEMA's interface over the fragments described above."""

    def __init__(self, model: nn.Module, world: World, decay: float, warmup: bool = False):
        self.model, self.world, self.decay, self.warmup = model, world, decay, warmup
        self.updates = 0
        self.shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
        self.params, self.starts = {}, {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                fragment, start = master_fragment(p, world.rank)
                if fragment is not None and fragment.numel():
                    self.params[name], self.starts[name] = fragment.detach().to(torch.float32).clone(), start
            self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        params = dict(self.model.named_parameters())
        return [(avg, master_fragment(params[n], self.world.rank)[0]) for n, avg in self.params.items()]

    @torch.no_grad()
    def reset(self) -> None:
        self.updates = 0
        for avg, fragment in self._pairs():
            avg.copy_(fragment)
        for name, b in self.model.named_buffers():
            self.buffers[name].copy_(b)

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        pairs = self._pairs()
        weight = 1.0 - self.decay_at(self.updates)
        for averages, masters in float32_windows(pairs):  # float32 masters are used as they are
            torch._foreach_lerp_(averages, masters, weight)
        for name, buffer in self.model.named_buffers():
            self.buffers[name].copy_(buffer)

    # -- checkpoints: one file per rank (ckpt/deepspeed_layout.py)
    def state_dict(self) -> dict:
        return {
            "params": self.params,
            "starts": self.starts,
            "shapes": self.shapes,
            "buffers": self.buffers,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        """The DeepSpeed layout's load of a sharded participant: {"ranks": [every saved rank's state_dict()]}."""
        self.load_from(state["ranks"])

    @torch.no_grad()
    def load_from(self, saved: list[dict]) -> None:
        """Fill this rank's fragments from every rank's saved state (any world size)."""
        self.updates = int(saved[0]["updates"])
        for name, avg in self.params.items():
            fill_range(avg, self.starts[name], name, saved)
        for name, value in saved[0]["buffers"].items():
            if name in self.buffers:
                self.buffers[name].copy_(value)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """Collective: the average in the weights the forward reads, the live ones back after."""
        restore: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, p in self.model.named_parameters():
            if hasattr(p, "ds_id"):  # ZeRO-3: this rank's partition, and the whole parameter if it stays gathered
                part = p.ds_tensor.flatten()
                restore.append((part, stash(part)))
                if name in self.params:
                    part[: self.params[name].numel()].copy_(self.params[name])
                if p.data.numel() == p.ds_numel:
                    restore.append((p.data, stash(p.data)))
                    p.data.copy_(self._whole(name, p).view_as(p.data))
            else:
                restore.append((p.data, stash(p.data)))
                p.data.copy_(self._whole(name, p).view_as(p.data))
        live_buffers = {n: stash(b) for n, b in self.model.named_buffers()}
        for name, b in self.model.named_buffers():
            b.copy_(self.buffers[name])
        try:
            yield
        finally:
            for target, live in restore:
                target.copy_(live)
            for name, b in self.model.named_buffers():
                b.copy_(live_buffers[name])

    def _whole(self, name: str, p: nn.Parameter) -> torch.Tensor:
        return self.whole_average(name, p.device).to(p.dtype)

    def whole_average(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """Collective: the whole float32 average of one parameter, flattened, on every rank (the fragments are
        disjoint, so it is their sum)."""
        device = device or self.world.device
        whole = torch.zeros(torch.Size(self.shapes[name]).numel(), dtype=torch.float32, device=device)
        if name in self.params:
            start = self.starts[name]
            whole[start : start + self.params[name].numel()] = self.params[name]
        if self.world.distributed:
            dist.all_reduce(whole)
        return whole
