"""GPU kit, losses: bigclip's fused CLIP and SigLIP losses beside the naive loss (open_clip's own ClipLoss /
SigLipLoss), bigclip's chunked torch path, its fully fused Triton tiles (N <= 16384) and the public fused
kernels Inf-CL (inf-cl, CLIP) and siglip-kernel (SigLIP), forward + backward, in one run.

One row per measurement (table `rows`): family, n, d, dtype, impl, precision (bigclip's fused path: exact or
fast), ms (median forward + backward), peak_gib (allocated above the features, gradients included), tflops
(nominal: 8 N^2 d for CLIP, the floor of a loss that recomputes its logits once; 6 N^2 d for SigLIP, whose
gradients need no statistics), max_rel_err (the largest of the loss's and each feature gradient's relative
error, norm-wise, against the float64 formulas on the same rounded features; N <= 65536). A measurement that
does not fit says OOM; one skipped by the plan below says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Recorder, device, free_memory, is_oom, part_args, peak_mib, time_ms
from loss_reference import clip_reference, max_rel_err, siglip_reference

from bigclip.loss import ClipLoss, SigLipLoss

SCALE = {"clip": 30.0, "siglip": 10.0}
BIAS = -10.0


def naive_losses() -> dict:
    import open_clip

    return {"clip": open_clip.loss.ClipLoss(), "siglip": open_clip.loss.SigLipLoss()}


def inf_cl_loss():
    """Inf-CL's loss, both directions of CLIP (its cal_inf_loss is one direction; one process: its flash path)."""
    from inf_cl import cal_inf_loss

    def loss(image, text, scale, bias=None):
        return (cal_inf_loss(image, text, scale=scale) + cal_inf_loss(text, image, scale=scale)) / 2

    return loss


def siglip_kernel_loss():
    """siglip-kernel's own choice for the inputs (fused_siglip_loss, backend auto), which takes log(scale)."""
    from siglip_kernel import fused_siglip_loss

    def loss(image, text, scale, bias):
        return fused_siglip_loss(image, text, scale.log(), bias)

    return loss


def make_loss(family: str, impl: str, precision: str | None, naive: dict):
    if impl == "naive":
        return naive[family]
    if impl == "inf-cl":
        return inf_cl_loss()
    if impl == "siglip-kernel":
        return siglip_kernel_loss()
    cls = ClipLoss if family == "clip" else SigLipLoss
    return cls(impl=impl, precision=precision or "exact")


