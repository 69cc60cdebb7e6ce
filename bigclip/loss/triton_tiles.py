"""Triton pieces that the CLIP and the SigLIP kernels share: logit tiles, gradient tiles, launches.

Both losses walk the same blocks (image rows x text columns) in the same tiles and differ only in
what they do with a tile of logits, so the tile arithmetic, its precision rules and the Python
side of a launch live here once, and `bigclip.loss.triton_clip` / `bigclip.loss.triton_siglip`
hold only their own kernels.

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

import os

import torch
import triton
import triton.language as tl


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


# ------------------------------------------------------------------------------ launchers


def triton_interpreted() -> bool:
    """Whether kernels run in Triton's CPU interpreter, which wants other block sizes and upcasts."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch_config(features: torch.Tensor) -> dict:
    """Block sizes: big blocks in the interpreter (each op costs Python time), GPU-sized otherwise."""
    dim = features.shape[1]
    if triton_interpreted():
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=min(triton.next_power_of_2(dim), 512), UPCAST=True)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, UPCAST=False, num_warps=4)


def max_programs(device: torch.device) -> int:
    """A cap on persistent programs: enough to fill the GPU, few enough that per-program workspaces stay O(N)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def prepare(t: torch.Tensor) -> torch.Tensor:
    """The kernels index features by a row stride and assume unit stride along the dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


class Block:
    """One block's features made ready for the kernels, and the launch every kernel shares.

    Every kernel of this package takes (img_ptr, txt_ptr, scale_ptr, <its own pointers>, M, N, D,
    stride_img, stride_txt, <its own scalars>, <its own flags>, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST),
    so only the parts in angle brackets differ from one launch to the next.
    """

    def __init__(self, image: torch.Tensor, text: torch.Tensor):
        self.image, self.text = prepare(image), prepare(text)
        self.m, self.dim = self.image.shape
        self.n = self.text.shape[0]
        self.config = launch_config(self.image)

    def tile_grid(self) -> tuple[int, int]:
        """One program per BLOCK_M x BLOCK_N tile of logits."""
        return triton.cdiv(self.m, self.config["BLOCK_M"]), triton.cdiv(self.n, self.config["BLOCK_N"])

    def launch(self, kernel, grid, scale: torch.Tensor, pointers: tuple, scalars: tuple, **flags) -> None:
        kernel[grid](
            self.image,
            self.text,
            scale.reshape(1),
            *pointers,
            self.m,
            self.n,
            self.dim,
            self.image.stride(0),
            self.text.stride(0),
            *scalars,
            **flags,
            **self.config,
        )

    def launch_tiles(self, kernel, scale: torch.Tensor, pointers: tuple, diag: int | None, **flags) -> None:
        """A tile kernel whose positive pairs sit on diagonal `diag` (None: a block without any)."""
        self.launch(
            kernel,
            self.tile_grid(),
            scale,
            pointers,
            (0 if diag is None else diag,),
            HAS_DIAG=diag is not None,
            **flags,
        )

    def feature_grads(
        self, kernel, scale: torch.Tensor, pointers: tuple, diag: int | None, need_image: bool, need_text: bool, **flags
    ):
        """(d_image, d_text) in float32 (None where not needed) from a backward tile kernel.

        The CLIP and SigLIP backward kernels differ only in how a tile's dL/dlogits is made; both
        end in `accumulate_feature_grads`, which adds into the buffers made here.
        """
        dev = self.image.device
        d_image = torch.zeros((self.m, self.dim), device=dev) if need_image else None
        d_text = torch.zeros((self.n, self.dim), device=dev) if need_text else None
        scratch = torch.empty(1, device=dev)  # a valid pointer for a gradient that is not wanted
        self.launch_tiles(
            kernel,
            scale,
            (*pointers, scratch if d_image is None else d_image, scratch if d_text is None else d_text),
            diag,
            NEED_IMG=need_image,
            NEED_TXT=need_text,
            SPLIT_BF16=self.image.dtype == torch.bfloat16,
            **flags,
        )
        return d_image, d_text
