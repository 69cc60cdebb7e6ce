"""SwitchBack: int8 linear layers for CLIP training (Wortsman, Dettmers et al. 2023, "Stable and
low-precision training for large-scale vision-language models"), bigclip's own copy of what
bitsandbytes <= 0.49 shipped in `bitsandbytes.nn.triton_based_modules` (removed in 0.50; that version
ran on CUDA only). OpenCLIP selects them with `--use-bnb-linear NAME`; NAME is one of `VARIANTS`.

What is int8 and what is not. A linear layer's three matmuls per step:
- forward Y = X W^T + b: X quantized row-wise (one scale per token), W globally (one scale for the
  tensor) or per output channel (Vectorwise); int8 x int8 with an int32 accumulator, dequantised with
  the two scales, bias added in float32, cast to the input dtype.
- input gradient dX = G W: G quantized row-wise, W globally (Global: the same int8 W as the forward) or
  per input column (Vectorwise: the scales must be constant along the summed dimension, the output
  channels, so W is re-quantized per column for the backward, as bitsandbytes did with
  `quantize_columnwise_and_transpose`); int8 matmul, dequantised like the forward.
- weight gradient dW = G^T X: floating point (the input dtype: bf16 under autocast). The sum runs over
  every token of the batch, where int8 rounding would accumulate; this is the "switch back" of the name.
  The bias gradient is G summed over tokens, floating point.
So `SwitchBackLinear*` makes two int8 matmuls per forward+backward (`INT8_MATMULS` counts them) and
`StandardLinear` none: it is bitsandbytes' floating-point re-implementation of linear as an
autograd.Function, the baseline to compare against.

Variants: Global and Vectorwise save the floating X for the weight gradient; GlobalMemEfficient saves the
int8 X and its row scales instead (1 byte per element instead of 2 or 4) and dequantizes X for the weight
gradient, which then carries X's quantization error too. Every variant saves the int8 W the input gradient
multiplies by (made in the forward, transposed: W is quantized once per step), not the floating W.

Quantization: per group (row, column or tensor) scale = absmax / 127 in float32 and
q = round_half_even(x / scale) in [-127, 127]; an all-zero group has scale 0 and q 0 (no division by
zero); a NaN counts as an infinite absmax, so it makes its outputs non-finite rather than vanishing.
Error bound: with x = q_x s_x + e_x, |e_x| <= s_x / 2 (and the same for w), one output element
sum_k x_k w_k is off by at most sum_k (|x_k| s_w / 2 + |w_k| s_x / 2 + s_x s_w / 4) plus float32 rounding
of the dequantisation (a few ulp), where s_x, s_w are the scales of the groups x_k and w_k belong to.
The same holds for the input gradient with (G, W) in place of (X, W^T).

Which layers. OpenCLIP's `replace_linear` swaps only modules named `c_fc` and `c_proj`: the MLPs of the
transformer blocks, where most FLOPs are and where the paper applied SwitchBack. bigclip's text tower
uses those names; its timm ViT image tower names them `fc1` / `fc2` (`blocks.{i}.mlp`), hence
`MLP_LINEAR_NAMES`. (A timm tower built with the `mlp` projection head has `fc1` / `fc2` in the head too.)

Dispatch: CUDA tensors use the Triton kernels of `bigclip.model.switchback_triton` (imported on first
use: Triton stays optional); every other device uses the torch functions below, with
`torch._int_mm(int8, int8) -> int32` for the int8 matmul. On CPU `torch._int_mm` takes any shapes and
strides (checked with torch 2.14: 1x1x1, odd sizes, transposed operands, empty dims), so nothing is
padded; its CUDA kernel wants M > 16 and K, N multiples of 8, one reason CUDA goes to Triton. On a CPU without
VNNI (AVX2 only) its sums saturate in int16, so there the exact sum comes from float32 matmuls (int8_matmul).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from bigclip.registry import Registry

MLP_LINEAR_NAMES = ("c_fc", "c_proj", "fc1", "fc2")
# --use-bnb-linear NAME -> the nn.Linear subclass it means (registered below, with the classes).
SWITCHBACK_VARIANTS: Registry[type[nn.Linear]] = Registry("--use-bnb-linear")

# Int8 matmuls made by SwitchBack layers since the last reset, by role ("forward", "input_grad").
INT8_MATMULS: collections.Counter[str] = collections.Counter()


def reset_int8_matmuls() -> None:
    INT8_MATMULS.clear()


# --------------------------------------------------------------------------- the torch path


def _absmax_candidates(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN as +inf, as the Triton kernels do (a NaN must not be rounded into a finite int8)."""
    return torch.where(torch.isnan(x), torch.inf, x.abs())


