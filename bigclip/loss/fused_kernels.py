"""Triton kernels of the `fused` loss path: each turns one chunk of logits into what the loss needs from it.

The chunk's logits x = image[rows] @ text.T arrive as a float32 (rows x N) buffer written by cuBLAS
(bigclip.loss.fused); these kernels read it once and never write an N x N anything:

- `_clip_stats_kernel`: the CLIP forward. One pass over a chunk gives every row's softmax statistics as
  partials per column block (max, sum of exp, sum of exp * x) and every column's as partials per row
  group, which `_merge_rows_kernel` / `_merge_columns_kernel` fold into the row statistics and into the
  running column statistics of the whole batch (the online log-sum-exp of FlashAttention, over chunks).
  No atomics: every partial has one writer, so results do not depend on scheduling.
- `_clip_grads_kernel`: G = dL/dlogits of a chunk in units that keep it near 1 (the caller multiplies the
  feature gradients back), written in the features' dtype for the feature-gradient matmuls; with SPLIT
  (bf16 / fp16 features, exact precision) as two parts hi + lo whose sum carries G to about 2^-16 (hi alone
  is G rounded once). Units near 1 keep fp16's narrow range from flushing small G to zero.
- `_siglip_kernel`: the SigLIP loss and its scale / bias gradient sums per tile, and optionally G in the
  same way (dz itself, which lies in [-1, 1]).

Every reduction is float32; partial sums of the loss are added in float64 by the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bigclip.loss.triton_siglip import _log1p_small


@triton.jit
def _tile(x_ptr, stride_x, row_lo, row_hi, col_lo, N, BM: tl.constexpr, BN: tl.constexpr):
    """(x, rows, cols, valid) of the BM x BN tile at (row_lo, col_lo); x is 0 outside [row_lo, row_hi) x [., N)."""
    rows = row_lo + tl.arange(0, BM)
    cols = col_lo + tl.arange(0, BN)
    valid = (rows[:, None] < row_hi) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=valid, other=0.0)
    return x, rows, cols, valid


@triton.jit
def _clip_stats_kernel(
    x_ptr,
    stride_x,
    scale_ptr,
    row_max_ptr,
    row_sum_ptr,
    row_dot_ptr,
    col_max_ptr,
    col_sum_ptr,
    col_dot_ptr,
    R,
    N,
    rows_per_group,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Program (column block b, row group g): row partials into [b, row], column partials into [g, column]."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    scale = tl.load(scale_ptr)
    neg_inf = float("-inf")
    m_col = tl.full((BN,), neg_inf, tl.float32)
    l_col = tl.zeros((BN,), tl.float32)
    u_col = tl.zeros((BN,), tl.float32)
    first = g * rows_per_group
    last = tl.minimum(first + rows_per_group, R)
    for r0 in range(first, last, BM):
        x, rows, cols, valid = _tile(x_ptr, stride_x, r0, last, b * BN, N, BM, BN)
        s = tl.where(valid, x * scale, neg_inf)
        # rows: this column block's share of each row
        m_row = tl.max(s, 1)
        m_row_safe = tl.where(m_row == neg_inf, 0.0, m_row)
        p = tl.exp(s - m_row_safe[:, None])
        row_ok = rows < last
        at = b * R + rows
        tl.store(row_max_ptr + at, m_row, mask=row_ok)
        tl.store(row_sum_ptr + at, tl.sum(p, 1), mask=row_ok)
        tl.store(row_dot_ptr + at, tl.sum(p * x, 1), mask=row_ok)
        # columns: online over this group's row blocks
        m_new = tl.maximum(m_col, tl.max(s, 0))
        m_new_safe = tl.where(m_new == neg_inf, 0.0, m_new)
        keep = tl.exp(m_col - m_new_safe)
        q = tl.exp(s - m_new_safe[None, :])
        l_col = l_col * keep + tl.sum(q, 0)
        u_col = u_col * keep + tl.sum(q * x, 0)
        m_col = m_new
    cols = b * BN + tl.arange(0, BN)
    col_ok = cols < N
    tl.store(col_max_ptr + g * N + cols, m_col, mask=col_ok)
    tl.store(col_sum_ptr + g * N + cols, l_col, mask=col_ok)
    tl.store(col_dot_ptr + g * N + cols, u_col, mask=col_ok)


@triton.jit
def _fold(max_ptr, sum_ptr, dot_ptr, parts, stride, idx, ok, BLOCK: tl.constexpr):
    """(log-sum-exp, softmax-weighted mean) of `parts` partials (max, sum, dot) at idx, partial k at k * stride."""
    neg_inf = float("-inf")
    top = tl.full((BLOCK,), neg_inf, tl.float32)
    for k in range(0, parts):
        top = tl.maximum(top, tl.load(max_ptr + k * stride + idx, mask=ok, other=neg_inf))
    top_safe = tl.where(top == neg_inf, 0.0, top)
    total = tl.zeros((BLOCK,), tl.float32)
    dot = tl.zeros((BLOCK,), tl.float32)
    for k in range(0, parts):
        w = tl.exp(tl.load(max_ptr + k * stride + idx, mask=ok, other=neg_inf) - top_safe)
        total += w * tl.load(sum_ptr + k * stride + idx, mask=ok, other=0.0)
        dot += w * tl.load(dot_ptr + k * stride + idx, mask=ok, other=0.0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    return top_safe + tl.log(total_safe), dot / total_safe


@triton.jit
def _merge_rows_kernel(row_max_ptr, row_sum_ptr, row_dot_ptr, lse_ptr, mean_ptr, R, blocks, BLOCK: tl.constexpr):
    """The chunk's row statistics from its column blocks' partials."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < R
    lse, mean = _fold(row_max_ptr, row_sum_ptr, row_dot_ptr, blocks, R, idx, ok, BLOCK)
    tl.store(lse_ptr + idx, lse, mask=ok)
    tl.store(mean_ptr + idx, mean, mask=ok)