def features(n: int, d: int, dtype: torch.dtype, dev: torch.device, seed: int = 0):
    """L2-normalised image features and text features correlated with them (as after some training)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=g, device=dev), dim=-1)
    text = F.normalize(image + 0.8 * torch.randn(n, d, generator=g, device=dev), dim=-1)
    return image.to(dtype), text.to(dtype)


def call(loss_fn, family: str, image, text, scale, bias):
    return loss_fn(image, text, scale) if family == "clip" else loss_fn(image, text, scale, bias)


def plan(sizes, smoke: bool) -> list[tuple]:
    """(family, n, d, dtype, impl, precision, skip reason or None): both families at one N before the next N,
    siglip-kernel's own published point (B = 65536, D = 768, bf16) after N = 65536, the largest N last."""
    rows = []
    for n in sizes:
        for family in ("clip", "siglip"):
            peer = "inf-cl" if family == "clip" else "siglip-kernel"
            for dtype in (torch.bfloat16, torch.float32):
                impls = [("fused", "exact"), ("fused", "fast"), ("naive", None), ("chunked", None), (peer, None)]
                if n <= 16384:
                    impls.append(("triton", None))  # the fully fused tiles this path replaced, for the record
                for impl, precision in impls:
                    skip = None
                    if n > 65536 and impl in ("naive", "chunked", "inf-cl"):
                        skip = "not run: N^2 logits (naive) or minutes a call"
                    elif n > 65536 and dtype == torch.float32 and precision == "exact":
                        skip = "not run: IEEE fp32 matmuls take ~10 s a call at this N"
                    elif n > 65536 and dtype == torch.float32 and impl == "siglip-kernel":
                        # 31 s of the part's budget (7.8 s a call on an H200, 2026-11-27: 4.1x bigclip's fast path)
                        skip = "not run: the peers' fp32 is compared up to N = 65536"
                    if smoke and impl in ("inf-cl", "siglip-kernel"):
                        skip = "not run: CUDA only"
                    rows.append((family, n, 32 if smoke else 1024, dtype, impl, precision, skip))
        if n == 65536:
            rows += [("siglip", n, 768, torch.bfloat16, i, p, None) for i, p in
                     (("fused", "exact"), ("fused", "fast"), ("naive", None), ("siglip-kernel", None))]  # fmt: skip
    return rows


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    smoke = args.smoke
    sizes = (64, 256) if smoke else (4096, 16384, 65536, 262144)
    naive = naive_losses()
    from bigclip.loss.fused import _native_fp32_out
    from bigclip.loss.fused_tuning import tuning_source

    rec.note(f"fused path's launch plans: {tuning_source()}")
    rec.note(f"bf16 matmuls into fp32 (mm/addmm out_dtype) on this device: {_native_fp32_out(dev.type, dev.index)}")
    refs: dict = {}
    for family, n, d, dtype, impl, precision, skip in plan(sizes, smoke):
        fields = dict(family=family, n=n, d=d, dtype=str(dtype).removeprefix("torch."), impl=impl,
                      precision=precision)  # fmt: skip
        if skip:
            rec.row("rows", **fields, ms=skip)
            continue
        image, text = features(n, d, dtype, dev)
        scale = torch.tensor(SCALE[family], device=dev)
        bias = torch.tensor(BIAS, device=dev) if family == "siglip" else None
        want_error = n <= 65536
        case = (family, n, d, dtype)
        if want_error and case not in refs:
            refs.clear()  # one reference alive at a time
            ref_fn = clip_reference if family == "clip" else siglip_reference
            constants = (SCALE[family],) if family == "clip" else (SCALE[family], BIAS)
            refs[case] = ref_fn(image, text, *constants)
        try:
            loss_fn = make_loss(family, impl, precision, naive)
            result = measure(loss_fn, family, image, text, scale, bias, dev, smoke)
        except Exception as e:  # noqa: BLE001 - a failure is a result of its row; the next row runs
            result = {"ms": "OOM" if is_oom(e) else f"error: {type(e).__name__}: {str(e)[:100]}"}
        got = result.pop("got", None)
        flops = (8 if family == "clip" else 6) * n * n * d
        if isinstance(result.get("ms"), float):
            result["tflops"] = round(flops / result["ms"] / 1e9, 1)
            if want_error and got is not None:
                result["max_rel_err"] = f"{max_rel_err(got, refs[case]):.1e}"
        rec.row("rows", **fields, **result)
        del image, text
        free_memory()


def measure(loss_fn, family, image, text, scale, bias, dev, smoke) -> dict:
    """Median forward + backward ms, peak GiB above the features, and the (loss, d_image, d_text) of one call.

    The first call (compilation, cuBLAS's choices) is the one whose peak is measured; at least three more are
    timed, up to ten or 1.5 s of them."""
    image.requires_grad_()
    text.requires_grad_()
    out = {}

    def step():
        image.grad = text.grad = None
        loss = call(loss_fn, family, image, text, scale, bias)
        loss.backward()
        out["loss"] = loss.detach()

    mib = peak_mib(step, dev)
    got = (out["loss"], image.grad, text.grad)
    ms = time_ms(step, dev, warmup=0, repeats=1 if smoke else 10, max_s=1.5)
    return {
        "ms": round(ms, 2),
        "peak_gib": None if mib is None else round(mib / 1024, 3),
        "got": got,
    }


if __name__ == "__main__":
    main()
