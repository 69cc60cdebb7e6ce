"""The `fused` loss path: logits by cuBLAS in row chunks, everything else by fused Triton kernels.

The four block primitives of `bigclip.loss.chunked` (plus `siglip_block_sums_and_grads`) on one design:
a chunk of image rows against every text, x = image[chunk] @ text.T, is one tensor-core matmul with float32
output (bf16 / fp16 products are exact in fp32, so x is the float32 logit the other paths compute); one
Triton kernel reads x once and turns it into what the loss needs (statistics, sums, or G = dL/dlogits in the
features' dtype); two more matmuls multiply G into the feature gradients, which accumulate in float32. The
largest buffers are one chunk of x and of G: memory O(N d + chunk N), never N x N, and the matmuls run at
cuBLAS speed. Chunk and tile sizes come from `bigclip.loss.fused_tuning` (measured by
bench/gpu/tune_losses.py).

A CLIP loss needs 4 chunked matmul passes (x for the statistics; x, then G @ text and G.T @ image for the
gradients), 8 N^2 d flops; a SigLIP loss needs no statistics, so when gradients are wanted the forward pass
computes them at once (`siglip_block_sums_and_grads`): 3 passes, 6 N^2 d flops.

Precision (`precision`, --loss-precision):
- "exact": every result within the bounds the chunked path is tested to: fp32 features use IEEE fp32
  matmuls (TF32 off whatever torch's global setting); for bf16 / fp16 features G is handed to the matmuls
  as two parts hi + lo in the features' dtype (G to about 2^-16; one more matmul per gradient).
- "fast": fp32 features use TF32 matmuls; bf16 / fp16 features hand G over rounded once to their dtype
  (feature gradients 1.0-2.8x the error of their own final rounding, norm-wise, up to 6.6x for SigLIP
  logits near its initial bias; docs/benchmarks.md, GPU section: "the fused contrastive losses").
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from bigclip.loss import fused_kernels as k
from bigclip.loss.fused_tuning import PRECISIONS, LaunchPlan, launch_plan

_LOW = (torch.bfloat16, torch.float16)


def _prepare(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _spans(n: int, size: int):
    return [(start, min(start + size, n)) for start in range(0, n, size)]


@functools.cache
def _native_fp32_out(device_type: str, index: int | None) -> bool:
    """Whether this device's torch multiplies bf16 matrices into a float32 result (mm / addmm out_dtype,
    cuBLAS with fp32 output) correctly, in place included; otherwise features are upcast (exact, slower)."""
    if device_type != "cuda":
        return False
    dev = torch.device(device_type, index)
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(64, 48, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    want = a.double() @ b.double().T
    try:
        out = torch.mm(a, b.T, out_dtype=torch.float32)
        acc = out.clone()
        torch.addmm(acc, a, b.T, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, b.T, beta=0, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool(torch.allclose(out.double(), want, atol=1e-4) and torch.allclose(acc.double(), want, atol=1e-4))


class _Matmuls:
    """The matmuls of one primitive call: float32 results from features of any dtype, as the precision says."""

    def __init__(self, image: torch.Tensor, text: torch.Tensor, precision: str):
        dev = image.device
        self.device_type = dev.type
        self.low = image.dtype in _LOW
        self.native = self.low and _native_fp32_out(dev.type, dev.index)
        self.upcast = self.low and not self.native
        self.tf32 = precision == "fast"
        self.text = text.float() if self.upcast else text

    @contextlib.contextmanager
    def arithmetic(self):
        """The precision's arithmetic whatever the caller's: no autocast (which would run the fp32 matmuls in 16
        bits), TF32 on or off for fp32 matmuls as the precision says, whatever torch's global setting is."""
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        try:
            with torch.autocast(self.device_type, enabled=False):
                yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    def into(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
        """out (float32) = a @ b, or += with accumulate."""
        if self.native:
            torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=torch.float32, out=out)
            return
        if self.upcast:
            a, b = a.float(), b.float()
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)

    def logits(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        self.into(out, rows.float() if self.upcast else rows, self.text.T, accumulate=False)


def _g_buffers(rows: int, n: int, dtype: torch.dtype, split: bool, device) -> torch.Tensor:
    """(2 if split else 1, rows, n) in the dtype G is handed to the matmuls in: [hi, lo] or [G]."""
    return torch.empty((2 if split else 1, rows, n), dtype=dtype, device=device)


class FusedBackend:
    """The block primitives (see `bigclip.loss.chunked`) on cuBLAS chunks + Triton kernels, at one precision."""

    def __init__(self, precision: str = "exact"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
        self.precision = precision

    def __repr__(self) -> str:
        return f"FusedBackend(precision={self.precision!r})"

    def _split(self, features: torch.Tensor) -> bool:
        return features.dtype in _LOW and self.precision == "exact"

    # ----------------------------------------------------------------------------------------------- CLIP

    def clip_block_stats(self, image, text, scale, tile: int | None = None):
        image, text = _prepare(image), _prepare(text)
        m, n, dev = image.shape[0], text.shape[0], image.device
        plan = launch_plan("clip", image.dtype, n, m, dev, tile)
        mm = _Matmuls(image, text, self.precision)
        chunk = min(plan.chunk_rows, m)
        x = torch.empty((chunk, n), device=dev)
        out = [torch.empty(m, device=dev), torch.empty(m, device=dev)]  # row lse, row mean
        cols = [torch.empty(n, device=dev), torch.empty(n, device=dev)]  # column lse, column mean
        col_blocks = triton.cdiv(n, plan.stats_bn)
        rows_per_group, groups = _row_groups(chunk, col_blocks, plan, dev)
        row_parts = torch.empty((3, col_blocks, chunk), device=dev)
        col_parts = torch.empty((3, groups, n), device=dev)
        scale = scale.reshape(1).float()
        with mm.arithmetic():
            for i, (r0, r1) in enumerate(_spans(m, chunk)):
                r = r1 - r0
                xs = x[:r]
                mm.logits(xs, image[r0:r1])
                g = triton.cdiv(r, rows_per_group)
                # partial k of chunk row j at [., k, j], rows contiguous (stride r), as the kernel indexes them
                rp = row_parts.view(-1)[: 3 * col_blocks * r].view(3, col_blocks, r)
                k._clip_stats_kernel[(col_blocks, g)](
                    xs, n, scale, rp[0], rp[1], rp[2], col_parts[0], col_parts[1], col_parts[2], r, n,
                    rows_per_group, BM=plan.stats_bm, BN=plan.stats_bn, num_warps=plan.stats_warps,
                )  # fmt: skip
                k._merge_rows_kernel[(triton.cdiv(r, plan.merge_block),)](
                    rp[0], rp[1], rp[2], out[0][r0:r1], out[1][r0:r1], r, col_blocks, BLOCK=plan.merge_block
                )
                k._merge_columns_kernel[(triton.cdiv(n, plan.merge_block),)](
                    col_parts[0], col_parts[1], col_parts[2], cols[0], cols[1], n, g,
                    FIRST=i == 0, BLOCK=plan.merge_block,
                )  # fmt: skip
        return out[0], out[1], cols[0], cols[1]

    def clip_block_grads(
        self,
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
        image, text = _prepare(image), _prepare(text)
        m, n, dev = image.shape[0], text.shape[0], image.device
        plan = launch_plan("clip", image.dtype, n, m, dev, tile)
        mm = _Matmuls(image, text, self.precision)
        split = self._split(image)
        per_column = [w.float().expand(n).contiguous() for w in weights_image]
        same = weights_text is None
        per_column += per_column if same else [w.float().expand(n).contiguous() for w in weights_text]
        chunk = min(plan.chunk_rows, m)
        x = torch.empty((chunk, n), device=dev)
        g_img = _g_buffers(chunk, n, image.dtype, split, dev)
        g_txt = g_img if same else _g_buffers(chunk, n, image.dtype, split, dev)
        d_image = torch.empty((m, image.shape[1]), device=dev) if need_image else None
        d_text = torch.zeros((n, text.shape[1]), device=dev) if need_text else None
        scale = scale.reshape(1).float()
        row_lse, col_lse = row_lse.float().contiguous(), col_lse.float().contiguous()
        unit = _unit(torch.stack([(a.abs() + b.abs()).max() for a, b in zip(per_column[::2], per_column[1::2])]))
        with mm.arithmetic():
            for r0, r1 in _spans(m, chunk):
                r = r1 - r0
                xs = x[:r]
                mm.logits(xs, image[r0:r1])
                gi, gt = _chunk_view(g_img, r), _chunk_view(g_txt, r)
                k._clip_grads_kernel[(triton.cdiv(r, plan.bm), triton.cdiv(n, plan.bn))](
                    xs, n, scale, row_lse[r0:r1], col_lse, *per_column, unit, gi[0], gi[-1], gt[0], gt[-1], r, n, r0,
                    0 if diag is None else diag, HAS_DIAG=diag is not None, SAME_WEIGHTS=same, SPLIT=split,
                    BM=plan.bm, BN=plan.bn, num_warps=plan.warps,
                )  # fmt: skip
                _multiply_into(mm, gi, gt, image[r0:r1], d_image[r0:r1] if need_image else None, d_text)
        return _times(d_image, scale / unit), _times(d_text, scale / unit)

    # --------------------------------------------------------------------------------------------- SigLIP

    def _siglip(self, image, text, scale, bias, diag, coef, need_image, need_text, tile):
        """(sums float64 [loss, dz * x, dz], d_image, d_text): gradients of coef * loss unless coef is None."""
        image, text = _prepare(image), _prepare(text)
        m, n, dev = image.shape[0], text.shape[0], image.device
        plan = launch_plan("siglip", image.dtype, n, m, dev, tile)
        mm = _Matmuls(image, text, self.precision)
        grads = coef is not None and (need_image or need_text)
        split = grads and self._split(image)
        chunk = min(plan.chunk_rows, m)
        x = torch.empty((chunk, n), device=dev)
        g = _g_buffers(chunk, n, image.dtype, split, dev) if grads else x.new_empty((1, 1, 1))
        grid_n = triton.cdiv(n, plan.bn)
        partials = torch.empty((triton.cdiv(chunk, plan.bm) * grid_n, 3), device=dev)
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        d_image = torch.empty((m, image.shape[1]), device=dev) if grads and need_image else None
        d_text = torch.zeros((n, text.shape[1]), device=dev) if grads and need_text else None
        scale = scale.reshape(1).float()
        bias_t = scale if bias is None else bias.reshape(1).float()
        with mm.arithmetic():
            for r0, r1 in _spans(m, chunk):
                r = r1 - r0
                xs = x[:r]
                mm.logits(xs, image[r0:r1])
                grid = (triton.cdiv(r, plan.bm), grid_n)
                gv = _chunk_view(g, r) if grads else (g, g)
                k._siglip_kernel[grid](
                    xs, n, scale, bias_t, partials, gv[0], gv[-1], r, n, r0, 0 if diag is None else diag,
                    HAS_BIAS=bias is not None, HAS_DIAG=diag is not None, WRITE_G=grads, SPLIT=split,
                    BM=plan.bm, BN=plan.bn, num_warps=plan.warps,
                )  # fmt: skip
                sums += partials[: grid[0] * grid_n].double().sum(0)
                if grads:
                    _multiply_into(mm, gv, gv, image[r0:r1], d_image[r0:r1] if need_image else None, d_text)
        if not grads:
            return sums, None, None
        factor = coef.reshape(1).float() * scale
        return sums, _times(d_image, factor), _times(d_text, factor)

    def siglip_block_sums(self, image, text, scale, bias, diag, tile: int | None = None):
        return self._siglip(image, text, scale, bias, diag, None, False, False, tile)[0]

    def siglip_block_grads(
        self, image, text, scale, bias, diag, coef, need_image: bool = True, need_text: bool = True, tile=None
    ):
        return self._siglip(image, text, scale, bias, diag, coef, need_image, need_text, tile)[1:]

    def siglip_block_sums_and_grads(
        self, image, text, scale, bias, diag, coef, need_image: bool = True, need_text: bool = True, tile=None
    ):
        return self._siglip(image, text, scale, bias, diag, coef, need_image, need_text, tile)


def _row_groups(chunk: int, col_blocks: int, plan: LaunchPlan, dev: torch.device) -> tuple[int, int]:
    """(rows per group, groups) for the statistics kernel: enough programs to fill the GPU, each walking its
    column block down a group of whole row tiles; at most `plan.max_groups` column partials per chunk."""
    programs = 4 * (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1)
    tiles = triton.cdiv(chunk, plan.stats_bm)
    groups = max(1, min(plan.max_groups, tiles, triton.cdiv(programs, col_blocks)))
    per_group = triton.cdiv(tiles, groups) * plan.stats_bm
    return per_group, triton.cdiv(chunk, per_group)


def _unit(largest: torch.Tensor) -> torch.Tensor:
    """A power of two near 1 / the largest weight: G in these units stays near 1 (exact to undo)."""
    largest = largest.max().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(-torch.floor(torch.log2(largest))).reshape(1)


def _times(t: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.mul_(factor)


def _chunk_view(buffers: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of each part of a (parts, chunk, n) buffer, each part contiguous (rows, n)."""
    parts, _, n = buffers.shape
    return buffers.view(-1)[: parts * rows * n].view(parts, rows, n)


def _multiply_into(mm: _Matmuls, g_img, g_txt, rows, d_image, d_text) -> None:
    """d_image (this chunk's rows) = sum of parts of G_img @ text; d_text += sum of parts of G_txt.T @ rows.

    With two parts [hi, lo], the text gradient is one matmul over both: [hi; lo].T @ [rows; rows]."""
    if d_image is not None:
        for i, part in enumerate(g_img):
            mm.into(d_image, part, mm.text, accumulate=i > 0)
    if d_text is not None:
        parts, r, n = g_txt.shape
        stacked = g_txt.reshape(parts * r, n)
        mm.into(d_text, stacked.T, rows.repeat(parts, 1) if parts > 1 else rows, accumulate=True)
