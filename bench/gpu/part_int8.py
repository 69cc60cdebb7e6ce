"""GPU kit, int8 and fp8: each SwitchBack variant (--use-bnb-linear), torchao.float8 (--use-fp8-linear
tensorwise / rowwise) and torchao's int8 mixed-precision training (a peer) vs bf16 nn.Linear, forward +
backward, at ViT-H and ViT-bigG MLP shapes with 16384 and 65536 tokens; ViT-H-14's image tower step with each;
the Triton kernels checked against the CPU (torch) path on the same inputs.

Tables (long form): `layers` and `tower` rows have impl, shape, tokens, ms, speedup_vs_bf16, peak_gib (peak
allocated during one forward + backward above what was allocated before it); `matmuls` times the int8 matmul
alone (ours, with its dequantising epilogue, and torch._int_mm) beside bf16's; `reference` is the GPU-vs-CPU
check. Every arm runs under bf16 autocast with fp32 weights (what --precision amp_bf16 runs) except
torchao-int8, whose weights are bf16 (torchao's recipe: pure bf16 training).
"""

from __future__ import annotations

from functools import partial

import torch
from common import Recorder, device, free_memory, is_oom, part_args, peak_mib, time_ms
from int8_linear import GPU_ARMS, INT8_MATMULS, SHAPES, make_layer, reset_int8_matmuls

from bigclip.model import create_model, get_model_config
from bigclip.model.switchback import VARIANTS


def _one_step(layer, x, grad, autocast: bool):
    def one():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.backward(grad.to(y.dtype))
        layer.zero_grad(set_to_none=True)
        x.grad = None

    return one


def layer_rows(rec: Recorder, tokens: int, repeats: int, dev: torch.device, arms, shrink: int = 1) -> None:
    for d_in, d_out in SHAPES.values():
        d_in, d_out = d_in // shrink, d_out // shrink
        base = None
        for arm in arms:
            label = f"{d_in}x{d_out}"
            try:
                torch.manual_seed(0)
                bf16_weights = arm == "torchao-int8"
                x = torch.randn(tokens, d_in, device=dev, dtype=torch.bfloat16 if bf16_weights else None)
                x.requires_grad_(True)
                grad = torch.randn(tokens, d_out, device=dev)
                layer = make_layer(arm, d_in, d_out, dev)
                one = _one_step(layer, x, grad, autocast=not bf16_weights)
                reset_int8_matmuls()
                ms = time_ms(one, dev, warmup=3, repeats=repeats)
                calls = sum(INT8_MATMULS.values()) // max(1, repeats + 3)
                mib = peak_mib(one, dev)
                base = ms if arm == "bf16" else base
                rec.row(
                    "layers",
                    impl=arm,
                    shape=label,
                    tokens=tokens,
                    ms=round(ms, 3),
                    speedup_vs_bf16=None if base is None else round(base / ms, 3),
                    peak_gib=None if mib is None else round(mib / 1024, 3),
                    int8_matmuls=calls,
                )
            except Exception as e:  # noqa: BLE001 - one arm failing is a finding; the others still run
                rec.row("layers", impl=arm, shape=label, tokens=tokens,
                        ms="OOM" if is_oom(e) else f"error: {type(e).__name__}: {str(e)[:160]}")  # fmt: skip
            layer = x = grad = one = None
            free_memory()


def matmul_rows(rec: Recorder, tokens: int, dev: torch.device, shrink: int = 1) -> None:
    """The forward's matmul alone: bf16 x @ w.t(), bigclip's int8 kernel with its epilogue (bf16 out), and
    torch._int_mm (int32 out, no dequantisation): how far the int8 matmul itself is from the tensor cores."""
    from bigclip.model.switchback import _ops_for

    for d_in, d_out in SHAPES.values():
        d_in, d_out = d_in // shrink, d_out // shrink
        torch.manual_seed(0)
        x = torch.randn(tokens, d_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d_out, d_in, device=dev, dtype=torch.bfloat16)
        ops = _ops_for(x)
        x_q, x_s = ops.quantize_rowwise(x)
        w_q, _, w_s = ops.quantize_global_pair(w, transposed=False)
        bias = torch.zeros(d_out, device=dev, dtype=torch.bfloat16)
        flops = 2 * tokens * d_in * d_out
        arms = {
            "bf16 matmul": partial(torch.matmul, x, w.t()),
            "int8 matmul + epilogue (bigclip)": partial(ops.int8_matmul_dequant, x_q, w_q.t(), x_s, w_s, bias, x.dtype),
            "int8 matmul (torch._int_mm, int32 out)": partial(torch._int_mm, x_q, w_q.t()),
            "quantize X row-wise": partial(ops.quantize_rowwise, x),
        }
        base = None
        for name, fn in arms.items():
            try:
                ms = time_ms(fn, dev, warmup=3, repeats=20)
            except Exception as e:  # noqa: BLE001
                rec.row("matmuls", op=name, shape=f"{d_in}x{d_out}", tokens=tokens, ms=f"error: {str(e)[:120]}")
                continue
            base = ms if name == "bf16 matmul" else base
            rec.row("matmuls", op=name, shape=f"{d_in}x{d_out}", tokens=tokens, ms=round(ms, 4),
                    speedup_vs_bf16=round(base / ms, 3),
                    tops=None if name.startswith("quantize") else round(flops / ms / 1e9, 1))  # fmt: skip
        x = w = x_q = w_q = None
        free_memory()


