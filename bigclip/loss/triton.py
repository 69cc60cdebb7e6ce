"""Fused Triton kernels for the CLIP loss: the same primitives as `bigclip.loss.chunked`.

Forward (`clip_block_stats`): one pass over the logit tiles gives both directions: per-row
log-sum-exp and softmax-weighted mean of the unscaled logit (online, in registers), and the same
per column. Column statistics need a reduction over row blocks; each program owns a private row
of a (programs x N) float32 workspace that it updates tile by tile (no atomics, deterministic),
and the launcher folds the few program rows together. The number of programs is capped, so the
workspace is O(N), never O(N^2).

Backward (`clip_block_grads`): a grid over tiles; each tile is recomputed from the features and
the saved statistics, turned into dL/dlogits and multiplied into the image and text gradients,
accumulated with float32 atomics.

Precision and dtypes: features may be fp32, bf16 or fp16; every reduction and accumulation is
float32.
- Logits: bf16/fp16 features go to `tl.dot` in their own dtype on a GPU (a product of two bf16 or
  fp16 numbers is exact in fp32, so this equals fp32 math); fp32 features use
  input_precision="ieee" (no TF32), so fp32 results match the reference to ~1e-6.
- Gradients: dL/dlogits is fp32. For bf16 features it is split into bf16 hi + lo parts and
  multiplied with two bf16 dots (error ~2^-16 relative per element instead of 2^-8 for one
  bf16 rounding); fp32 and fp16 features use fp32 "ieee" dots.
- Under TRITON_INTERPRET=1 (CPU) every dot operand is upcast to fp32 first, because the
  interpreter computes bf16 dots on raw bits. The upcast computes the same numbers, so the
  interpreted tests check the GPU arithmetic, the hi/lo split included.
- Any embedding dim: the dim is walked in BLOCK_D chunks with masks; no head reshaping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bigclip.loss.select import triton_interpreted


@triton.jit
def dot_f32acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation (see the module docstring for UPCAST)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")  # no TF32: fp32 stays exact
    else:
        out = tl.dot(a, b, acc)  # bf16 / fp16 products are exact in the fp32 accumulator
    return out


@triton.jit
def logits_tile(
    img_ptr,
    txt_ptr,
    rows,
    cols,
    D,
    stride_img,
    stride_txt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    M,
    N,
):
    """x = image[rows] @ text[cols].T in fp32, zero outside the block."""
    x = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dims = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dims
        in_dim = d[None, :] < D
        a_ptrs = img_ptr + rows[:, None] * stride_img + d[None, :]
        b_ptrs = txt_ptr + cols[:, None] * stride_txt + d[None, :]
        a = tl.load(a_ptrs, mask=(rows[:, None] < M) & in_dim, other=0.0)
        b = tl.load(b_ptrs, mask=(cols[:, None] < N) & in_dim, other=0.0)
        x = dot_f32acc(a, tl.trans(b), x, UPCAST)
    return x


@triton.jit
def accumulate_feature_grads(
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
    NEED_IMG: tl.constexpr,
    NEED_TXT: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """d_img[rows] += g_img @ text[cols]; d_txt[cols] += g_txt.T @ image[rows] (fp32 atomics)."""
    dims = tl.arange(0, BLOCK_D)
    if SPLIT_BF16:
        gi_hi = g_img.to(tl.bfloat16)
        gi_lo = (g_img - gi_hi.to(tl.float32)).to(tl.bfloat16)
        gt_hi = tl.trans(g_txt).to(tl.bfloat16)
        gt_lo = (tl.trans(g_txt) - gt_hi.to(tl.float32)).to(tl.bfloat16)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dims
        row_mask = (rows[:, None] < M) & (d[None, :] < D)
        col_mask = (cols[:, None] < N) & (d[None, :] < D)
        if NEED_IMG:
            b = tl.load(txt_ptr + cols[:, None] * stride_txt + d[None, :], mask=col_mask, other=0.0)
            acc = tl.zeros((g_img.shape[0], BLOCK_D), dtype=tl.float32)
            if SPLIT_BF16:
                acc = dot_f32acc(gi_hi, b, acc, UPCAST)
                acc = dot_f32acc(gi_lo, b, acc, UPCAST)
            else:
                acc = dot_f32acc(g_img, b.to(tl.float32), acc, True)
            tl.atomic_add(d_img_ptr + rows[:, None] * D + d[None, :], acc, mask=row_mask)
        if NEED_TXT:
            a = tl.load(img_ptr + rows[:, None] * stride_img + d[None, :], mask=row_mask, other=0.0)
            acc = tl.zeros((g_txt.shape[1], BLOCK_D), dtype=tl.float32)
            if SPLIT_BF16:
                acc = dot_f32acc(gt_hi, a, acc, UPCAST)
                acc = dot_f32acc(gt_lo, a, acc, UPCAST)
            else:
                acc = dot_f32acc(tl.trans(g_txt), a.to(tl.float32), acc, True)
            tl.atomic_add(d_txt_ptr + cols[:, None] * D + d[None, :], acc, mask=col_mask)


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


def launch_config(features: torch.Tensor) -> dict:
    """Block sizes: big blocks in the interpreter (each op costs Python time), GPU-sized otherwise."""
    dim = features.shape[1]
    if triton_interpreted():
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=min(triton.next_power_of_2(dim), 512), UPCAST=True)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, UPCAST=False, num_warps=4)


def max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def prepare(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def clip_block_stats(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, tile: int | None = None):
    image, text = prepare(image), prepare(text)
    m, dim = image.shape
    n = text.shape[0]
    cfg = launch_config(image)
    row_blocks = triton.cdiv(m, cfg["BLOCK_M"])
    per_program = triton.cdiv(row_blocks, max_programs(image.device))
    programs = triton.cdiv(row_blocks, per_program)
    dev = image.device
    row_lse = torch.empty(m, device=dev)
    row_mean = torch.empty(m, device=dev)
    ws_lse = torch.full((programs, n), float("-inf"), device=dev)
    ws_mean = torch.zeros((programs, n), device=dev)
    _clip_stats_kernel[(programs,)](
        image,
        text,
        scale.reshape(1),
        row_lse,
        row_mean,
        ws_lse,
        ws_mean,
        m,
        n,
        dim,
        image.stride(0),
        text.stride(0),
        per_program,
        **cfg,
    )
    col_lse = torch.logsumexp(ws_lse, 0)
    col_mean = (ws_mean * torch.exp(ws_lse - col_lse)).sum(0)
    return row_lse, row_mean, col_lse, col_mean


def _per_column(w: torch.Tensor, n: int) -> torch.Tensor:
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
    image, text = prepare(image), prepare(text)
    m, dim = image.shape
    n = text.shape[0]
    cfg = launch_config(image)
    dev = image.device
    d_image = torch.zeros((m, dim), device=dev) if need_image else None
    d_text = torch.zeros((n, dim), device=dev) if need_text else None
    a_img, b_img = (_per_column(w, n) for w in weights_image)
    a_txt, b_txt = (a_img, b_img) if weights_text is None else (_per_column(w, n) for w in weights_text)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    scratch = row_lse  # a valid pointer for gradients that are not wanted
    _clip_grads_kernel[grid](
        image,
        text,
        scale.reshape(1),
        row_lse.contiguous(),
        col_lse.contiguous(),
        a_img,
        b_img,
        a_txt,
        b_txt,
        scratch if d_image is None else d_image,
        scratch if d_text is None else d_text,
        m,
        n,
        dim,
        image.stride(0),
        text.stride(0),
        0 if diag is None else diag,
        HAS_DIAG=diag is not None,
        SAME_WEIGHTS=weights_text is None,
        NEED_IMG=need_image,
        NEED_TXT=need_text,
        SPLIT_BF16=image.dtype == torch.bfloat16,
        **cfg,
    )
    return d_image, d_text


from bigclip.loss.triton_siglip import siglip_block_grads, siglip_block_sums  # noqa: E402,F401
