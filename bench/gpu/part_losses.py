"""GPU kit, losses: bigclip's Triton CLIP and SigLIP kernels vs its chunked torch path vs the naive path
(open_clip's own ClipLoss / SigLipLoss), forward + backward, at N = 4096, 16384, 65536 and d = 1024, in bf16
and fp32: median ms, peak memory above the features, and at the smallest N the relative error of the loss and
of the feature gradients against open_clip's loss computed in float64.

The naive path is tried at every N and reported as out of memory where the N x N matrices do not fit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Recorder, device, free_memory, is_oom, part_args, peak_mib, time_ms

from bigclip.loss import ClipLoss, SigLipLoss


def naive_losses():
    import open_clip

    return {"clip": open_clip.loss.ClipLoss(), "siglip": open_clip.loss.SigLipLoss()}


def make_loss(family: str, impl: str, naive: dict):
    if impl == "naive":
        return naive[family]
    return ClipLoss(impl=impl) if family == "clip" else SigLipLoss(impl=impl)


def inputs(n: int, d: int, dtype: torch.dtype, dev: torch.device, family: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    # Text features correlated with the images, as after some training: the loss is not at its random value.
    text = F.normalize(image + 0.8 * torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    scale = torch.tensor(10.0 if family == "siglip" else 30.0, dtype=torch.float64)
    bias = torch.tensor(-10.0, dtype=torch.float64) if family == "siglip" else None
    cast = lambda t: None if t is None else t.to(dev, dtype if t.dim() else torch.float32)
    return cast(image), cast(text), cast(scale), cast(bias)


def call(loss_fn, family: str, image, text, scale, bias):
    return loss_fn(image, text, scale) if family == "clip" else loss_fn(image, text, scale, bias)


def loss_and_grads(loss_fn, family, image, text, scale, bias):
    image, text = image.detach().clone().requires_grad_(), text.detach().clone().requires_grad_()
    loss = call(loss_fn, family, image, text, scale, bias)
    loss.backward()
    return loss.detach().double(), image.grad.double(), text.grad.double()


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.cpu() - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-30))


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    sizes, d, repeats = ((64,), 32, 1) if args.smoke else ((4096, 16384, 65536), 1024, 10)
    impls = ("triton", "chunked", "naive")
    naive = naive_losses()
    for family in ("clip", "siglip"):  # accuracy at the smallest N, against open_clip's loss in float64 on the CPU
        n = sizes[0]
        ref = loss_and_grads(naive[family], family, *inputs(n, d, torch.float64, torch.device("cpu"), family))
        for dtype in (torch.float32, torch.bfloat16):
            for impl in impls:
                got = loss_and_grads(make_loss(family, impl, naive), family, *inputs(n, d, dtype, dev, family))
                rec.row(
                    "accuracy",
                    loss=family,
                    impl=impl,
                    dtype=str(dtype).removeprefix("torch."),
                    N=n,
                    loss_rel_err=f"{rel(got[0], ref[0]):.1e}",
                    image_grad_rel_err=f"{rel(got[1], ref[1]):.1e}",
                    text_grad_rel_err=f"{rel(got[2], ref[2]):.1e}",
                )
    for n in sizes:  # every family at each N before the next N: the largest N is the likeliest to run out of time
        for family in ("clip", "siglip"):
            for dtype in (torch.bfloat16, torch.float32):
                for impl in impls:
                    fields = dict(loss=family, N=n, dtype=str(dtype).removeprefix("torch."), impl=impl)
                    loss_fn = make_loss(family, impl, naive)
                    rec.row("speed", **fields, **speed(loss_fn, family, inputs(n, d, dtype, dev, family), dev, repeats))
                    free_memory()


def speed(loss_fn, family: str, features, dev: torch.device, repeats: int) -> dict:
    """Median forward + backward ms and peak MiB above the features; "OOM" where the path does not fit."""
    image, text, scale, bias = features
    image.requires_grad_()
    text.requires_grad_()
    step = lambda: call(loss_fn, family, image, text, scale, bias).backward()
    try:
        ms = time_ms(step, dev, warmup=1 if dev.type == "cpu" else 2, repeats=repeats)
        image.grad = text.grad = None
        mib = peak_mib(step, dev)
    except Exception as e:  # noqa: BLE001 - out of memory is a result; anything else too, per row
        return {"fwd_bwd_ms": "OOM" if is_oom(e) else f"error: {str(e)[:80]}"}
    return {"fwd_bwd_ms": round(ms, 2), "peak_mib": None if mib is None else round(mib)}


if __name__ == "__main__":
    main()