@triton.jit
def _merge_columns_kernel(
    col_max_ptr, col_sum_ptr, col_dot_ptr, lse_ptr, mean_ptr, N, groups, FIRST: tl.constexpr, BLOCK: tl.constexpr
):
    """The running column statistics (lse, mean) merged in place with one chunk's row groups' partials."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    lse, mean = _fold(col_max_ptr, col_sum_ptr, col_dot_ptr, groups, N, idx, ok, BLOCK)
    if not FIRST:
        old_lse = tl.load(lse_ptr + idx, mask=ok, other=0.0)
        old_mean = tl.load(mean_ptr + idx, mask=ok, other=0.0)
        top = tl.maximum(old_lse, lse)
        w_old = tl.exp(old_lse - top)
        w_new = tl.exp(lse - top)
        total = w_old + w_new
        lse = top + tl.log(total)
        mean = (old_mean * w_old + mean * w_new) / total
    tl.store(lse_ptr + idx, lse, mask=ok)
    tl.store(mean_ptr + idx, mean, mask=ok)


@triton.jit
def _store_split(ptr, lo_ptr, at, g, mask, SPLIT: tl.constexpr):
    """g in the buffer's dtype; with SPLIT also the remainder g - hi, in the same dtype, into lo_ptr."""
    hi = g.to(ptr.dtype.element_ty)
    tl.store(ptr + at, hi, mask=mask)
    if SPLIT:
        tl.store(lo_ptr + at, (g - hi.to(tl.float32)).to(lo_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_g(a_ptr, b_ptr, cols, col_ok, unit, p_row, p_col, positive):
    """a_j P_row + b_j P_col - (a_j + b_j) [positive], with the per-column weights a, b in `unit`s."""
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0) * unit
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0) * unit
    return a[None, :] * p_row + b[None, :] * p_col - tl.where(positive, (a + b)[None, :], 0.0)


