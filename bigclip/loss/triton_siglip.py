"""Fused Triton kernels for the SigLIP loss: the SigLIP primitives of `bigclip.loss.chunked`, fused.

Forward: a grid over logit tiles; each tile writes three partial sums (loss, dz * x, dz) to its
own slot of a small per-tile buffer that torch adds up in float64 (deterministic, no atomics).
Backward: the same tiles recomputed, dz multiplied into the feature gradients with float32
atomics (shared with the CLIP kernels, including the bf16 hi/lo split).

log(1 + e) is computed as log(u) * e / (u - 1) with u = 1 + e (exact to a few ulps where a plain
log(1 + e) loses every digit for small e); libdevice's log1p does not run in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bigclip.loss.triton_tiles import Block, accumulate_feature_grads, logits_tile


@triton.jit
def _log1p_small(e):
    u = 1.0 + e
    d = u - 1.0
    return tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _siglip_tile(
    img_ptr,
    txt_ptr,
    scale_ptr,
    bias_ptr,
    rows,
    cols,
    M,
    N,
    D,
    stride_img,
    stride_txt,
    diag,
    HAS_BIAS: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(x, z, positive, valid) for one tile: z = scale * x + bias."""
    x = logits_tile(img_ptr, txt_ptr, rows, cols, D, stride_img, stride_txt, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, M, N)
    z = x * tl.load(scale_ptr)
    if HAS_BIAS:
        z = z + tl.load(bias_ptr)
    valid = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_DIAG:
        positive = (cols[None, :] == rows[:, None] + diag) & valid
    else:
        positive = valid & (rows[:, None] < 0)  # no positives in this block
    return x, z, positive, valid


@triton.jit
def _siglip_sums_kernel(
    img_ptr,
    txt_ptr,
    scale_ptr,
    bias_ptr,
    sums_ptr,
    M,
    N,
    D,
    stride_img,
    stride_txt,
    diag,
    HAS_BIAS: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x, z, positive, valid = _siglip_tile(
        img_ptr,
        txt_ptr,
        scale_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        D,
        stride_img,
        stride_txt,
        diag,
        HAS_BIAS,
        HAS_DIAG,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        UPCAST,
    )
    # -log sigmoid(y z) = softplus(-y z); softplus(t) = max(t, 0) + log(1 + exp(-|t|))
    t = tl.where(positive, -z, z)
    loss = tl.maximum(t, 0.0) + _log1p_small(tl.exp(-tl.abs(t)))
    # dloss/dz = sigmoid(z) - [positive], with a sigmoid that never overflows
    e = tl.exp(-tl.abs(z))
    sig = tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    dz = sig - tl.where(positive, 1.0, 0.0)
    loss = tl.where(valid, loss, 0.0)
    dz = tl.where(valid, dz, 0.0)
    slot = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 3
    tl.store(sums_ptr + slot, tl.sum(tl.sum(loss, 1), 0))
    tl.store(sums_ptr + slot + 1, tl.sum(tl.sum(dz * x, 1), 0))
    tl.store(sums_ptr + slot + 2, tl.sum(tl.sum(dz, 1), 0))


@triton.jit
def _siglip_grads_kernel(
    img_ptr,
    txt_ptr,
    scale_ptr,
    bias_ptr,
    coef_ptr,
    d_img_ptr,
    d_txt_ptr,
    M,
    N,
    D,
    stride_img,
    stride_txt,
    diag,
    HAS_BIAS: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    NEED_IMG: tl.constexpr,
    NEED_TXT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x, z, positive, valid = _siglip_tile(
        img_ptr,
        txt_ptr,
        scale_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        D,
        stride_img,
        stride_txt,
        diag,
        HAS_BIAS,
        HAS_DIAG,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        UPCAST,
    )
    e = tl.exp(-tl.abs(z))
    sig = tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    dz = tl.where(valid, sig - tl.where(positive, 1.0, 0.0), 0.0)
    g = dz * (tl.load(coef_ptr) * tl.load(scale_ptr))
    accumulate_feature_grads(
        g,
        g,
        img_ptr,
        txt_ptr,
        d_img_ptr,
        d_txt_ptr,
        rows,
        cols,
        D,
        stride_img,
        stride_txt,
        M,
        N,
        NEED_IMG,
        NEED_TXT,
        SPLIT_BF16,
        UPCAST,
        BLOCK_D,
    )


def _bias_ptr(scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bias as a kernel pointer; without a bias, any valid pointer (HAS_BIAS=False never reads it)."""
    return scale.reshape(1) if bias is None else bias.reshape(1)


def siglip_block_sums(image, text, scale, bias, diag, tile: int | None = None) -> torch.Tensor:
    """See `bigclip.loss.chunked.siglip_block_sums`; `tile` is accepted for the same signature."""
    block = Block(image, text)
    rows, cols = block.tile_grid()
    partial = torch.empty(rows * cols * 3, device=image.device)
    block.launch_tiles(_siglip_sums_kernel, scale, (_bias_ptr(scale, bias), partial), diag, HAS_BIAS=bias is not None)
    return partial.view(-1, 3).double().sum(0)


def siglip_block_grads(
    image,
    text,
    scale,
    bias,
    diag,
    coef,
    need_image: bool = True,
    need_text: bool = True,
    tile: int | None = None,
):
    """See `bigclip.loss.chunked.siglip_block_grads`; `tile` is accepted for the same signature."""
    return Block(image, text).feature_grads(
        _siglip_grads_kernel,
        scale,
        (_bias_ptr(scale, bias), coef.float().reshape(1)),
        diag,
        need_image,
        need_text,
        HAS_BIAS=bias is not None,
    )
