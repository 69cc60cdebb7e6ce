"""The Triton kernels, run by the Triton interpreter on CPU, against the float64 reference.

TRITON_INTERPRET must be set before triton is imported, and other test modules in this pytest
process may have imported it already, so each group of cases runs in a fresh Python process:
this file executed as a script (``python tests/test_loss_triton.py GROUP``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

GROUPS = [
    "clip_fp32",
    "clip_low_precision",
    "siglip",
    "primitives",
    "fused_clip",
    "fused_siglip",
    "fused_fast",
    "fused_primitives",
]


def _run_group(group: str, interpret: bool):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), group],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"group {group!r} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert f"ok {group}" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_triton_interpreted(group):
    _run_group(group, interpret=True)


@pytest.mark.slow
def test_kernels_compile_for_cuda():
    # No GPU here, but Triton compiles to an sm_90 cubin without one: this catches code that the
    # interpreter accepts and the compiler does not (and shared-memory overflows).
    _run_group("cuda_compile", interpret=False)


# --------------------------------------------------------------- run inside the interpreter

SHAPES = [
    (1, 1),
    (5, 3),
    (63, 17),
    (64, 64),
    (65, 33),
    (130, 100),
    (70, 512),
    (40, 768),
    (33, 1280),
    (20, 1023),
]


def _check_losses(siglip: bool, dtypes, shapes, impl: str = "triton", precision: str = "exact") -> None:
    """The loss and every gradient against the float64 reference: within the tested bounds (exact), or for the
    fused path's fast precision the feature gradients within 8x the error of rounding the reference's to the
    features' dtype (norm-wise; measured 1.0-2.8x, 6.6x for SigLIP logits near its initial bias, where
    nearly equal dL/dlogits round alike) and the exact bounds for everything else."""
    import torch
    from test_loss_reference import assert_matches, loss_and_grads, natural_sizes, reference, unit_features

    from bigclip.loss import ClipLoss, SigLipLoss

    for k, (n, dim) in enumerate(shapes):
        for dtype in dtypes:
            scale = torch.tensor([1.0, 10.0, 100.0][k % 3])
            bias = torch.tensor([-10.0, 0.0, 2.0][k % 3]) if siglip else None
            grad_output = [1.0, -2.0][k % 2]
            image, text = unit_features(n, dim, seed=k, dtype=dtype)
            module = (SigLipLoss if siglip else ClipLoss)(impl=impl, precision=precision)
            got = loss_and_grads(module, image, text, scale, bias, grad_output)
            ref_loss, ref_grads = reference(siglip, image, text, scale, bias)
            ref_grads = [g * grad_output for g in ref_grads]
            what = f"{impl} {precision} siglip={siglip} n={n} dim={dim} {dtype}"
            natural = natural_sizes(n, scale.item(), grad_output)
            if precision == "exact":
                assert_matches(got, (ref_loss, ref_grads), dtype, what=what, natural=natural)
                continue
            loss, grads = got
            assert_matches((loss, [torch.zeros_like(g) for g in grads[:2]] + grads[2:]),
                           (ref_loss, [torch.zeros_like(g) for g in ref_grads[:2]] + ref_grads[2:]),
                           dtype, what=what, natural=natural)  # fmt: skip
            for name, g, r in zip(("image", "text"), grads, ref_grads):
                own_rounding = (r.to(dtype).double() - r).norm()
                assert (g - r).norm() <= 8 * own_rounding + 1e-6 * r.norm(), (
                    f"{what} d{name}: error {(g - r).norm():.3e}, the reference's own rounding {own_rounding:.3e}"
                )


def _check_primitives() -> None:
    """Block primitives with the distributed options (offset positives, split weights) and memory."""
    import torch
    from test_loss_chunked import LargestTensor
    from test_loss_reference import unit_features

    import bigclip.loss.chunked as chunked
    import bigclip.loss.triton as fused
    from bigclip.loss.triton_tiles import max_programs

    def close(got, want):
        # fp32 against fp32 computed in another order: within 1e-5 of the largest element
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())

    torch.manual_seed(0)
    image, _ = unit_features(70, 40, seed=1)
    _, text = unit_features(150, 40, seed=2)
    scale = torch.tensor(20.0)
    stats = fused.clip_block_stats(image, text, scale)
    for got, want in zip(stats, chunked.clip_block_stats(image, text, scale)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    row_lse, _, col_lse, _ = stats
    w = [torch.rand(150) for _ in range(4)]
    for diag in (None, 0, 80, -30):
        for weights_text in (None, (w[2], w[3])):
            args = (image, text, scale, row_lse, col_lse, (w[0], w[1]), weights_text, diag)
            for got, want in zip(fused.clip_block_grads(*args), chunked.clip_block_grads(*args)):
                close(got, want)
        bias, coef = torch.tensor(-3.0), torch.tensor(0.3)
        torch.testing.assert_close(
            fused.siglip_block_sums(image, text, scale, bias, diag),
            chunked.siglip_block_sums(image, text, scale, bias, diag),
            rtol=1e-5,
            atol=1e-5,
        )
        for got, want in zip(
            fused.siglip_block_grads(image, text, scale, bias, diag, coef),
            chunked.siglip_block_grads(image, text, scale, bias, diag, coef),
        ):
            close(got, want)

    # Memory: the largest torch tensor in forward + backward is the (programs x N) workspace
    # or a feature-sized buffer, far below N x N.
    from bigclip.loss import ClipLoss

    n = 256
    image, text = (t.requires_grad_() for t in unit_features(n, 16, seed=3))
    with LargestTensor() as probe:
        ClipLoss(impl="triton")(image, text, torch.tensor(10.0, requires_grad=True)).backward()
    assert probe.largest <= max(max_programs(image.device) * n, n * 16), probe.largest


def _check_fused_primitives() -> None:
    """The fused path's primitives against the chunked path's, across chunk borders, with the distributed options
    (offset positives, no positives, split weights), both precisions of fp32; and its memory."""
    import torch
    from test_loss_chunked import LargestTensor
    from test_loss_reference import unit_features

    import bigclip.loss.chunked as chunked
    from bigclip.loss import ClipLoss, SigLipLoss
    from bigclip.loss.fused import FusedBackend
    from bigclip.loss.fused_tuning import INTERPRETED

    def close(got, want):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())

    # float64 sums of terms from fp32 logits, whose matmuls round by their own blocking (and torch's thread count):
    # measured 1.1e-7 relative apart with one thread, so float64's default rtol of 1e-7 is too tight
    sums_close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=1e-6)

    image, _ = unit_features(70, 40, seed=1)
    _, text = unit_features(150, 40, seed=2)
    scale, bias, coef = torch.tensor(20.0), torch.tensor(-3.0), torch.tensor(0.3)
    w = [torch.rand(150, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want_stats = chunked.clip_block_stats(image, text, scale)
    row_lse, _, col_lse, _ = want_stats
    for fused in (FusedBackend("exact"), FusedBackend("fast")):
        for tile in (None, 16, 33, 70):  # one chunk, several, a last short one
            for got, want in zip(fused.clip_block_stats(image, text, scale, tile=tile), want_stats):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for diag in (None, 0, 80, -30):
            for weights_text in (None, (w[2], w[3])):
                args = (image, text, scale, row_lse, col_lse, (w[0], w[1]), weights_text, diag)
                for need in ((True, True), (True, False), (False, True)):
                    got = fused.clip_block_grads(*args, *need, tile=33)
                    for g, want, wanted in zip(got, chunked.clip_block_grads(*args, *need), need):
                        assert (g is None) == (not wanted)
                        if wanted:
                            close(g, want)
            want_sums = chunked.siglip_block_sums(image, text, scale, bias, diag)
            sums_close(fused.siglip_block_sums(image, text, scale, bias, diag, tile=33), want_sums)
            want_grads = chunked.siglip_block_grads(image, text, scale, bias, diag, coef)
            sums, *grads = fused.siglip_block_sums_and_grads(image, text, scale, bias, diag, coef, tile=33)
            sums_close(sums, want_sums)
            for got in (grads, fused.siglip_block_grads(image, text, scale, bias, diag, coef, tile=33)):
                for g, want in zip(got, want_grads):
                    close(g, want)
        # the one-pass primitive equals the two the chunked path has for it
        sums, *grads = chunked.siglip_block_sums_and_grads(image, text, scale, None, 0, coef, tile=64)
        sums_close(sums, chunked.siglip_block_sums(image, text, scale, None, 0))
        for g, want in zip(grads, chunked.siglip_block_grads(image, text, scale, None, 0, coef)):
            close(g, want)

    # Memory: the largest tensor in forward + backward is a chunk of logits or of G (hi and lo parts), or
    # feature-sized, far below N x N.
    n, dim = 512, 16
    for module, dtype in ((ClipLoss(impl="fused"), torch.bfloat16), (SigLipLoss(impl="fused"), torch.bfloat16)):
        image, text = (t.requires_grad_() for t in unit_features(n, dim, seed=3, dtype=dtype))
        with LargestTensor() as probe:
            module(image, text, torch.tensor(10.0, requires_grad=True), torch.tensor(-5.0)).backward()
        assert probe.largest <= 2 * INTERPRETED.chunk_rows * n < n * n // 2, (module, probe.largest)


def _compile_for_cuda() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import bigclip.loss.triton_clip as clip_kernels
    import bigclip.loss.triton_siglip as siglip_kernels

    target = GPUTarget("cuda", 90, 32)
    blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, UPCAST=False)
    clip_grads = dict(HAS_DIAG=True, SAME_WEIGHTS=False, NEED_IMG=True, NEED_TXT=True)
    # Six compilations cover every dot variant: fp32 "ieee" logits, native bf16 / fp16 logits,
    # the bf16 hi/lo gradient split, and fp32 gradient dots.
    cases = [
        (clip_kernels._clip_stats_kernel, "fp32", {}),
        (clip_kernels._clip_stats_kernel, "bf16", {}),
        (clip_kernels._clip_grads_kernel, "bf16", clip_grads),
        (clip_kernels._clip_grads_kernel, "fp16", clip_grads),
        (siglip_kernels._siglip_sums_kernel, "fp16", dict(HAS_BIAS=True, HAS_DIAG=True)),
        (siglip_kernels._siglip_grads_kernel, "fp32", dict(HAS_BIAS=True, HAS_DIAG=True, NEED_IMG=True, NEED_TXT=True)),
    ]
    for kernel, dtype, flags in cases:
        constexprs = dict(blocks, **flags)
        if "SPLIT_BF16" in kernel.arg_names:
            constexprs["SPLIT_BF16"] = dtype == "bf16"
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in ("img_ptr", "txt_ptr"):
                signature[name] = "*" + dtype
            elif name.endswith("_ptr"):
                signature[name] = "*fp32"
            else:
                signature[name] = "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target)
        assert compiled.metadata.shared <= 200 * 1024, (kernel.__name__, dtype, compiled.metadata.shared)
    _compile_fused_for_cuda(target)


def _compile_fused_for_cuda(target) -> None:
    """The fused path's kernels at the tuned tile sizes, G in each dtype, split and not."""
    import triton
    from triton.compiler import ASTSource

    import bigclip.loss.fused_kernels as k

    def sig(kernel, constexprs, g_dtype="fp32"):
        out = {}
        for name in kernel.arg_names:
            if name in constexprs:
                out[name] = "constexpr"
            elif name.startswith("g_") and name.endswith("_ptr"):
                out[name] = "*" + g_dtype
            elif name.endswith("_ptr"):
                out[name] = "*fp32"
            else:
                out[name] = "i32"
        return out

    tiles = dict(BM=32, BN=256)
    cases = [(k._clip_stats_kernel, tiles, "fp32"), (k._merge_rows_kernel, dict(BLOCK=1024), "fp32")]
    cases += [(k._merge_columns_kernel, dict(FIRST=first, BLOCK=1024), "fp32") for first in (True, False)]
    for g_dtype, split in (("bf16", True), ("bf16", False), ("fp16", True), ("fp32", False)):
        flags = dict(tiles, HAS_DIAG=True, SPLIT=split)
        cases.append((k._clip_grads_kernel, dict(flags, SAME_WEIGHTS=False), g_dtype))
        cases.append((k._siglip_kernel, dict(flags, HAS_BIAS=True, WRITE_G=True), g_dtype))
    for kernel, constexprs, g_dtype in cases:
        compiled = triton.compile(ASTSource(kernel, sig(kernel, constexprs, g_dtype), constexprs), target=target)
        assert compiled.metadata.shared <= 200 * 1024, (kernel.__name__, g_dtype, compiled.metadata.shared)


