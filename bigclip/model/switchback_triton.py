"""Triton kernels for the SwitchBack int8 linears (`bigclip.model.switchback`): the CUDA path.

Each wrapper has the signature and the exact arithmetic of the torch function of the same name in
`bigclip.model.switchback`, so the two paths can be compared bit for bit (the tests do, under
TRITON_INTERPRET=1 on CPU tensors):

- quantize: scale = absmax / 127 and q = round_half_even(x / scale), both divisions correctly rounded
  (`tl.math.div_rn`: a plain `/` compiles to an approximate division on GPUs), rounding by the 1.5 * 2^23
  trick (exact for |v| < 2^22; `libdevice.rint` does not run in the interpreter). A NaN counts as an
  infinite absmax, so a NaN input turns its row's outputs non-finite instead of vanishing into int8.
- matmul: int8 x int8 with an int32 accumulator (`tl.dot(out_dtype=tl.int32)`, exact), dequantised as
  ((float(acc) * a_scale[row]) * b_scale[col or global]) + bias in float32, in that order, then cast once
  to the output dtype. On a GPU the last multiply-add may be fused into an FMA (at most 1 ulp apart);
  the interpreter casts fp32 to bf16 by truncation where torch and GPUs round to nearest (1 bf16 ulp).
- The operands are addressed through their strides, so a transposed view (W_q.t()) is multiplied
  without a copy: the forward's X @ W^T and the backward's G @ W use the same kernel.

Speed (the point of int8): every operand of an int8 dot is K-major (the summed index contiguous), which
8-bit tensor cores (Hopper's wgmma) require: the forward multiplies X_q by W_q^T (W_q [out, in] row-major
is K-major as the right operand), and the input gradient G_q by W_q through a transposed int8 copy of W
written by the same pass that quantizes W (`quantize_global_pair`, `quantize_columnwise_transposed`), once
per step; the backward never re-quantizes W. A row of X or G is read once: it is quantized from registers
after its absmax (rows up to `ONE_PASS_MAX` long). The matmul is dequantised, biased and cast in its
epilogue, so its int32 accumulator never reaches memory. On a GPU the matmul's tiles are autotuned per
shape (`MATMUL_CONFIGS`, keyed by the shape and the operands' layout); the interpreter runs `MATMUL`.

This module imports Triton: `bigclip.model.switchback` imports it only when a CUDA tensor reaches a
SwitchBack layer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ONE_PASS_MAX = 8192  # rows up to this long are held in registers: one read of X or G instead of two
ROW_TILE = 8192  # elements per program when quantizing rows in one pass (BLOCK_R rows x the row's length)
QUANTIZE_ROWS = dict(BLOCK_R=8, BLOCK_C=512)  # longer rows: two passes, a few rows per program
QUANTIZE_COLUMNS = dict(BLOCK_R=64, BLOCK_C=64)  # column-wise: 64 adjacent columns per program stay coalesced
PAIR_TILE = dict(BLOCK_R=64, BLOCK_C=64)  # W and W^T written from one tile
FLAT_BLOCK = 4096
DEQUANTIZE_ROWS = dict(BLOCK_R=16, BLOCK_C=256)
MATMUL = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8)  # the interpreter's (and the compile test's) tiles
MATMUL_WARPS = 4
# Autotuned on a GPU, per (M, N, K, layout): 8-bit wgmma wants 64-row multiples and K tiles of 64-128 bytes.
MATMUL_CONFIGS = [
    triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_stages=stages, num_warps=warps)
    for bm, bn, bk, stages, warps in [
        (128, 256, 128, 3, 8),
        (256, 128, 128, 3, 8),
        (128, 128, 128, 4, 8),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (64, 64, 64, 3, 4),
    ]
]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _absmax_candidates(x):
    """|x| with NaN as +inf: the scale then carries the NaN's non-finiteness into the output."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def _to_int8(x, scale):
    """round_half_even(x / scale) as int8; 0 where the scale is 0 (an all-zero row or tensor) and for a NaN."""
    safe = tl.where(scale > 0, scale, 1.0)
    v = tl.math.div_rn(x, safe)
    v = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: the fp32 add rounds v to the nearest even integer
    v = tl.where(v != v, 0.0, v)  # NaN -> 0 explicitly: min/max and the int8 cast treat NaN differently per target
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return v.to(tl.int8)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    R,
    C,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    # Columns are quantized as the rows of the transposed view: the caller swaps the strides (and passes the
    # output's strides as it wants them laid out: a transposed copy is written by swapping them too).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    if ONE_PASS:  # the whole row fits one block: read it once, quantize it from registers
        cols = tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < C)[None, :]
        row = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        row = row.to(tl.float32)
        scale = tl.math.div_rn(tl.max(_absmax_candidates(row), axis=1), tl.full((BLOCK_R,), 127.0, tl.float32))
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        q = _to_int8(row, tl.broadcast_to(scale[:, None], (BLOCK_R, BLOCK_C)))
        tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :] * stride_qc, q, mask=mask)
        return
    absmax = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        absmax = tl.maximum(absmax, tl.max(_absmax_candidates(x.to(tl.float32)), axis=1))
    scale = tl.math.div_rn(absmax, tl.full((BLOCK_R,), 127.0, tl.float32))
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        q = _to_int8(x.to(tl.float32), tl.broadcast_to(scale[:, None], (BLOCK_R, BLOCK_C)))
        tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :] * stride_qc, q, mask=mask)


