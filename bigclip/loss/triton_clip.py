"""Fused Triton kernels for the CLIP loss: the CLIP primitives of `bigclip.loss.chunked`, fused.

Forward (`clip_block_stats`): one pass over the logit tiles gives both directions: per-row
log-sum-exp and softmax-weighted mean of the unscaled logit (online, in registers), and the same
per column. Column statistics need a reduction over row blocks; each program owns a private row
of a (programs x N) float32 workspace that it updates tile by tile (no atomics, deterministic),
and the launcher folds the few program rows together. The number of programs is capped, so the
workspace is O(N), never O(N^2).

Backward (`clip_block_grads`): a grid over tiles; each tile is recomputed from the features and
the saved statistics, turned into dL/dlogits and multiplied into the image and text gradients,
accumulated with float32 atomics. Precision rules: `bigclip.loss.triton_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bigclip.loss.triton_tiles import Block, accumulate_feature_grads, logits_tile, max_programs


@triton.jit
def _clip_stats_kernel(
    img_ptr,
    txt_ptr,
    scale_ptr,
    row_lse_ptr,
    row_mean_ptr,
    ws_lse_ptr,
    ws_mean_ptr,
    M,
    N,
    D,
    stride_img,
    stride_txt,
    row_blocks_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    scale = tl.load(scale_ptr)
    neg_inf = float("-inf")
    for t in range(0, row_blocks_per_program):
        rows = (pid * row_blocks_per_program + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        m_row = tl.full((BLOCK_M,), neg_inf, tl.float32)
        l_row = tl.zeros((BLOCK_M,), tl.float32)
        u_row = tl.zeros((BLOCK_M,), tl.float32)
        for c0 in range(0, N, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            x = logits_tile(
                img_ptr, txt_ptr, rows, cols, D, stride_img, stride_txt, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, M, N
            )
            s = x * scale
            # rows: online softmax statistics over the column tiles
            s_row = tl.where(col_ok[None, :], s, neg_inf)
            m_new = tl.maximum(m_row, tl.max(s_row, 1))
            m_safe = tl.where(row_ok, m_new, 0.0)  # padded rows are never stored; keep them finite
            rescale = tl.exp(m_row - m_safe)
            p = tl.exp(s_row - m_safe[:, None])
            l_row = l_row * rescale + tl.sum(p, 1)
            u_row = u_row * rescale + tl.sum(p * x, 1)
            m_row = m_new
            # columns: this tile's statistics, folded into the program's private workspace row
            s_col = tl.where(row_ok[:, None], s, neg_inf)
            m_col = tl.max(s_col, 0)
            m_col = tl.where(col_ok, m_col, 0.0)
            q = tl.exp(s_col - m_col[None, :])
            l_col = tl.sum(q, 0)
            l_col = tl.where(col_ok, l_col, 1.0)
            lse_tile = m_col + tl.log(l_col)
            mean_tile = tl.sum(q * x, 0) / l_col
            ws = pid * N + cols
            lse_old = tl.load(ws_lse_ptr + ws, mask=col_ok, other=0.0)
            mean_old = tl.load(ws_mean_ptr + ws, mask=col_ok, other=0.0)
            top = tl.maximum(lse_old, lse_tile)
            w_old = tl.exp(lse_old - top)
            w_tile = tl.exp(lse_tile - top)
            total = w_old + w_tile
            tl.store(ws_lse_ptr + ws, top + tl.log(total), mask=col_ok)
            tl.store(ws_mean_ptr + ws, (mean_old * w_old + mean_tile * w_tile) / total, mask=col_ok)
            tl.debug_barrier()  # the next tile of this program reads what was just stored
        l_safe = tl.where(row_ok, l_row, 1.0)
        tl.store(row_lse_ptr + rows, m_row + tl.log(l_safe), mask=row_ok)
        tl.store(row_mean_ptr + rows, u_row / l_safe, mask=row_ok)


@triton.jit
def _clip_grads_kernel(
    img_ptr,
    txt_ptr,
    scale_ptr,
    row_lse_ptr,
    col_lse_ptr,
    a_img_ptr,
    b_img_ptr,
    a_txt_ptr,
    b_txt_ptr,
    d_img_ptr,
    d_txt_ptr,
    M,
    N,
    D,
    stride_img,
    stride_txt,
    diag,
    HAS_DIAG: tl.constexpr,
    SAME_WEIGHTS: tl.constexpr,
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
    row_ok = rows < M
    col_ok = cols < N
    valid = row_ok[:, None] & col_ok[None, :]
    scale = tl.load(scale_ptr)
    x = logits_tile(img_ptr, txt_ptr, rows, cols, D, stride_img, stride_txt, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, M, N)
    s = x * scale
    row_lse = tl.load(row_lse_ptr + rows, mask=row_ok, other=0.0)
    col_lse = tl.load(col_lse_ptr + cols, mask=col_ok, other=0.0)
    p_row = tl.where(valid, tl.exp(s - row_lse[:, None]), 0.0)
    p_col = tl.where(valid, tl.exp(s - col_lse[None, :]), 0.0)
    if HAS_DIAG:
        positive = (cols[None, :] == rows[:, None] + diag) & valid
    a = tl.load(a_img_ptr + cols, mask=col_ok, other=0.0)
    b = tl.load(b_img_ptr + cols, mask=col_ok, other=0.0)
    g_img = a[None, :] * p_row + b[None, :] * p_col
    if HAS_DIAG:
        g_img = g_img - tl.where(positive, (a + b)[None, :], 0.0)
    g_img = g_img * scale
    if SAME_WEIGHTS:
        g_txt = g_img
    else:
        a = tl.load(a_txt_ptr + cols, mask=col_ok, other=0.0)
        b = tl.load(b_txt_ptr + cols, mask=col_ok, other=0.0)
        g_txt = a[None, :] * p_row + b[None, :] * p_col
        if HAS_DIAG:
            g_txt = g_txt - tl.where(positive, (a + b)[None, :], 0.0)
        g_txt = g_txt * scale
    accumulate_feature_grads(
        g_img,
        g_txt,
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


# ------------------------------------------------------------------------------ launchers


def clip_block_stats(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, tile: int | None = None):
    """See `bigclip.loss.chunked.clip_block_stats`; `tile` is accepted for the same signature."""
    block = Block(image, text)
    m, n, dev = block.m, block.n, image.device
    row_blocks = triton.cdiv(m, block.config["BLOCK_M"])
    per_program = triton.cdiv(row_blocks, max_programs(dev))
    programs = triton.cdiv(row_blocks, per_program)
    row_lse = torch.empty(m, device=dev)
    row_mean = torch.empty(m, device=dev)
    ws_lse = torch.full((programs, n), float("-inf"), device=dev)
    ws_mean = torch.zeros((programs, n), device=dev)
    block.launch(_clip_stats_kernel, (programs,), scale, (row_lse, row_mean, ws_lse, ws_mean), (per_program,))
    col_lse = torch.logsumexp(ws_lse, 0)
    col_mean = (ws_mean * torch.exp(ws_lse - col_lse)).sum(0)
    return row_lse, row_mean, col_lse, col_mean


def _per_column(w: torch.Tensor, n: int) -> torch.Tensor:
    """The kernel reads a weight per column through a pointer: a real float32 (n,) buffer, not a view."""
    return w.float().expand(n).contiguous()


def clip_block_grads(
    image,
    text,
    scale,
    row_lse,
    col_lse,
    weights_image,
    weights_text,
    diag,
    need_image: bool = True,
    need_text: bool = True,
    tile: int | None = None,
):
    """See `bigclip.loss.chunked.clip_block_grads`; `tile` is accepted for the same signature."""
    n = text.shape[0]
    a_img, b_img = (_per_column(w, n) for w in weights_image)
    a_txt, b_txt = (a_img, b_img) if weights_text is None else (_per_column(w, n) for w in weights_text)
    return Block(image, text).feature_grads(
        _clip_grads_kernel,
        scale,
        (row_lse.contiguous(), col_lse.contiguous(), a_img, b_img, a_txt, b_txt),
        diag,
        need_image,
        need_text,
        SAME_WEIGHTS=weights_text is None,
    )
