"""The float64 references the loss tests compare against, and checks of those references.

Other test_loss_* modules import the helpers below. The references are OpenCLIP's formulas
evaluated in float64 on materialised logits; this module checks them once more against
formulas written a second way (explicit log-sum-exp and log1p sums).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import loss_for

from bigclip.errors import UserError
from bigclip.loss import (
    CLIP_DIST_IMPLS,
    LOSS_IMPLS,
    SIGLIP_DIST_IMPLS,
    ClipLoss,
    SigLipLoss,
)
from bigclip.loss.clip import clip_loss_naive

# Bounds stated in docs and asserted everywhere (max-norm, relative to the reference's max):
# fp32 features: loss and every gradient within 1e-5.
# bf16 / fp16 features (fp32 accumulation): the loss within 1e-5; feature gradients differ from the
# float64 reference by at most the final rounding to the feature dtype (2^-8 resp. 2^-11 of each
# element) plus 1e-5 of the largest element; scale / bias gradients (fp32) within 1e-5.
RTOL = 1e-5
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def unit_features(n: int, dim: int, seed: int, dtype=torch.float32):
    """L2-normalised (image, text) features, made in float64 and rounded to dtype."""
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, dim, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    # Texts correlated with their images, as in training, so positives are not just noise.
    text = F.normalize(image.double() + 0.7 * torch.randn(n, dim, generator=g, dtype=torch.float64), dim=-1)
    return image, text.to(dtype)


def loss_and_grads(loss_module, image, text, scale, bias=None, grad_output: float = 1.0):
    """Loss value and gradients for image, text, scale (and bias) as float64 tensors."""
    inputs = [image.clone().requires_grad_(), text.clone().requires_grad_(), scale.clone().requires_grad_()]
    if bias is not None:
        inputs.append(bias.clone().requires_grad_())
    loss = loss_module(*inputs[:3], inputs[3] if bias is not None else None)
    (loss * grad_output).backward()
    return loss.detach().double(), [t.grad.double() for t in inputs]


def reference(siglip: bool, image, text, scale, bias=None):
    """The naive (OpenCLIP) loss on float64 copies of the inputs."""
    loss = loss_for(siglip, False, False, "naive", None, 0, 1)
    return loss_and_grads(loss, image.double(), text.double(), scale.double(), None if bias is None else bias.double())


def natural_sizes(n: int, scale: float, grad_output: float = 1.0):
    """Typical magnitudes of (loss, feature gradient, scale / bias gradient).

    Tolerances are relative to the larger of the reference and these, so a reference that is
    exactly zero (one pair, or one-dimensional features) is not held to zero error.
    """
    g = abs(grad_output)
    return 1.0, g * max(scale, 1.0) / n, g


def assert_matches(got, ref, feature_dtype=torch.float32, rtol: float = RTOL, what: str = "", natural=(0.0, 0.0, 0.0)):
    loss, grads = got
    ref_loss, ref_grads = ref
    loss_size, feature_size, scalar_size = natural
    assert abs(loss.item() - ref_loss.item()) <= rtol * max(abs(ref_loss.item()), loss_size), (
        f"{what} loss {loss.item()!r} vs reference {ref_loss.item()!r}"
    )
    names = ["image", "text", "scale", "bias"]
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        rounding = ROUNDING[feature_dtype] if i < 2 else 0.0
        size = max(r.abs().max().item(), feature_size if i < 2 else scalar_size)
        bound = rounding * r.abs() + rtol * size
        excess = ((g - r).abs() - bound).max().item()
        assert excess <= 0, (
            f"{what} d{names[i]}: max error {(g - r).abs().max().item():.3e} exceeds the bound "
            f"(reference max {r.abs().max().item():.3e})"
        )


# ------------------------------------------------------------------------------ checks


def test_public_names():
    assert LOSS_IMPLS == ("auto", "naive", "chunked", "fused", "triton")
    assert CLIP_DIST_IMPLS == ("gather", "ring")
    assert SIGLIP_DIST_IMPLS == ("bidir", "shift", "reduce", "gather")
    assert isinstance(loss_for(False, True, True, "auto", None, 0, 1), ClipLoss)
    siglip = loss_for(True, False, False, "chunked", None, 0, 1)
    assert isinstance(siglip, SigLipLoss) and siglip.dist_impl == "bidir"
    assert loss_for(False, False, False, "naive", None, 0, 1).dist_impl == "gather"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(siglip=False, impl="fast", dist_impl=None), ["--loss-impl", "'fast'", "chunked"]),
        (dict(siglip=False, impl="auto", dist_impl="bidir"), ["--loss-dist-impl", "'bidir'", "gather, ring"]),
        (dict(siglip=True, impl="auto", dist_impl="ring"), ["--loss-dist-impl", "'ring'", "--siglip"]),
    ],
)
def test_bad_flag_values_are_one_clear_line(kwargs, words):
    with pytest.raises(UserError) as err:
        loss_for(local_loss=False, gather_with_grad=False, rank=0, world_size=1, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_triton_on_cpu_without_interpreter_is_a_user_error(monkeypatch, impl):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    image, text = unit_features(8, 4, seed=0)
    for siglip in (False, True):
        with pytest.raises(UserError, match=f"--loss-impl {impl} needs CUDA tensors"):
            loss_for(siglip, False, False, impl, None, 0, 1)(image, text, torch.tensor(10.0))


@pytest.mark.parametrize("impl", ["naive", "chunked", "triton"])
def test_fast_precision_is_refused_where_it_would_do_nothing(impl):
    from bigclip.loss import LossConfig, check_loss

    with pytest.raises(UserError) as err:
        check_loss(LossConfig(loss_impl=impl, loss_precision="fast"))
    assert "\n" not in str(err.value)
    assert "--loss-precision fast" in str(err.value) and "--loss-impl fused" in str(err.value)
    check_loss(LossConfig(loss_impl="fused", loss_precision="fast"))
    check_loss(LossConfig(loss_impl="auto", loss_precision="fast"))
    with pytest.raises(UserError, match="--loss-precision 'tf32': choose one of exact, fast"):
        check_loss(LossConfig(loss_impl="fused", loss_precision="tf32"))


def test_auto_is_chunked_on_cpu():
    from bigclip.loss.select import resolve_impl

    assert resolve_impl("auto", torch.zeros(2, 2)) == "chunked"


def test_clip_reference_is_the_symmetric_cross_entropy():
    image, text = unit_features(9, 5, seed=1, dtype=torch.float64)
    scale = 7.5
    logits = [[scale * sum(a * b for a, b in zip(i, t)) for t in text.tolist()] for i in image.tolist()]

    def ce(rows):
        return sum(math.log(sum(math.exp(v) for v in row)) - row[k] for k, row in enumerate(rows)) / len(rows)

    columns = [list(c) for c in zip(*logits)]
    expected = (ce(logits) + ce(columns)) / 2
    got = clip_loss_naive(image, text, torch.tensor(scale, dtype=torch.float64))
    assert abs(got.item() - expected) < 1e-12


def test_siglip_reference_is_the_pairwise_sigmoid_loss():
    image, text = unit_features(7, 3, seed=2, dtype=torch.float64)
    scale, bias = 12.0, -4.0
    total = 0.0
    for i, a in enumerate(image.tolist()):
        for j, b in enumerate(text.tolist()):
            z = scale * sum(p * q for p, q in zip(a, b)) + bias
            y = 1.0 if i == j else -1.0
            total += math.log1p(math.exp(-y * z))
    as_tensor = functools.partial(torch.tensor, dtype=torch.float64)
    got = SigLipLoss(impl="naive")(image, text, as_tensor(scale), as_tensor(bias))
    assert abs(got.item() - total / 7) < 1e-12


def test_clip_bias_gets_an_exact_zero_gradient():
    image, text = unit_features(12, 6, seed=3)
    bias = torch.tensor([-3.0], requires_grad=True)
    for impl in ("naive", "chunked"):
        bias.grad = None
        plain = ClipLoss(impl=impl)(image, text, torch.tensor(10.0))
        with_bias = ClipLoss(impl=impl)(image, text, torch.tensor(10.0), bias)
        with_bias.backward()
        assert with_bias.item() == plain.item()
        assert bias.grad is not None and bias.grad.abs().max().item() == 0.0