def main(group: str) -> int:
    import torch

    if group == "cuda_compile":
        _compile_for_cuda()
        print(f"ok {group}")
        return 0
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, which sets TRITON_INTERPRET=1"
    if group == "clip_fp32":
        _check_losses(False, [torch.float32], SHAPES)
    elif group == "clip_low_precision":
        _check_losses(False, [torch.bfloat16, torch.float16], SHAPES[:6])
    elif group == "siglip":
        _check_losses(True, [torch.float32], SHAPES)
        _check_losses(True, [torch.bfloat16, torch.float16], SHAPES[2:6])
    elif group == "primitives":
        _check_primitives()
    elif group == "fused_clip":
        _check_losses(False, [torch.float32], SHAPES, impl="fused")
        _check_losses(False, [torch.bfloat16, torch.float16], SHAPES[:6], impl="fused")
    elif group == "fused_siglip":
        _check_losses(True, [torch.float32], SHAPES, impl="fused")
        _check_losses(True, [torch.bfloat16, torch.float16], SHAPES[:6], impl="fused")
    elif group == "fused_fast":
        for siglip in (False, True):
            _check_losses(siglip, [torch.bfloat16, torch.float16], SHAPES[2:6] + [(300, 64)], "fused", "fast")
    elif group == "fused_primitives":
        _check_fused_primitives()
    else:
        raise SystemExit(f"unknown group {group!r}")
    print(f"ok {group}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