@triton.jit
def _clip_grads_kernel(
    x_ptr,
    stride_x,
    scale_ptr,
    row_lse_ptr,
    col_lse_ptr,
    a_img_ptr,
    b_img_ptr,
    a_txt_ptr,
    b_txt_ptr,
    unit_ptr,
    g_img_ptr,
    g_img_lo_ptr,
    g_txt_ptr,
    g_txt_lo_ptr,
    R,
    N,
    first_row,
    diag,
    HAS_DIAG: tl.constexpr,
    SAME_WEIGHTS: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """G / scale = a_j P_row + b_j P_col - (a_j + b_j) [positive] for one tile, times unit; a second G with the
    texts' weights unless SAME_WEIGHTS. Rows are chunk-local; `first_row` is the chunk's first row in the block."""
    x, rows, cols, valid = _tile(x_ptr, stride_x, tl.program_id(0) * BM, R, tl.program_id(1) * BN, N, BM, BN)
    scale = tl.load(scale_ptr)
    s = x * scale
    row_ok = rows < R
    col_ok = cols < N
    row_lse = tl.load(row_lse_ptr + rows, mask=row_ok, other=0.0)
    col_lse = tl.load(col_lse_ptr + cols, mask=col_ok, other=0.0)
    p_row = tl.where(valid, tl.exp(s - row_lse[:, None]), 0.0)
    p_col = tl.where(valid, tl.exp(s - col_lse[None, :]), 0.0)
    if HAS_DIAG:
        positive = (cols[None, :] == rows[:, None] + first_row + diag) & valid
    else:
        positive = valid & (rows[:, None] < 0)
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    unit = tl.load(unit_ptr)
    g = _weighted_g(a_img_ptr, b_img_ptr, cols, col_ok, unit, p_row, p_col, positive)
    _store_split(g_img_ptr, g_img_lo_ptr, at, g, valid, SPLIT)
    if not SAME_WEIGHTS:
        g = _weighted_g(a_txt_ptr, b_txt_ptr, cols, col_ok, unit, p_row, p_col, positive)
        _store_split(g_txt_ptr, g_txt_lo_ptr, at, g, valid, SPLIT)


@triton.jit
def _siglip_kernel(
    x_ptr,
    stride_x,
    scale_ptr,
    bias_ptr,
    sums_ptr,
    g_ptr,
    g_lo_ptr,
    R,
    N,
    first_row,
    diag,
    HAS_BIAS: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    WRITE_G: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """One tile's [sum of -log sigmoid(y z), sum of dz * x, sum of dz] into sums[program], z = scale x + bias,
    dz = sigmoid(z) - [positive]; with WRITE_G also dz itself (the caller multiplies in coef * scale)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    x, rows, cols, valid = _tile(x_ptr, stride_x, pid_m * BM, R, pid_n * BN, N, BM, BN)
    scale = tl.load(scale_ptr)
    z = x * scale
    if HAS_BIAS:
        z = z + tl.load(bias_ptr)
    if HAS_DIAG:
        positive = (cols[None, :] == rows[:, None] + first_row + diag) & valid
    else:
        positive = valid & (rows[:, None] < 0)
    # -log sigmoid(-z) = softplus(z) for negatives, softplus(z) - z for positives; one exp serves both
    e = tl.exp(-tl.abs(z))
    loss = tl.maximum(z, 0.0) + _log1p_small(e) - tl.where(positive, z, 0.0)
    r = 1.0 / (1.0 + e)
    dz = tl.where(z >= 0.0, r, e * r) - tl.where(positive, 1.0, 0.0)
    loss = tl.where(valid, loss, 0.0)
    dz = tl.where(valid, dz, 0.0)
    slot = (pid_m * tl.num_programs(1) + pid_n) * 3
    tl.store(sums_ptr + slot, tl.sum(tl.sum(loss, 1), 0))
    tl.store(sums_ptr + slot + 1, tl.sum(tl.sum(dz * x, 1), 0))
    tl.store(sums_ptr + slot + 2, tl.sum(tl.sum(dz, 1), 0))
    if WRITE_G:
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        _store_split(g_ptr, g_lo_ptr, at, dz, valid, SPLIT)
