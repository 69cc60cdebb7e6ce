"""--ema-decay: an exponential moving average of the weights, kept where the weights are.

After every optimizer step each rank updates the average of the parameters it holds, in float32, in place:
under DDP (and one process) the whole model, under FSDP2 each rank's own shards (the average is a DTensor
with the parameter's placements, so it is never gathered, is saved by DCP as shards and reshards on resume like
the weights). Buffers (BatchNorm statistics) are copied, not averaged, as timm's ModelEmaV3 does.

    decay_t = --ema-decay                                         (constant)
    decay_t = min(--ema-decay, 1 - (1 + t) ** (-2/3))             (--ema-warmup: timm's ModelEmaV3 warm-up,
                                                                  gamma 1, power 2/3; t = updates so far)
    ema_t   = decay_t * ema_(t-1) + (1 - decay_t) * weights_t     (ema_0 = the weights at the start)

The count of updates is saved with the average, so a resumed run continues the same sequence of decays.
`swapped_in()` puts the average into the model's parameters for an evaluation and the live weights back after,
without a second copy of the weights where the weights' memory is scarce: float32 weights (amp, fp32) exchange
their values with the average's tensor by tensor (one tensor's scratch; both back bit for bit after), and weights
of another dtype (pure bf16, which hold the average rounded) wait in host memory when they live on an accelerator
(`stash`). A copy of every weight beside the state was the evaluation's peak: 2 or 4 bytes per parameter more
than the training step's (ViT-bigG-14 under DDP: 5 GB in bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from bigclip.dist import local_shard

WARMUP_POWER = 2 / 3  # timm ModelEmaV3's warmup_power (its warmup_gamma: 1)
# Weights that are not float32 (pure bf16) are converted for the update this many values at a time: 64 MiB of
# float32 copies, not a float32 copy of every weight at once (4 bytes per parameter; measured in
# docs/benchmarks.md), in few enough multi-tensor calls (a whole ViT-bigG-14 in ~150).
UPDATE_WINDOW_VALUES = 1 << 24


def float32_windows(pairs: list[tuple[torch.Tensor, torch.Tensor]], limit: int = UPDATE_WINDOW_VALUES):
    """(averages, the weights as float32) in consecutive windows of at most `limit` converted values (a larger
    tensor alone); float32 weights are used as they are, at no cost, so they never close a window. A window's
    copies are freed before the next window's are made (the lists handed out are emptied)."""
    averages, weights, converted = [], [], 0
    for average, weight in pairs:
        cost = 0 if weight.dtype == torch.float32 else weight.numel()
        if converted and converted + cost > limit:
            yield averages, weights
            weights.clear()
            averages, weights, converted = [], [], 0
        averages.append(average)
        weights.append(weight.to(torch.float32))
        converted += cost
    if averages:
        yield averages, weights


def stash(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`'s values to put back later, kept off the accelerator: in host memory (a device-to-host
    copy per evaluation), or a clone where the tensor is in host memory already."""
    if tensor.device.type == "cpu":
        return tensor.clone()
    return tensor.to("cpu")


@torch.no_grad()
def exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    """Swap two same-shaped, same-dtype tensors' values in place, through one tensor-sized scratch."""
    scratch = a.clone()
    a.copy_(b)
    b.copy_(scratch)


def update_scratch_bytes(weight_bytes: int, params: float, largest_tensor: float) -> float:
    """The update's float32 copies of weights of `weight_bytes` bytes each, `params` of them (the largest tensor
    `largest_tensor` values): at most one window, or that tensor."""
    if weight_bytes == 4:
        return 0.0
    return 4.0 * min(params, max(UPDATE_WINDOW_VALUES, largest_tensor))


class WeightsEMA:
    checkpoint_kind = "sharded"  # saved and resharded by the engine's checkpoint layout (ckpt/participants.py)

    def __init__(
        self, model: nn.Module, decay: float, warmup: bool = False, release_gathered: Callable[[], None] = lambda: None
    ):
        """`release_gathered`: the engine's way to drop gathered copies of the weights, so that the model's
        parameters are the ones it stores (FSDP2: its shards; the root module stays gathered after an evaluation's
        forward, whose values the next forward would reuse) and the next forward gathers them again."""
        self.model, self.decay, self.warmup = model, decay, warmup
        self.release_gathered = release_gathered
        self.updates = 0
        with torch.no_grad():
            # float32 copies with the parameters' placements (a DTensor's clone is a DTensor)
            self.params = {n: p.detach().to(torch.float32).clone() for n, p in model.named_parameters()}
            self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the weights as they are (a resumed checkpoint that holds none)."""
        self.updates = 0
        self.release_gathered()
        for name, p in self.model.named_parameters():
            local_shard(self.params[name]).copy_(local_shard(p))
        for name, b in self.model.named_buffers():
            self.buffers[name].copy_(b)

    def decay_at(self, updates: int) -> float:
        """The decay of update number `updates` (counted from 1)."""
        if not self.warmup:
            return self.decay
        return min(self.decay, 1.0 - (1.0 + updates) ** -WARMUP_POWER)

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step (and the parameter constraints): pull the average towards the weights."""
        self.updates += 1
        weight = 1.0 - self.decay_at(self.updates)
        # the parameters as registered now (FSDP2 registers its sharded DTensors again after each backward)
        pairs = [(local_shard(self.params[n]), local_shard(p)) for n, p in self.model.named_parameters()]
        for averages, weights in float32_windows(pairs):
            torch._foreach_lerp_(averages, weights, weight)
        for name, buffer in self.model.named_buffers():
            self.buffers[name].copy_(buffer)

    def state_dict(self) -> dict:
        return {"params": self.params, "buffers": self.buffers, "updates": torch.tensor(self.updates)}

    def load_state_dict(self, state: dict) -> None:
        """After DCP filled this object's own tensors in place (they are the load template): the count."""
        self.updates = int(state["updates"])

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's parameters (and its buffers in the model's), the live ones back after: float32
        weights exchanged with the average (which holds the live weights meanwhile), others stashed and overwritten
        with the average rounded to their dtype."""
        self.release_gathered()  # the live weights' evaluation left them gathered: the forward would not read these
        exchanged, stashed, live_buffers = [], [], {}
        buffers = dict(self.model.named_buffers())
        try:  # what was swapped in so far goes back if swapping the rest fails
            for name, p in self.model.named_parameters():
                weight, average = local_shard(p), local_shard(self.params[name])
                if weight.dtype == average.dtype:
                    exchange(weight, average)
                    exchanged.append((weight, average))
                else:
                    stashed.append((weight, stash(weight)))
                    weight.copy_(average)
            for name, b in buffers.items():
                live_buffers[name] = stash(b)  # small: BatchNorm's statistics, if any
                b.copy_(self.buffers[name])
            yield
        finally:
            self.release_gathered()  # the average's evaluation left it gathered: the next step would train on it
            for weight, average in exchanged:
                exchange(weight, average)
            for weight, live in stashed:
                weight.copy_(live)
            for name, live in live_buffers.items():
                buffers[name].copy_(live)
