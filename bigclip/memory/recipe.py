"""StateRecipe: what decides the training state's bytes per parameter besides the engine, read from the registries
that give the names their meaning: --precision (PRECISIONS: the weights' and the compute dtype) and --opt
(OPTIMIZERS: the optimizer state's bytes per parameter, its step's temporaries).

RECIPES is every distinct footprint the registries offer (one precision per weight/compute width, one optimizer
per state size, gradients kept or stepped in the backward): what `bigclip plan --gpu-mem` weighs against each other
and what bench/plan_check.py measures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from bigclip.optim import OPTIMIZERS, OptimizerKind
from bigclip.optim.packed_window import PACKED_WINDOW_VALUES
from bigclip.precision import PRECISIONS, Precision, resolve_precision

# The memory model describes a GPU run: amp's fp16 autocast there (bf16 on CPU: the same widths).
_GPU = torch.device("cuda")


@functools.cache
def _precision(name: str) -> Precision:
    return resolve_precision(name, _GPU)


@dataclass(frozen=True)
class StateRecipe:
    """The weights' dtype (--precision), the optimizer's state (--opt), whether gradients are kept until the step
    (--optimizer-in-backward), a float32 moving average of the weights (--ema-decay) and the micro-batches whose
    gradients are summed before each step (--accum-freq)."""

    precision: str = "amp"
    opt: str = "adamw"
    in_backward: bool = False
    ema: bool = False
    accum_freq: int = 1

    @property
    def _optimizer(self) -> OptimizerKind:
        return OPTIMIZERS.get(self.opt)

    @property
    def weight_bytes(self) -> int:
        """fp32 weights (fp32, and amp's master copy), or 16-bit ones without a master copy (pure bf16/fp16)."""
        return _precision(self.precision).param_dtype.itemsize

    @property
    def activation_bytes(self) -> int:
        """Bytes of each value the forward computes and the backward keeps: the autocast dtype, else the weights'."""
        p = _precision(self.precision)
        return (p.autocast_dtype or p.param_dtype).itemsize

    @property
    def mixed(self) -> bool:
        """fp32 weights computed in 16 bits (amp; FSDP2 all-gathers them in bf16)."""
        return self.weight_bytes == 4 and self.activation_bytes == 2

    @property
    def grad_bytes(self) -> int:
        """Gradients held until the step, in the weights' dtype; none when each is stepped as it arrives."""
        return 0 if self.in_backward else self.weight_bytes

    @property
    def optimizer_bytes(self) -> float:
        """The optimizer's state per parameter, as its registry entry says (Adam: two moments in the weights'
        dtype; 8-bit AdamW: two 8-bit moments and their scales)."""
        return self._optimizer.state_bytes(self.weight_bytes)

    @property
    def quantized_state(self) -> bool:
        return self._optimizer.quantized_state

    def step_scratch_bytes(
        self, local_params: float, largest_local: float, device_type: str, unit_local: float | None = None
    ) -> float:
        """Temporaries of one optimizer step beyond the state, for `local_params` parameters of which the largest
        tensor holds `largest_local` and, stepped in the backward, one step updates at most `unit_local`. torch's
        AdamW (fp32 weights and amp's masters) on CUDA takes its multi-tensor path, which builds sqrt(v) for every
        parameter at once: one float32 moment's bytes per parameter; stepped tensor by tensor (on CPU, or in the
        backward) it builds two float32 temporaries of one tensor. bigclip's packed update (8-bit AdamW; AdamW on
        bf16 weights) steps a window of values at a time: one window's packed weights, gradients and state and the
        compiled update's temporaries (optim/packed_window.py); the window spans at most the tensors stepped
        together (in the backward, one unit's). Another optimizer rounding into 16-bit weights stochastically
        (StableAdamW, tensor by tensor) draws a 32-bit random integer per value of the tensor being updated."""
        temporaries = self._optimizer.packed_update_temporaries(self.weight_bytes)
        if temporaries:
            per_value = 2 * self.weight_bytes + self.optimizer_bytes + temporaries
            together = unit_local if self.in_backward and unit_local is not None else local_params
            return per_value * min(PACKED_WINDOW_VALUES, together)
        if self.weight_bytes != 4:
            return 4 * largest_local
        if not self._optimizer.float32_step_temporaries:
            return 0.0
        if self.in_backward or device_type != "cuda":
            return 2 * 4 * largest_local
        return 4 * local_params

    @property
    def ema_bytes(self) -> int:
        return 4 if self.ema else 0

    @property
    def per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.ema_bytes

    def describe(self) -> str:
        return (
            f"{self.precision}, {self.opt}"
            + (", optimizer in backward" if self.in_backward else "")
            + (", EMA" if self.ema else "")
        )


def _distinct(names, footprint) -> tuple[str, ...]:
    """The first name of each distinct footprint, in registry order."""
    seen: dict = {}
    for name in names:
        seen.setdefault(footprint(name), name)
    return tuple(seen.values())


def distinct_precisions() -> tuple[str, ...]:
    """One --precision per (weight, compute) width, widest first: fp32, amp and 16-bit weights (bf16)."""
    widths = lambda n: (StateRecipe(n).weight_bytes, StateRecipe(n).activation_bytes)  # noqa: E731
    return tuple(sorted(_distinct(PRECISIONS, widths), key=lambda n: tuple(-w for w in widths(n))))


def distinct_optimizers() -> tuple[str, ...]:
    """One --opt per state size (AdamW's moments, 8-bit moments); prefix families (timm/<name>) left out."""
    named = [n for n, _ in OPTIMIZERS.items() if not OPTIMIZERS.entry(n).prefix]
    return _distinct(named, lambda n: OPTIMIZERS.get(n).state_bytes(4))


def recipes() -> tuple[StateRecipe, ...]:
    """Every distinct footprint: precision x optimizer x gradients kept or stepped in the backward."""
    return tuple(
        StateRecipe(precision, opt, in_backward)
        for precision in distinct_precisions()
        for opt in distinct_optimizers()
        for in_backward in (False, True)
    )