def reference_rows(rec: Recorder, dev: torch.device) -> None:
    """Each SwitchBack variant on the GPU (Triton) against the same layer on the CPU (torch path), same bf16
    inputs: outputs and input gradients within 1 bf16 ulp (the GPU may fuse the epilogue's multiply-add),
    weight gradients (cuBLAS vs CPU bf16 matmuls, different summation orders) within 1% of their norm."""
    if dev.type != "cuda":
        return
    tokens, d_in, d_out = 512, 1280, 640
    torch.manual_seed(0)
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16)
    grad = torch.randn(tokens, d_out, dtype=torch.bfloat16)
    for variant in VARIANTS:
        outs = {}
        for where in ("cpu", "cuda"):
            layer = make_layer(variant, d_in, d_out, torch.device("cpu")).to(torch.bfloat16)
            layer = layer.to(where)
            xi = x.to(where).requires_grad_(True)
            y = layer(xi)
            y.backward(grad.to(where))
            outs[where] = [t.detach().cpu() for t in (y, xi.grad, layer.weight.grad.float())]
        (y_c, gx_c, gw_c), (y_g, gx_g, gw_g) = outs["cpu"], outs["cuda"]
        w_err = ((gw_g - gw_c).norm() / gw_c.norm()).item()
        ok = _ulps(y_g, y_c) <= 1 and _ulps(gx_g, gx_c) <= 1 and w_err < 0.01
        rec.row("reference", impl=variant, max_ulps_out=_ulps(y_g, y_c), max_ulps_grad_x=_ulps(gx_g, gx_c),
                rel_err_grad_w=f"{w_err:.2e}", ok=ok)  # fmt: skip


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""

    def ordered(t):
        i = t.view(torch.int16).long()
        return torch.where(i < 0, -(2**15) - i, i)

    return int((ordered(a) - ordered(b)).abs().max())


def tower_rows(rec: Recorder, model_name: str, batch: int, repeats: int, dev: torch.device, arms) -> None:
    size = get_model_config(model_name)["vision_cfg"]["image_size"]
    images = torch.randn(batch, 3, size, size, device=dev)
    tokens = None
    base = None
    for arm in arms:
        try:
            torch.manual_seed(0)
            int8 = arm if arm in VARIANTS else None
            fp8 = arm.removeprefix("fp8-") if arm.startswith("fp8-") else None
            visual = create_model(model_name, int8_linear=int8, fp8_linear=fp8, device=dev).visual
            tokens = tokens or batch * _tokens(visual, images[:1])

            def one(visual=visual):
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    out = visual(images)
                out.float().square().mean().backward()
                visual.zero_grad(set_to_none=True)

            ms = time_ms(one, dev, warmup=2, repeats=repeats)
            mib = peak_mib(one, dev)
            base = ms if arm == "bf16" else base
            rec.row("tower", impl=arm, shape=f"{model_name} tower", tokens=tokens, batch=batch, ms=round(ms, 2),
                    speedup_vs_bf16=None if base is None else round(base / ms, 3),
                    peak_gib=None if mib is None else round(mib / 1024, 3))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one arm failing is a finding; the others still run
            rec.row("tower", impl=arm, shape=f"{model_name} tower", batch=batch,
                    ms="OOM" if is_oom(e) else f"error: {type(e).__name__}: {str(e)[:160]}")  # fmt: skip
        visual = one = None
        free_memory()


def _tokens(visual, image) -> int:
    """Tokens per image the MLPs see (patches + prefix tokens), read off the first block's input."""
    seen = []
    block = next(m for n, m in visual.named_modules() if n.endswith("blocks.0"))
    handle = block.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[1]))
    with torch.no_grad():
        visual(image)
    handle.remove()
    return seen[0]


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    arms = GPU_ARMS if dev.type == "cuda" else tuple(a for a in GPU_ARMS if not a.startswith(("fp8", "torchao")))
    if args.smoke:
        layer_rows(rec, tokens=16, repeats=1, dev=dev, arms=arms, shrink=16)  # the same arms at 1/16 of the widths
        matmul_rows(rec, tokens=16, dev=dev, shrink=16)
        tower_rows(rec, "test-tiny", batch=4, repeats=1, dev=dev, arms=arms)
        return
    reference_rows(rec, dev)
    for tokens in (16384, 65536):  # ViT-H/14 at 224 px: 257 tokens x batch 64 = 16448
        matmul_rows(rec, tokens, dev)
        layer_rows(rec, tokens=tokens, repeats=10, dev=dev, arms=arms)
    tower_rows(rec, "ViT-H-14", batch=64, repeats=5, dev=dev, arms=arms)


if __name__ == "__main__":
    main()
