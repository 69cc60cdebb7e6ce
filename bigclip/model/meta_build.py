"""Constructing a model on the meta device without running its weight initialisation there.

Every bigclip model is first constructed on the meta device (factory.create_model) and initialised afterwards by
its own `init_weights()` on a real device (or shard by shard by a sharding engine). The towers' constructors
(timm's, torch.nn's, transformers') still run their own initialisation while they are built: trunc_normal_,
kaiming_uniform_, ... On meta tensors that arithmetic computes nothing, as they hold no values, yet it was most of a
meta build's time: torch runs in-place ops on meta through its Python reference decompositions (docs/benchmarks.md,
"Meta construction": ViT-bigG-14 4.6x faster to construct without them, `bigclip models`' count 25 s -> 10 s).

`meta_construction()` is `torch.device("meta")` plus a torch function mode that returns such in-place calls'
target untouched. Only calls that cannot change a tensor's metadata are skipped: torch.nn.init's in-place
initialisers and the in-place elementwise and random Tensor methods below (not resize_, requires_grad_,
transpose_, ...), and only on meta tensors. A tensor operand whose shape does not broadcast to the target still
fails, as the skipped call would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# in-place Tensor methods that keep the target's shape, dtype and strides (the ones initialisers use)
_VALUE_ONLY_METHODS = frozenset(
    {
        "abs_", "add_", "addcdiv_", "addcmul_", "bernoulli_", "cauchy_", "clamp_", "clamp_max_", "clamp_min_",
        "clip_", "copy_", "div_", "erf_", "erfinv_", "exp_", "exponential_", "fill_", "fmod_", "geometric_",
        "lerp_", "log_", "log_normal_", "masked_fill_", "mul_", "neg_", "normal_", "pow_", "random_", "sqrt_",
        "sub_", "tanh_", "trunc_", "uniform_", "zero_",
    }
)  # fmt: skip


# the callables themselves: a mode sees every torch call made while a model is constructed (~10 per parameter), so
# the test is one set lookup
_VALUE_ONLY = frozenset(
    [getattr(torch.Tensor, name) for name in _VALUE_ONLY_METHODS]
    # torch.nn.init's public initialisers (trunc_normal_, kaiming_uniform_, orthogonal_, ...) fill their first
    # argument in place; its helpers without a trailing underscore return values and are not skipped
    + [f for name, f in vars(torch.nn.init).items() if callable(f) and name.endswith("_") and not name.startswith("_")]
)


class _SkipValuesOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_ONLY:
            # torch.nn.init's functions reach a mode with every argument by keyword, the first named `tensor`
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                for operand in (*args, *kwargs.values()):
                    if isinstance(operand, torch.Tensor) and operand is not target:
                        torch.broadcast_shapes(operand.shape, target.shape)  # raises as the call would have
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_construction() -> Iterator[None]:
    """Modules constructed inside are on the meta device, their constructors' initialisation math skipped."""
    with torch.device("meta"), _SkipValuesOnMeta():
        yield