@triton.jit
def _absmax_blocks_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.max(_absmax_candidates(x), axis=0))


@triton.jit
def _quantize_global_kernel(x_ptr, absmax_ptr, q_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    scale = tl.math.div_rn(tl.load(absmax_ptr), 127.0)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(q_ptr + offsets, _to_int8(x, scale), mask=ok)


@triton.jit
def _quantize_global_pair_kernel(
    x_ptr,
    absmax_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    R,
    C,
    WRITE_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """x [R, C] contiguous -> q [R, C] and (WRITE_T) q^T [C, R], both contiguous, from one read of each tile."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    scale = tl.math.div_rn(tl.load(absmax_ptr), 127.0)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale)
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * C + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
    q = _to_int8(x, scale)
    tl.store(q_ptr + rows64[:, None] * C + cols64[None, :], q, mask=mask)
    if WRITE_T:
        tl.store(qt_ptr + cols64[None, :] * R + rows64[:, None], q, mask=mask)


@triton.jit
def _dequantize_rows_kernel(q_ptr, scale_ptr, out_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offsets = rows.to(tl.int64)[:, None] * C + cols[None, :]
    scale = tl.load(scale_ptr + rows, mask=rows < R, other=0.0)
    out = tl.load(q_ptr + offsets, mask=mask, other=0).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    DEQUANTIZE: tl.constexpr,
    B_SCALE_PER_COLUMN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # Programs walk GROUP_M row blocks down one column block before the next, so the tiles of B they share
    # are still in L2 (the grouped ordering of Triton's matmul tutorial).
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_size
    pid_n = (pid % (GROUP_M * grid_n)) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # Rows and columns past the edge load row 0 / column 0 (in bounds, never stored): the loads need no mask
    # but K's, which the loop drops when K is a multiple of BLOCK_K.
    ra = tl.where(m_ok, rm, 0).to(tl.int64)
    rb = tl.where(n_ok, rn, 0).to(tl.int64)
    a_ptrs = a_ptr + ra[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rb[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    mask = m_ok[:, None] & n_ok[None, :]
    if DEQUANTIZE:
        out = acc.to(tl.float32) * tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
        if B_SCALE_PER_COLUMN:
            out = out * tl.load(b_scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        else:
            out = out * tl.load(b_scale_ptr)
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptrs, acc, mask=mask)


# The GPU's kernel: the same code with its tiles chosen per shape and layout (the int32 output is written whole
# by every trial, so autotuning's repeated launches leave no trace).
_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
_int8_matmul_fixed = _even_k(_int8_matmul_kernel)


def _quick_bench(fn, quantiles):
    """Autotuning's timer, shorter than Triton's default (25 ms warm-up, 100 ms of repeats per config): a run
    tunes each layer shape once, at its first step, and the candidates differ by far more than this resolves."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_int8_matmul_tuned = triton.autotune(
    configs=MATMUL_CONFIGS,
    key=["M", "N", "K", "stride_ak", "stride_bk", "DEQUANTIZE", "B_SCALE_PER_COLUMN", "HAS_BIAS"],
    do_bench=_quick_bench,
)(_even_k(_int8_matmul_kernel))


def _quantize_lines(x: torch.Tensor, columns: bool, transposed_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x's rows (or columns) into int8 laid out as x, or as x^T (contiguous) with transposed_out."""
    assert x.dim() == 2, "quantize a 2-D tensor"
    rows, cols = x.shape
    if transposed_out:
        q = torch.empty((cols, rows), dtype=torch.int8, device=x.device)
        q_strides = q.stride()[::-1]  # q^T viewed in x's shape
    else:
        q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        q_strides = q.stride()
    if columns:  # the columns are the rows of the transposed view
        lines, length, strides_x, strides_q = cols, rows, x.stride()[::-1], q_strides[::-1]
    else:
        lines, length, strides_x, strides_q = rows, cols, x.stride(), q_strides
    scale = torch.empty(lines, dtype=torch.float32, device=x.device)
    if not (lines and length):
        scale.zero_()
        return q, scale
    if not columns and length <= ONE_PASS_MAX:
        block_c = triton.next_power_of_2(length)
        blocks = dict(BLOCK_R=max(1, ROW_TILE // block_c), BLOCK_C=block_c, ONE_PASS=True)
        warps = 8 if block_c >= 4096 else 4
    else:
        blocks, warps = dict(**(QUANTIZE_COLUMNS if columns else QUANTIZE_ROWS), ONE_PASS=False), 4
    grid = (triton.cdiv(lines, blocks["BLOCK_R"]),)
    _quantize_rows_kernel[grid](x, q, scale, lines, length, *strides_x, *strides_q, num_warps=warps, **blocks)
    return q, scale


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, k], float32 scale per row), as `bigclip.model.switchback.quantize_rowwise`."""
    return _quantize_lines(x, columns=False)


def quantize_columnwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 in x's shape, float32 scale per column), as `bigclip.model.switchback.quantize_columnwise`."""
    return _quantize_lines(x, columns=True)


def quantize_columnwise_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q^T: int8 [cols, rows] contiguous, float32 scale per column of x): quantize_columnwise(x) written
    transposed in the same pass, as `bigclip.model.switchback.quantize_columnwise_transposed`."""
    return _quantize_lines(x, columns=True, transposed_out=True)


def _global_absmax(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    programs = triton.cdiv(n, FLAT_BLOCK)
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    _absmax_blocks_kernel[(programs,)](x, partial, n, BLOCK=FLAT_BLOCK)
    return partial.amax()  # a max is exact in any order: the two-stage reduction is deterministic


def quantize_global(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 in x's shape, one float32 scale as a 0-dim tensor), as `bigclip.model.switchback.quantize_global`."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    n = x.numel()
    programs = triton.cdiv(n, FLAT_BLOCK)
    absmax = _global_absmax(x)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    _quantize_global_kernel[(programs,)](x, absmax, q, scale, n, BLOCK=FLAT_BLOCK)
    return q, scale


def quantize_global_pair(
    x: torch.Tensor, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(q, q^T contiguous or None, scale) for a 2-D x: `quantize_global` and its transposed copy from one
    pass over x, as `bigclip.model.switchback.quantize_global_pair`."""
    assert x.dim() == 2, "quantize a 2-D tensor"
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    qt = torch.empty((cols, rows), dtype=torch.int8, device=x.device) if transposed else None
    scale = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel():
        absmax = _global_absmax(x)
        grid = (triton.cdiv(rows, PAIR_TILE["BLOCK_R"]), triton.cdiv(cols, PAIR_TILE["BLOCK_C"]))
        _quantize_global_pair_kernel[grid](
            x, absmax, q, q if qt is None else qt, scale, rows, cols, WRITE_T=transposed, **PAIR_TILE
        )
    return q, qt, scale


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale[row] in float32, cast to out_dtype, as `bigclip.model.switchback.dequantize_rowwise`."""
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    rows, cols = q.shape
    if q.numel():
        grid = (triton.cdiv(rows, DEQUANTIZE_ROWS["BLOCK_R"]), triton.cdiv(cols, DEQUANTIZE_ROWS["BLOCK_C"]))
        _dequantize_rows_kernel[grid](q, scale, out, rows, cols, **DEQUANTIZE_ROWS)
    return out


def _launch_matmul(a, b, c, a_scale, b_scale, bias, dequantize: bool) -> torch.Tensor:
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], f"shapes {tuple(a.shape)} @ {tuple(b.shape)}"
    assert a.dtype == torch.int8 and b.dtype == torch.int8, "int8 operands"
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return c
    per_column = dequantize and b_scale.numel() != 1
    kernel = _int8_matmul_fixed if INTERPRETED or not a.is_cuda else _int8_matmul_tuned
    fixed = dict(num_warps=MATMUL_WARPS, **MATMUL) if kernel is _int8_matmul_fixed else {}

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    kernel[grid](
        a,
        b,
        c,
        a_scale if dequantize else c,
        b_scale if dequantize else c,
        bias if bias is not None else c,  # never read without HAS_BIAS
        M,
        N,
        K,
        *a.stride(),
        *b.stride(),
        *c.stride(),
        DEQUANTIZE=dequantize,
        B_SCALE_PER_COLUMN=per_column,
        HAS_BIAS=bias is not None,
        **fixed,
    )
    return c


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for int8 [M, K] and [K, N] (any strides), the exact int32 accumulator."""
    c = torch.empty((a.shape[0], b.shape[1]), dtype=torch.int32, device=a.device)
    return _launch_matmul(a, b, c, None, None, None, dequantize=False)


def int8_matmul_dequant(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """((a @ b) * a_scale[row]) * b_scale (0-dim: global, [N]: per column) + bias, as the torch version."""
    c = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    return _launch_matmul(a, b, c, a_scale.float().contiguous(), b_scale.float().contiguous(), bias, dequantize=True)
