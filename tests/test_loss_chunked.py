"""The chunked (tiled torch) losses against the float64 reference, and their memory bound."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loss_reference import assert_matches, loss_and_grads, natural_sizes, reference, unit_features
from torch.utils._python_dispatch import TorchDispatchMode

import bigclip.loss.chunked as chunked
from bigclip.loss import ClipLoss, SigLipLoss

DIMS = st.one_of(st.integers(1, 40), st.sampled_from([512, 768, 1024, 1280, 1023]))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 70),
    dim=DIMS,
    tile=st.integers(3, 48),
    log_scale=st.floats(-1.0, 4.6),  # logit_scale from 0.37 to OpenCLIP's cap of 100
    bias=st.floats(-15.0, 5.0),
    siglip=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
    grad_output=st.sampled_from([1.0, 0.25, -2.0]),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_reference(n, dim, tile, log_scale, bias, siglip, dtype, grad_output, seed):
    with tile_size(tile):
        check_chunked(n, dim, tile, log_scale, bias, siglip, dtype, grad_output, seed)


@contextlib.contextmanager
def tile_size(tile: int):
    saved, chunked.TILE = chunked.TILE, tile
    try:
        yield
    finally:
        chunked.TILE = saved


def check_chunked(n, dim, tile, log_scale, bias, siglip, dtype, grad_output, seed):
    image, text = unit_features(n, dim, seed, dtype)
    scale = torch.tensor(log_scale).exp().reshape(1)
    bias_t = torch.tensor([bias]) if siglip else None
    module = SigLipLoss(impl="chunked") if siglip else ClipLoss(impl="chunked")
    got = loss_and_grads(module, image, text, scale, bias_t, grad_output)
    ref_loss, ref_grads = reference(siglip, image, text, scale, bias_t)
    ref = (ref_loss, [g * grad_output for g in ref_grads])
    assert_matches(
        got,
        ref,
        dtype,
        what=f"n={n} dim={dim} tile={tile} scale={scale.item():.3g} {dtype}",
        natural=natural_sizes(n, scale.item(), grad_output),
    )


@pytest.mark.parametrize("siglip", [False, True])
def test_only_requested_gradients_are_computed(siglip):
    image, text = unit_features(20, 8, seed=5)
    image.requires_grad_()
    scale = torch.tensor(10.0)
    bias = torch.tensor(-5.0) if siglip else None
    module = SigLipLoss(impl="chunked") if siglip else ClipLoss(impl="chunked")
    module(image, text, scale, bias).backward()
    ref_image = image.detach().double().requires_grad_()
    naive = SigLipLoss(impl="naive") if siglip else ClipLoss(impl="naive")
    naive(ref_image, text.double(), scale.double(), None if bias is None else bias.double()).backward()
    tolerance = 1e-5 * ref_image.grad.abs().max().item()
    torch.testing.assert_close(image.grad.double(), ref_image.grad, rtol=0, atol=tolerance)
    assert text.grad is None


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any floating-point tensor an operator returns.

    (Integer tensors are left out: the Triton interpreter copies kernel arguments through uint8
    views of their storage, which are not allocations of the loss.)
    """

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def largest_tensor_in_forward_backward(module, n: int, dim: int, bias: bool) -> int:
    image, text = (t.requires_grad_() for t in unit_features(n, dim, seed=0))
    scale = torch.tensor(10.0, requires_grad=True)
    logit_bias = torch.tensor(-5.0, requires_grad=True) if bias else None
    with LargestTensor() as probe:
        module(image, text, scale, logit_bias).backward()
    return probe.largest


def test_probe_sees_the_naive_logit_matrix():
    assert largest_tensor_in_forward_backward(ClipLoss(impl="naive"), 300, 8, bias=False) == 300 * 300


@pytest.mark.slow
@pytest.mark.parametrize("siglip", [False, True])
def test_no_n_by_n_tensor_in_chunked_path(siglip, monkeypatch):
    # Every tensor any operator creates during forward + backward at N = 8192 is at most one
    # 1024 x 1024 tile: 1/64 of the N x N logit matrix the naive path needs.
    monkeypatch.setattr(chunked, "TILE", 1024)
    n = 8192
    module = SigLipLoss(impl="chunked") if siglip else ClipLoss(impl="chunked")
    largest = largest_tensor_in_forward_backward(module, n, 32, bias=siglip)
    assert largest <= 1024 * 1024, f"a tensor of {largest} elements appeared (N^2 = {n * n})"


@pytest.mark.parametrize("siglip", [False, True])
def test_autocast_does_not_lower_the_precision(siglip):
    # A training step under bf16 autocast must not turn the fp32 tile matmuls into bf16 ones.
    image, text = unit_features(50, 30, seed=6)
    scale = torch.tensor(10.0)
    bias = torch.tensor(-3.0) if siglip else None
    module = SigLipLoss(impl="chunked") if siglip else ClipLoss(impl="chunked")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(module, image, text, scale, bias)
    assert_matches(got, reference(siglip, image, text, scale, bias), natural=natural_sizes(50, 10.0))
