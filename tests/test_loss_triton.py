"""The Triton kernels, run by the Triton interpreter on CPU, against the float64 reference.

TRITON_INTERPRET must be set before triton is imported, and other test modules in this pytest
process may have imported it already, so each group of cases runs in a fresh Python process:
this file executed as a script (``python tests/test_loss_triton.py GROUP``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

GROUPS = ["clip_fp32", "clip_low_precision", "siglip", "primitives"]


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


def _check_losses(siglip: bool, dtypes, shapes) -> None:
    import torch
    from test_loss_reference import assert_matches, loss_and_grads, natural_sizes, reference, unit_features

    from bigclip.loss import ClipLoss, SigLipLoss

    for k, (n, dim) in enumerate(shapes):
        for dtype in dtypes:
            scale = torch.tensor([1.0, 10.0, 100.0][k % 3])
            bias = torch.tensor([-10.0, 0.0, 2.0][k % 3]) if siglip else None
            grad_output = [1.0, -2.0][k % 2]
            image, text = unit_features(n, dim, seed=k, dtype=dtype)
            module = SigLipLoss(impl="triton") if siglip else ClipLoss(impl="triton")
            got = loss_and_grads(module, image, text, scale, bias, grad_output)
            ref_loss, ref_grads = reference(siglip, image, text, scale, bias)
            assert_matches(
                got,
                (ref_loss, [g * grad_output for g in ref_grads]),
                dtype,
                what=f"triton siglip={siglip} n={n} dim={dim} {dtype}",
                natural=natural_sizes(n, scale.item(), grad_output),
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
    else:
        raise SystemExit(f"unknown group {group!r}")
    print(f"ok {group}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
