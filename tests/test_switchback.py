"""SwitchBack int8 linears (bigclip.model.switchback): numerics against float64, the Triton kernels against
the torch path, the in-place replacement, the int8-matmul count and autocast.

The error bound the numerics are held to, derived from the quantization. A group (row, column or tensor)
with scale s = absmax / 127 gives q = round(x / s) with the division rounded to float32, so
|x - q s| <= h = s (1/2 + 2^-16) (1/2 from rounding to an integer, 127 * 2^-24 < 2^-16 from the division).
Writing x = q_x s_x + e_x and w = q_w s_w + e_w, one term of a dot product is off by
|x e_w + w e_x - e_x e_w| <= |x| h_w + |w| h_x + h_x h_w, so an output element of A @ B is off by at most
    sum_k (|a_k| h_b + |b_k| h_a + h_a h_b)
with h_a of a's row and h_b of b's column (global: one h), plus the float32 rounding of the dequantisation
((acc * s_a) * s_b + bias: three roundings and the int32 -> float32 conversion, 4 * 2^-24 relative to
sum_k (|a_k| + h_a)(|b_k| + h_b) + |bias|). Float matmuls over n terms are held to gamma_n = n 2^-24 (1.01)
times sum |a||b| (any summation order). The reference is float64 F.linear and its gradients.

Triton runs under TRITON_INTERPRET=1, which must be set before triton is imported; other test modules in
this pytest process may have imported it already, so the Triton cases run in a fresh Python process: this
file executed as a script (``python tests/test_switchback.py GROUP``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigclip.model import switchback as sb

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
U = 2.0**-24  # float32 unit roundoff
INT8_VARIANTS = ("SwitchBackLinearGlobal", "SwitchBackLinearGlobalMemEfficient", "SwitchBackLinearVectorwise")


@pytest.fixture(autouse=True)
def fresh_counter():
    sb.reset_int8_matmuls()
    yield


def _half_width(scale: torch.Tensor) -> torch.Tensor:
    return scale.double() * (0.5 + 2.0**-16)


def _int8_bound(a, b, h_a, h_b, bias=None):
    """The bound above for A [M, K] @ B [K, N]: h_a per row of A, h_b per column of B or 0-dim."""
    a, b = a.double().abs(), b.double().abs()
    h_a, h_b = h_a[:, None], h_b if h_b.dim() == 0 else h_b[None, :]
    k = a.shape[1]
    bound = a.sum(1, keepdim=True) * h_b + h_a * b.sum(0, keepdim=True) + k * h_a * h_b
    magnitude = (a + h_a) @ (b + h_b)
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return bound + 4 * U * magnitude


def _gamma(n: int) -> float:
    return 1.01 * n * U


def _forward_bound(variant, x2, w, b):
    """Elementwise bound on |layer(x2) - x2 @ w^T - b| (x2 [tokens, in]), from the actual scales."""
    if variant == "StandardLinear":
        return _gamma(x2.shape[1] + 1) * (x2.double().abs() @ w.double().abs().t() + b.double().abs())
    h_x = _half_width(sb.quantize_rowwise(x2)[1])
    if variant == "SwitchBackLinearVectorwise":
        h_w = _half_width(sb.quantize_rowwise(w)[1])  # per output channel: the columns of W^T
    else:
        h_w = _half_width(sb.quantize_global(w)[1])
    return _int8_bound(x2, w.t(), h_x, h_w, b)


def _rounding_noise(variant, a, w, forward: bool):
    """The mean over elements of the modelled error variance of the forward (a = X) or input grad (a = G):
    sum_k a_k^2 s_b^2 / 12 + b_k^2 s_a^2 / 12 (the product of two rounding errors is negligible)."""
    b = w.t() if forward else w
    s_a = sb.quantize_rowwise(a)[1].double()[:, None]
    if variant == "SwitchBackLinearVectorwise":
        s_b = (sb.quantize_rowwise(w) if forward else sb.quantize_columnwise(w))[1].double()[None, :]
    else:
        s_b = sb.quantize_global(w)[1].double()
    a, b = a.double(), b.double()
    return (((a * a).sum(1, keepdim=True) * s_b**2 + s_a**2 * (b * b).sum(0, keepdim=True)) / 12).mean()


def _input_grad_bound(variant, g2, w):
    """Elementwise bound on |dX - G @ W| (G [tokens, out])."""
    if variant == "StandardLinear":
        return _gamma(g2.shape[1]) * (g2.double().abs() @ w.double().abs())
    h_g = _half_width(sb.quantize_rowwise(g2)[1])
    if variant == "SwitchBackLinearVectorwise":
        h_w = _half_width(sb.quantize_columnwise(w)[1])  # per input column of W
    else:
        h_w = _half_width(sb.quantize_global(w)[1])
    return _int8_bound(g2, w, h_g, h_w)


def _layer(variant: str, n_in: int, n_out: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, n_in**-0.5)
        if bias:
            layer.bias.normal_(0, 0.5)
    sb.replace_linears(nn.ModuleDict({"fc1": layer}), variant, ("fc1",))
    return layer


def _inputs(shape, n_out, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x[..., 0] *= 20  # an outlier feature, as activations have: the row-wise scales must cope
    grad = torch.randn(*shape[:-1], n_out, generator=gen)
    return x, grad


def _run(layer, x, grad):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def _assert_within(got, ref, bound, what):
    err = (got.double() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max error {err.max().item():.3g})"
    return err


SHAPES = [
    pytest.param((7, 13), 5, id="7x13->5"),
    pytest.param((2, 3, 13), 5, id="2x3x13->5"),
    pytest.param((64, 1280), 5120, id="vit-h-fc1"),
    pytest.param((64, 5120), 1280, id="vit-h-fc2"),
]


@pytest.mark.parametrize("shape,n_out", SHAPES)
@pytest.mark.parametrize("variant", sb.VARIANTS)
def test_forward_and_gradients_within_the_quantization_bound(variant, shape, n_out):
    layer = _layer(variant, shape[-1], n_out)
    x, grad = _inputs(shape, n_out)
    y, dx, dw, db = _run(layer, x, grad)
    assert y.shape == (*shape[:-1], n_out) and dx.shape == x.shape and y.dtype == torch.float32
    assert sum(sb.INT8_MATMULS.values()) == (0 if variant == "StandardLinear" else 2)

    x2, g2 = x.reshape(-1, shape[-1]), grad.reshape(-1, n_out)
    w, b = layer.weight.detach(), layer.bias.detach()
    x64, g64, w64 = x2.double(), g2.double(), w.double()
    ref_y, ref_dx, ref_dw, ref_db = F.linear(x64, w64, b.double()), g64 @ w64, g64.t() @ x64, g64.sum(0)
    tokens, n_in = x2.shape
    ax, ag = x64.abs(), g64.abs()

    bound_y = _forward_bound(variant, x2, w, b)
    bound_dx = _input_grad_bound(variant, g2, w)
    if variant == "SwitchBackLinearGlobalMemEfficient":
        # dW = G^T X' with X' = fl(q_x s_x): X's quantization error, then a float32 matmul over the tokens.
        h_x = _half_width(sb.quantize_rowwise(x2)[1])
        bound_dw = ag.t() @ h_x[:, None].expand(-1, n_in) + _gamma(tokens + 2) * (ag.t() @ (ax + h_x[:, None]))
    else:
        bound_dw = _gamma(tokens) * (ag.t() @ ax)
    bound_db = _gamma(tokens) * ag.sum(0)

    err = _assert_within(y.reshape(-1, n_out), ref_y, bound_y, "forward")
    _assert_within(dx.reshape(-1, n_in), ref_dx, bound_dx, "input grad")
    _assert_within(dw, ref_dw, bound_dw, "weight grad")
    _assert_within(db, ref_db, bound_db, "bias grad")
    if variant != "StandardLinear":
        # int8 really ran (errors far above float32's), and the bound is a worst case, not a vacuous one
        assert err.max() > 1e3 * U * ref_y.abs().max()
        assert err.max() > 1e-3 * bound_y.max()
    if variant != "StandardLinear" and tokens * n_out >= 10_000:
        # The worst case grows with K where rounding errors average out (~sqrt(K)), so at ViT widths it would
        # miss a truncating rounding or a scale of the wrong orientation; the mean square error must match
        # the rounding-noise model (independent errors uniform in +-s/2, variance s^2/12), which it does to ~1%.
        for got, ref, expected in [
            (y.reshape(-1, n_out), ref_y, _rounding_noise(variant, x2, w, forward=True)),
            (dx.reshape(-1, n_in), ref_dx, _rounding_noise(variant, g2, w, forward=False)),
        ]:
            ratio = ((got.double() - ref) ** 2).mean() / expected
            assert 0.9 < ratio < 1.1, f"mean square error {ratio.item():.3f} x the rounding-noise model"


def test_without_bias_and_without_input_grad():
    layer = _layer("SwitchBackLinearGlobal", 13, 5, bias=False)
    x, grad = _inputs((7, 13), 5)
    y = layer(x)  # x needs no grad: only the forward is int8
    y.backward(grad)
    assert layer.weight.grad.shape == (5, 13)
    assert dict(sb.INT8_MATMULS) == {"forward": 1}
    torch.testing.assert_close(layer.weight.grad, grad.t() @ x)


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("how", ["rowwise", "columnwise", "global"])
def test_multiples_of_the_scale_round_trip_exactly(how):
    gen = torch.Generator().manual_seed(0)
    q0 = torch.randint(-126, 127, (9, 11), generator=gen, dtype=torch.int8)
    if how == "rowwise":
        q0[torch.arange(9), torch.randint(0, 11, (9,), generator=gen)] = 127
        scale = 2.0 ** torch.randint(-12, 6, (9,), generator=gen).float()
        x = q0.float() * scale[:, None]
    elif how == "columnwise":
        q0[torch.randint(0, 9, (11,), generator=gen), torch.arange(11)] = -127
        scale = 2.0 ** torch.randint(-12, 6, (11,), generator=gen).float()
        x = q0.float() * scale[None, :]
    else:
        q0[3, 4] = -127
        scale = torch.tensor(2.0**-7)
        x = q0.float() * scale
    quantize = getattr(sb, f"quantize_{how}")
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, q0) and torch.equal(s, scale)  # power-of-two scales: bit exact
    if how == "rowwise":
        assert torch.equal(sb.dequantize_rowwise(q, s), x)
    # Any scale: x / s' = q0 (1 +- 2^-23) still rounds to q0, even if s' is an ulp off s.
    odd = x * 0.7310585
    assert torch.equal(quantize(odd)[0], q0)


@pytest.mark.parametrize("how", ["rowwise", "columnwise", "global"])
def test_the_largest_element_maps_to_127_and_zero_groups_stay_zero(how):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 10, generator=gen)
    if how == "columnwise":
        x[:, 2] = 0
    elif how == "rowwise":
        x[2] = 0
    quantize = getattr(sb, f"quantize_{how}")
    q, s = quantize(x)
    dim = {"rowwise": 1, "columnwise": 0, "global": None}[how]
    if dim is None:
        i = x.abs().argmax()
        assert q.flatten()[i] == 127 * x.flatten()[i].sign()
    else:
        i = x.abs().argmax(dim=dim, keepdim=True)
        nonzero = x.abs().amax(dim=dim, keepdim=True) > 0
        extreme = (127 * x.gather(dim, i).sign()).to(torch.int8)
        assert torch.equal(q.gather(dim, i)[nonzero], extreme[nonzero])
        assert (s == 0).sum() == 1 and torch.isfinite(s).all()
    assert q.abs().max() == 127
    s_b = s if dim is None else s.unsqueeze(dim)
    assert ((x - q.float() * s_b).abs() <= s_b * (0.5 + 2.0**-16)).all()
    assert not torch.isnan(q.float() * s_b).any()


def _ties():
    """Rows of exact half-integer multiples of a power-of-two scale (127 s sets the scale): ties go to even."""
    halves = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -125.5])
    x = halves[None, :] * 2.0 ** torch.tensor([[-3.0], [0.0], [4.0]])
    return x, torch.tensor([127, 0, 2, 2, 0, -2, 126, -126], dtype=torch.int8).expand(3, -1)


def test_ties_round_to_even():
    x, expected = _ties()
    assert torch.equal(sb.quantize_rowwise(x)[0], expected)
    assert torch.equal(sb.quantize_columnwise(x.t())[0], expected.t())


def test_all_zero_input_and_nan_rows():
    zero = torch.zeros(3, 4)
    for quantize in (sb.quantize_rowwise, sb.quantize_columnwise, sb.quantize_global):
        q, s = quantize(zero)
        assert not q.any() and not s.any()
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    q, s = sb.quantize_rowwise(x)
    assert s[1] == float("inf") and torch.isfinite(s[[0, 2]]).all()
    out = sb.int8_matmul_dequant(q, sb.quantize_global(torch.randn(5, 4))[0].t(), s, torch.tensor(0.01))
    assert not torch.isfinite(out[1]).any() and torch.isfinite(out[[0, 2]]).all()


def test_int8_matmul_is_exact_for_extreme_values():
    a = torch.full((3, 1000), -127, dtype=torch.int8)
    b = torch.full((1000, 2), -127, dtype=torch.int8)
    assert (sb.int8_matmul(a, b) == 127 * 127 * 1000).all()
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (7, 13), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (5, 13), generator=gen, dtype=torch.int8)
    assert torch.equal(sb.int8_matmul(a, b.t()), (a.long() @ b.long().t()).int())


def test_the_float32_path_is_exact_past_float32s_integers():
    """Where torch._int_mm is not exact (CPUs without VNNI), the sum is taken by float32 matmuls over chunks of
    K: exact even where one whole sum passes 2^24 (K = 3000 of 128 x 128: 49 million)."""
    a = torch.full((3, 3000), -128, dtype=torch.int8)
    b = torch.full((3000, 2), -128, dtype=torch.int8)
    assert (sb._int8_matmul_in_float32(a, b) == 128 * 128 * 3000).all()
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (9, 2500), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (2500, 7), generator=gen, dtype=torch.int8)
    assert torch.equal(sb._int8_matmul_in_float32(a, b), (a.long() @ b.long()).int())


@pytest.mark.slow  # a process of its own (~14 s with its imports)
def test_on_a_cpu_without_vnni_the_int8_matmul_stays_exact():
    """oneDNN held to AVX2 (an AVX2-only CPU, as many laptops and CI machines): torch._int_mm's sums saturate in
    int16 there, the probe sees it and int8_matmul takes the exact float32 path. (Not ATEN_CPU_CAPABILITY as well:
    inductor's cache, shared by the processes of this machine, would then hold kernels built for AVX2 that
    processes without it reuse, with wrong results, torch 2.14.)"""
    code = (
        "import torch; from bigclip.model import switchback as sb\n"
        "ones = torch.full((32, 64), 127, dtype=torch.int8)\n"
        "assert (torch._int_mm(ones, ones.t()) != 127 * 127 * 64).any()  # the saturation itself\n"
        "assert not sb._cpu_int_mm_is_exact()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "a = torch.randint(-127, 128, (17, 1300), generator=g, dtype=torch.int8)\n"
        "b = torch.randint(-127, 128, (1300, 24), generator=g, dtype=torch.int8)\n"
        "assert torch.equal(sb.int8_matmul(a, b), (a.long() @ b.long()).int())\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --------------------------------------------------------------------------- replacement


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleDict({"qkv": nn.Linear(8, 24), "proj": nn.Linear(8, 8)})
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(8, 32), "fc2": nn.Linear(32, 8)})
        self.text_mlp = nn.Sequential()
        self.text_mlp.add_module("c_fc", nn.Linear(8, 32))
        self.text_mlp.add_module("c_proj", nn.Linear(32, 8, bias=False))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_replace_linears_keeps_parameters_and_state_dict(device):
    with torch.device(device):
        model = nn.ModuleList([_Block(), _Block()])
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert sb.replace_linears(model, "SwitchBackLinearVectorwise", sb.MLP_LINEAR_NAMES) == 8
    assert all(p is params[name] for name, p in model.named_parameters()) and len(params) == 22
    assert list(model.state_dict()) == keys
    assert type(model[1].mlp["fc2"]) is sb.SwitchBackLinearVectorwise
    assert type(model[1].text_mlp.c_proj) is sb.SwitchBackLinearVectorwise
    assert type(model[0].attn["qkv"]) is nn.Linear and type(model[0].attn["proj"]) is nn.Linear
    assert all(p.device.type == device for p in model.parameters())
    # swapping again (another variant) is allowed; a foreign Linear subclass is not
    assert sb.replace_linears(model, "StandardLinear", ("fc1",)) == 2
    assert type(model[0].mlp["fc1"]) is sb.StandardLinear
    # and the swapped layers run (on meta too: shapes only)
    x = torch.randn(3, 8, device=device, requires_grad=True)
    model[0].text_mlp(model[0].mlp["fc2"](model[0].mlp["fc1"](x))).sum().backward()
    assert x.grad.shape == x.shape and model[0].mlp["fc2"].weight.grad.shape == (8, 32)


def test_replace_linears_refuses_unknown_variants_and_foreign_subclasses():
    assert tuple(sb.VARIANT_CLASSES) == sb.VARIANTS
    with pytest.raises(ValueError) as info:
        sb.replace_linears(_Block(), "SwitchBackLinearFoo", sb.MLP_LINEAR_NAMES)
    assert all(name in str(info.value) for name in sb.VARIANTS)

    class Custom(nn.Linear):
        pass

    model = nn.ModuleDict({"fc1": Custom(2, 2)})
    with pytest.raises(TypeError, match="fc1 is a Custom"):
        sb.replace_linears(model, "SwitchBackLinearGlobal", ("fc1",))


def test_bigclip_model_trains_with_switchback_mlps():
    from bigclip.model import create_model, get_tokenizer

    torch.manual_seed(0)
    assert sb.replace_linears(create_model("test-tiny", device="meta"), "SwitchBackLinearGlobal") == 8
    model = create_model("test-tiny")
    assert sb.replace_linears(model, "SwitchBackLinearGlobal", sb.MLP_LINEAR_NAMES) == 8
    images = torch.randn(4, 3, *model.visual.image_size)
    tokens = get_tokenizer("test-tiny")(["a", "b", "c", "d"])
    out = model(images, tokens)
    (out["image_features"] @ out["text_features"].t()).sum().backward()
    assert sb.INT8_MATMULS == {"forward": 8, "input_grad": 8}
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.dim() == 2)


@pytest.mark.slow
def test_a_cpu_run_says_once_that_its_int8_layers_reproduce_the_numerics_not_the_speed(tmp_path):
    """Nothing on CUDA (the GPU kit measures the speed there), nothing for StandardLinear (no int8 in it)."""
    from helpers import TINY_SYNTHETIC

    from bigclip import cli

    flags = ["--epochs", "1", "--use-bnb-linear", "SwitchBackLinearGlobal", "--logs", str(tmp_path), "--name", "int8"]
    assert cli.main([*TINY_SYNTHETIC, *flags]) == 0
    log = open(tmp_path / "int8" / "out.log").read()
    said = "--use-bnb-linear SwitchBackLinearGlobal on cpu: the int8 layers reproduce SwitchBack's numerics, not its"
    assert log.count(said) == 1, log[-3000:]
    assert sb.speed_note("SwitchBackLinearVectorwise", torch.device("cpu")).startswith("--use-bnb-linear")
    assert sb.speed_note("SwitchBackLinearGlobal", torch.device("cuda")) is None
    assert sb.speed_note("StandardLinear", torch.device("cpu")) is None


# --------------------------------------------------------------------------- counting and autocast


@pytest.mark.parametrize("variant", sb.VARIANTS)
def test_int8_matmuls_per_step(variant):
    layer = _layer(variant, 13, 5)
    x, grad = _inputs((7, 13), 5)
    _run(layer, x, grad)
    expected = {} if variant == "StandardLinear" else {"forward": 1, "input_grad": 1}
    assert dict(sb.INT8_MATMULS) == expected
    sb.reset_int8_matmuls()
    assert sum(sb.INT8_MATMULS.values()) == 0


@pytest.mark.parametrize("variant", sb.VARIANTS)
def test_autocast_bf16_on_cpu(variant):
    layer = _layer(variant, 13, 5)
    x, grad = _inputs((3, 7, 13), 5)
    xa = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xa)
    assert y.dtype == torch.bfloat16
    y.backward(grad.bfloat16())
    assert xa.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    got = (y.detach(), xa.grad, layer.weight.grad, layer.bias.grad)

    # the same as feeding the bf16 casts by hand: quantized from the autocast dtype, computed in it
    xb = x.bfloat16().requires_grad_(True)
    wb = layer.weight.detach().bfloat16().requires_grad_(True)
    bb = layer.bias.detach().bfloat16().requires_grad_(True)
    if variant == "StandardLinear":
        yb = sb._StandardLinearFunction.apply(xb, wb, bb)
    else:
        yb = sb._SwitchBackFunction.apply(xb, wb, bb, layer.scheme)
    yb.backward(grad.bfloat16())
    for a, b in zip(got, (yb.detach(), xb.grad.float(), wb.grad.float(), bb.grad.float())):
        assert torch.equal(a, b)
    # within the bound for the bf16 inputs, plus bf16 roundings (2^-9 relative each): the output's, and for
    # StandardLinear the matmul's and the bias add's, so 2^-8 of the magnitude of the terms
    x2, w, b = xb.detach().reshape(-1, 13), wb.detach(), bb.detach()
    ref = F.linear(x2.double(), w.double(), b.double())
    bound = _forward_bound(variant, x2, w, b)
    magnitude = x2.double().abs() @ w.double().abs().t() + b.double().abs() + bound
    _assert_within(y.reshape(-1, 5), ref, bound + 2.0**-8 * magnitude, "bf16 forward")
    with torch.no_grad():
        assert layer(x).dtype == torch.float32  # autocast off again: float32


# --------------------------------------------------------------------------- Triton (interpreted)


def _run_group(group: str, interpret: bool):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), group], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"group {group!r} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert f"ok {group}" in proc.stdout


@pytest.mark.slow
def test_triton_kernels_match_the_torch_path():
    _run_group("triton", interpret=True)


@pytest.mark.slow
def test_triton_kernels_compile_for_cuda():
    # No GPU here, but Triton compiles to sm_80/sm_90 without one: this catches what the interpreter accepts
    # and the compiler does not (int8 dots, shapes), and checks the divisions stay correctly rounded.
    _run_group("cuda_compile", interpret=False)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two 16- or 32-bit float tensors of one dtype."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    top = -(2 ** (8 * a.element_size() - 1))

    def ordered(t):
        i = t.view(bits).long()
        return torch.where(i < 0, top - i, i)

    return (ordered(a) - ordered(b)).abs()


def _check_triton() -> None:
    import bigclip.model.switchback_triton as tri

    gen = torch.Generator().manual_seed(0)
    # quantizers: bit for bit, across the block edges (rows 8, columns 512 / 64, flat 4096)
    x, expected = _ties()
    assert torch.equal(tri.quantize_rowwise(x)[0], expected)
    assert torch.equal(tri.quantize_columnwise(x.t())[0], expected.t())
    for shape in [(7, 13), (1, 1), (33, 70), (130, 600), (70, 59)]:  # 70 x 59: two flat blocks of 4096
        for dtype in (torch.float32, torch.bfloat16, torch.float16) if shape == (33, 70) else (torch.float32,):
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            x[0] = 0
            if shape[1] > 3:
                x[-1, 3] = float("nan")
            for name in ("quantize_rowwise", "quantize_columnwise", "quantize_global"):
                for arg in (x, x.t()):
                    q_t, s_t = getattr(tri, name)(arg)
                    q_c, s_c = getattr(sb, name)(arg)
                    assert torch.equal(q_t, q_c) and torch.equal(s_t, s_c), (name, shape, dtype)
    big = torch.randn(70, 4097, generator=gen)
    big[69, 4096] = 50.0  # the absmax in the last flat block
    for t, c in zip(tri.quantize_global(big), sb.quantize_global(big)):
        assert torch.equal(t, c)
    # rows held in registers (up to ONE_PASS_MAX) and longer rows (two passes), the edge on both sides
    for cols in (tri.ONE_PASS_MAX, tri.ONE_PASS_MAX + 1, 1280):
        x = torch.randn(3, cols, generator=gen, dtype=torch.bfloat16)
        for t, c in zip(tri.quantize_rowwise(x), sb.quantize_rowwise(x)):
            assert torch.equal(t, c), cols
    # the weight's pairs: q and a contiguous q^T from one pass, equal to the torch path's (views there)
    for shape in [(7, 13), (70, 130), (1, 1), (0, 5)]:
        w = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
        q_t, qt_t, s_t = tri.quantize_global_pair(w)
        q_c, qt_c, s_c = sb.quantize_global_pair(w)
        assert torch.equal(q_t, q_c) and torch.equal(qt_t, qt_c) and torch.equal(s_t, s_c), shape
        assert qt_t.is_contiguous() and qt_t.shape == shape[::-1]
        assert tri.quantize_global_pair(w, transposed=False)[1] is None
        qt_t, s_t = tri.quantize_columnwise_transposed(w)
        qt_c, s_c = sb.quantize_columnwise_transposed(w)
        assert torch.equal(qt_t, qt_c) and torch.equal(s_t, s_c) and qt_t.is_contiguous(), shape

    # int8 matmuls: int32 accumulators equal; dequantised float32 equal, bf16/fp16 within 1 ulp
    for m, k, n in [(7, 13, 5), (1, 1, 1), (65, 130, 70), (3, 200, 129), (70, 128, 9)]:  # 128: EVEN_K
        a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        for b in (w.t(), w.t().contiguous()):
            assert torch.equal(tri.int8_matmul(a, b), sb.int8_matmul(a, b))
            a_scale = torch.rand(m, generator=gen) / 100
            bias = torch.randn(n, generator=gen)
            for b_scale in (torch.tensor(0.013), torch.rand(n, generator=gen) / 100):
                for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                    for bb in (None, bias) if out_dtype == torch.float32 else (bias.to(out_dtype),):
                        t = tri.int8_matmul_dequant(a, b, a_scale, b_scale, bb, out_dtype)
                        c = sb.int8_matmul_dequant(a, b, a_scale, b_scale, bb, out_dtype)
                        assert t.dtype == c.dtype == out_dtype
                        assert _ulps(t, c).max() <= (0 if out_dtype == torch.float32 else 1), (m, k, n, out_dtype)
        for out_dtype in (torch.float32, torch.bfloat16):
            scale = torch.rand(m, generator=gen)
            t, c = tri.dequantize_rowwise(a, scale, out_dtype), sb.dequantize_rowwise(a, scale, out_dtype)
            assert _ulps(t, c).max() <= (0 if out_dtype == torch.float32 else 1)
    extreme = torch.full((2, 300), -127, dtype=torch.int8)
    assert (tri.int8_matmul(extreme, extreme.t()) == 127 * 127 * 300).all()

    # whole layers: the Triton kernels in place of the torch ones give the same outputs and gradients
    for variant in sb.VARIANTS:
        for shape, n_out in [((2, 7, 13), 5), ((65, 130), 70)]:
            layer = _layer(variant, shape[-1], n_out)
            x, grad = _inputs(shape, n_out)
            torch_path = _run(layer, x, grad)
            original, sb._ops_for = sb._ops_for, lambda t: tri
            try:
                triton_path = _run(layer, x, grad)
            finally:
                sb._ops_for = original
            for t, c in zip(triton_path, torch_path):
                assert torch.equal(t, c), (variant, shape)


def _compile_for_cuda() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import bigclip.model.switchback_triton as tri

    def compile_kernel(kernel, pointers: dict, constexprs: dict, arch: int, **options):
        signature = {}
        for name in kernel.arg_names:
            signature[name] = "constexpr" if name in constexprs else pointers.get(name, "i32")
        source = ASTSource(kernel, signature, constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        assert compiled.metadata.shared <= 200 * 1024, (kernel.__name__, compiled.metadata.shared)
        return compiled.asm["ptx"]

    matmul_pointers = dict(a_ptr="*i8", b_ptr="*i8", a_scale_ptr="*fp32", b_scale_ptr="*fp32", bias_ptr="*fp32")
    for arch in (80, 90):
        for dequantize, per_column, bias in [(False, False, False), (True, False, True), (True, True, False)]:
            flags = dict(DEQUANTIZE=dequantize, B_SCALE_PER_COLUMN=per_column, HAS_BIAS=bias, **tri.MATMUL)
            pointers = dict(matmul_pointers, c_ptr="*bf16" if dequantize else "*i32")
            for even_k in (False, True):
                compile_kernel(tri._int8_matmul_kernel, pointers, dict(flags, EVEN_K=even_k), arch)
        for x_type in ("*fp32", "*bf16"):
            pointers = dict(x_ptr=x_type, q_ptr="*i8", scale_ptr="*fp32")
            for one_pass, blocks in [(False, tri.QUANTIZE_ROWS), (True, dict(BLOCK_R=4, BLOCK_C=2048))]:
                ptx = compile_kernel(tri._quantize_rows_kernel, pointers, dict(blocks, ONE_PASS=one_pass), arch)
                assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
            pointers = dict(x_ptr=x_type, absmax_ptr="*fp32", q_ptr="*i8", scale_ptr="*fp32")
            compile_kernel(tri._quantize_global_kernel, pointers, dict(BLOCK=tri.FLAT_BLOCK), arch)
            pointers.update(qt_ptr="*i8")
            compile_kernel(tri._quantize_global_pair_kernel, pointers, dict(tri.PAIR_TILE, WRITE_T=True), arch)
    # every tile the GPU autotunes over compiles for Hopper within its shared memory
    for config in tri.MATMUL_CONFIGS:
        flags = dict(DEQUANTIZE=True, B_SCALE_PER_COLUMN=False, HAS_BIAS=True, EVEN_K=True, **config.kwargs)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        compile_kernel(tri._int8_matmul_kernel, dict(matmul_pointers, c_ptr="*bf16"), flags, 90, **options)
        compile_kernel(tri._absmax_blocks_kernel, dict(x_ptr="*bf16", out_ptr="*fp32"), dict(BLOCK=tri.FLAT_BLOCK), 90)
        pointers = dict(q_ptr="*i8", scale_ptr="*fp32", out_ptr="*bf16")
        compile_kernel(tri._dequantize_rows_kernel, pointers, tri.DEQUANTIZE_ROWS, arch)


def main(group: str) -> int:
    torch.set_num_threads(1)
    if group == "cuda_compile":
        _compile_for_cuda()
    elif group == "triton":
        assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, which sets TRITON_INTERPRET=1"
        _check_triton()
    else:
        raise SystemExit(f"unknown group {group!r}")
    print(f"ok {group}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