def _to_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round_half_even(x / scale) as int8 (x float32, scale broadcastable); 0 where the scale is 0 and for a
    NaN (its group's scale is infinite and carries it)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = torch.round(x / safe)
    return torch.where(torch.isnan(v), 0.0, v).clamp_(-127, 127).to(torch.int8)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, k], float32 scale per row): scale = absmax(row) / 127, q = round(x / scale)."""
    x = x.float()
    scale = _absmax_candidates(x).amax(dim=1) / 127.0 if x.shape[1] else x.new_zeros(x.shape[0])
    return _to_int8(x, scale[:, None]), scale


def quantize_columnwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 in x's shape, float32 scale per column): the row-wise quantization of x^T, laid out as x."""
    x = x.float()
    scale = _absmax_candidates(x).amax(dim=0) / 127.0 if x.shape[0] else x.new_zeros(x.shape[1])
    return _to_int8(x, scale[None, :]), scale


def quantize_global(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 in x's shape, one float32 scale as a 0-dim tensor): scale = absmax(x) / 127."""
    x = x.float()
    scale = _absmax_candidates(x).amax() / 127.0 if x.numel() else x.new_zeros(())
    return _to_int8(x, scale), scale


def quantize_global_pair(
    x: torch.Tensor, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(q, q^T or None, scale): `quantize_global` and its transpose, which the input gradient multiplies by.
    Here q^T is a view (torch._int_mm takes any strides on CPU); the Triton version writes it contiguous,
    K-major for the GPU's 8-bit tensor cores, in the pass that quantizes x."""
    q, scale = quantize_global(x)
    return q, q.t() if transposed else None, scale


def quantize_columnwise_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q^T, float32 scale per column of x): `quantize_columnwise` laid out as x^T (a view here; contiguous
    from the Triton version)."""
    q, scale = quantize_columnwise(x)
    return q.t(), scale


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale[row] in float32, cast to out_dtype."""
    return (q.float() * scale[:, None]).to(out_dtype)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for int8 [M, K] and [K, N], the exact int32 accumulator (|a_ik b_kj| <= 2^14: no overflow
    below K = 2^17)."""
    if a.device.type == "cpu" and not _cpu_int_mm_is_exact():
        return _int8_matmul_in_float32(a, b)
    return torch._int_mm(a, b)


@functools.cache
def _cpu_int_mm_is_exact() -> bool:
    """Whether torch._int_mm keeps the exact int32 sum on this CPU. Without VNNI (AVX2-only CPUs) oneDNN sums
    pairs of u8 x s8 products into int16 with saturation: 127 x 127 over K = 64 comes out wrong there (and any
    pair of large products), while with VNNI (AVX-512 VNNI, AMX) every sum is exact. One probe per process."""
    ones = torch.full((32, 64), 127, dtype=torch.int8)
    return bool((torch._int_mm(ones, ones.t().contiguous()) == 127 * 127 * 64).all())


# float32 holds every integer up to 2^24 exactly, and 1024 products of int8 values (|each| <= 2^14) sum to at
# most 2^24 in magnitude: each chunk's float32 matmul is exact whatever its order of summation.
_EXACT_FLOAT32_K = 1024


def _int8_matmul_in_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8_matmul's exact result through float32 matmuls over chunks of K, summed in int32 (where torch._int_mm
    is not exact; on such CPUs float32 is the fast matmul anyway)."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    for k in range(0, a.shape[1], _EXACT_FLOAT32_K):
        out += (a[:, k : k + _EXACT_FLOAT32_K].float() @ b[k : k + _EXACT_FLOAT32_K].float()).int()
    return out


def int8_matmul_dequant(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """((a @ b) * a_scale[row]) * b_scale + bias in float32, cast to out_dtype.

    b_scale is 0-dim (b quantized globally) or [N] (one scale per column of b). The order of the float32
    operations is the Triton kernel's, so the two paths agree bit for bit.
    """
    out = int8_matmul(a, b).float() * a_scale[:, None] * b_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


class _TorchOps:
    """The torch functions above, under the names the Triton module uses."""

    quantize_rowwise = staticmethod(quantize_rowwise)
    quantize_columnwise = staticmethod(quantize_columnwise)
    quantize_global = staticmethod(quantize_global)
    quantize_global_pair = staticmethod(quantize_global_pair)
    quantize_columnwise_transposed = staticmethod(quantize_columnwise_transposed)
    dequantize_rowwise = staticmethod(dequantize_rowwise)
    int8_matmul = staticmethod(int8_matmul)
    int8_matmul_dequant = staticmethod(int8_matmul_dequant)


def _ops_for(t: torch.Tensor):
    """The kernels for t's device: Triton on CUDA (imported here, on first use), torch elsewhere."""
    if t.is_cuda:
        from bigclip.model import switchback_triton

        return switchback_triton
    return _TorchOps


# --------------------------------------------------------------------------- autograd


@dataclass(frozen=True)
class _Scheme:
    vectorwise: bool  # W per output channel in the forward, per input column in the backward
    mem_efficient: bool  # save int8 X (and int8 W) for the backward instead of the floating X


def _counted_matmul(ops, role: str, a, b, a_scale, b_scale, bias, out_dtype) -> torch.Tensor:
    INT8_MATMULS[role] += 1
    return ops.int8_matmul_dequant(a, b, a_scale, b_scale, bias, out_dtype)


def _no_autocast(t: torch.Tensor):
    """Autocast off inside the functions: the module has already cast the inputs, and a backward run
    under someone's autocast must not recast the weight-gradient matmul. (Meta tensors have no autocast.)"""
    if not torch.amp.is_autocast_available(t.device.type):
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


class _SwitchBackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, scheme: _Scheme):
        ops = _ops_for(x)
        x2 = x.reshape(-1, x.shape[-1])
        input_grad = ctx.needs_input_grad[0]
        with _no_autocast(x):
            x_q, x_scale = ops.quantize_rowwise(x2)
            # W is quantized once per step, here: the int8 copy the input gradient multiplies by (W itself
            # for dX = G W, stored transposed so that the summed index is contiguous) is made now and saved.
            # dX[m, k] = sum_n G[m, n] W[n, k]: W's scale must not depend on n, the summed index, so
            # Vectorwise quantizes W per column k for it; a global scale serves W and W^T alike.
            if scheme.vectorwise:
                w_q, w_scale = ops.quantize_rowwise(weight)  # per output channel = per column of W^T
                w_bwd_t, w_bwd_scale = ops.quantize_columnwise_transposed(weight) if input_grad else (None, None)
            else:
                w_q, w_bwd_t, w_scale = ops.quantize_global_pair(weight, transposed=input_grad)
                w_bwd_scale = w_scale
            out = _counted_matmul(ops, "forward", x_q, w_q.t(), x_scale, w_scale, bias, x.dtype)
        if scheme.mem_efficient:
            ctx.save_for_backward(x_q, x_scale, w_bwd_t, w_bwd_scale)
        else:
            ctx.save_for_backward(x2, w_bwd_t, w_bwd_scale)
        ctx.scheme = scheme
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        scheme = ctx.scheme
        ops = _ops_for(grad_out)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad_out):
            if scheme.mem_efficient:
                x_q, x_scale, w_bwd_t, w_bwd_scale = ctx.saved_tensors
            else:
                x2, w_bwd_t, w_bwd_scale = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                g_q, g_scale = ops.quantize_rowwise(g)
                grad_x = _counted_matmul(ops, "input_grad", g_q, w_bwd_t.t(), g_scale, w_bwd_scale, None, ctx.x_dtype)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                x_float = ops.dequantize_rowwise(x_q, x_scale, g.dtype) if scheme.mem_efficient else x2.to(g.dtype)
                grad_w = (g.t() @ x_float).to(ctx.w_dtype)
            if ctx.needs_input_grad[2]:
                grad_b = g.sum(dim=0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


class _StandardLinearFunction(torch.autograd.Function):
    """Linear in floating point as an autograd.Function (bitsandbytes' StandardLinear baseline)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        with _no_autocast(x):
            out = x2 @ weight.t()
            if bias is not None:
                out = out + bias
        ctx.save_for_backward(x2, weight)
        ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad_out):
            if ctx.needs_input_grad[0]:
                grad_x = (g @ weight.to(g.dtype)).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = (g.t() @ x2.to(g.dtype)).to(weight.dtype)
            if ctx.needs_input_grad[2]:
                grad_b = g.sum(dim=0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


# --------------------------------------------------------------------------- modules


def _autocast_inputs(x: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Cast x, weight and bias to the autocast dtype where autocast is on, as F.linear would be.

    The casts are ordinary differentiable ops outside the autograd.Function, so the gradients come back
    to the fp32 parameters in fp32, and the int8 quantization sees the bf16/fp16 values."""
    device_type = x.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t if t is None or not t.is_floating_point() else t.to(dtype) for t in (x, *tensors))


class _SwitchBackLinear(nn.Linear):
    """nn.Linear with a SwitchBack forward/backward: the same parameters, names and state dict."""

    scheme: _Scheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = _autocast_inputs(x, self.weight, self.bias)
        return _SwitchBackFunction.apply(x, weight, bias, self.scheme)


class SwitchBackLinearGlobal(_SwitchBackLinear):
    """X row-wise, W global in the forward and the input gradient; weight gradient in floating point."""

    scheme = _Scheme(vectorwise=False, mem_efficient=False)


class SwitchBackLinearGlobalMemEfficient(_SwitchBackLinear):
    """As SwitchBackLinearGlobal, saving int8 X and W for the backward; dW uses the dequantized X."""

    scheme = _Scheme(vectorwise=False, mem_efficient=True)


class SwitchBackLinearVectorwise(_SwitchBackLinear):
    """W per output channel in the forward, per input column in the input gradient; X and G row-wise."""

    scheme = _Scheme(vectorwise=True, mem_efficient=False)


class StandardLinear(nn.Linear):
    """Floating-point linear through `_StandardLinearFunction`: no int8, the baseline."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = _autocast_inputs(x, self.weight, self.bias)
        return _StandardLinearFunction.apply(x, weight, bias)


for _cls, _help in (
    (SwitchBackLinearGlobal, "int8 forward and input gradient, one scale per weight tensor"),
    (SwitchBackLinearGlobalMemEfficient, "as SwitchBackLinearGlobal, saving int8 X and W for the backward"),
    (SwitchBackLinearVectorwise, "int8 forward and input gradient, per-channel weight scales"),
    (StandardLinear, "the same layer in floating point: the experiments' control arm"),
):
    SWITCHBACK_VARIANTS.register(_cls.__name__, _cls, help=_help)
VARIANTS = tuple(SWITCHBACK_VARIANTS.names())
VARIANT_CLASSES: dict[str, type[nn.Linear]] = dict(SWITCHBACK_VARIANTS.items())

# One SwitchBack layer's forward + backward against bf16 nn.Linear's on a CPU (bench/int8_linear.py, ViT-H and
# ViT-bigG MLP shapes, 2 cores, 2026-11-27; docs/benchmarks.md): torch._int_mm is no tuned GEMM there, and the
# quantization passes come on top. The speed SwitchBack is for needs a GPU's int8 tensor cores.
CPU_SPEED_VS_BF16 = (0.28, 0.80)


def speed_note(variant: str, device: torch.device) -> str | None:
    """What a run with `--use-bnb-linear variant` says once at start-up about its speed where its int8 layers
    cannot be faster than floating point (off CUDA, where the Triton kernels do not run), so that nobody reads an
    experiment's slowdown there as SwitchBack's; None where there is nothing to say (CUDA: the GPU kit measures
    it; StandardLinear, which has no int8)."""
    if device.type == "cuda" or not issubclass(VARIANT_CLASSES[variant], _SwitchBackLinear):
        return None
    low, high = CPU_SPEED_VS_BF16
    return (
        f"--use-bnb-linear {variant} on {device.type}: the int8 layers reproduce SwitchBack's numerics, not its "
        f"speed: off CUDA they run on torch._int_mm and extra quantization passes, {low:.2f}-{high:.2f}x bf16's "
        "speed on a CPU (docs/benchmarks.md, int8 SwitchBack linear layers)"
    )


def replace_linears(model: nn.Module, variant: str, names: tuple[str, ...] = MLP_LINEAR_NAMES) -> int:
    """Make every nn.Linear whose own name (last part of its qualified name) is in `names` a `variant`.

    In place, by changing the module's class: the Parameter objects, their names, the state dict and any
    reference to them (an optimizer, a meta-device model waiting for materialisation) stay as they are,
    so this works on meta. Run it before any FSDP/DeepSpeed wrapping. Returns how many were swapped.
    A subclass of nn.Linear that is not ours is refused: its own forward would be silently lost.
    """
    if variant not in VARIANT_CLASSES:
        raise ValueError(f"unknown SwitchBack variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    cls = VARIANT_CLASSES[variant]
    ours = (nn.Linear, *VARIANT_CLASSES.values())
    swapped = 0
    for qualified, module in model.named_modules():
        if not isinstance(module, nn.Linear) or qualified.rpartition(".")[2] not in names:
            continue
        if type(module) not in ours:
            raise TypeError(f"{qualified} is a {type(module).__name__}, not a plain nn.Linear: not replaced")
        module.__class__ = cls
        swapped += 1
    return swapped
