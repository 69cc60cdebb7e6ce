"""GPU kit, int8: each SwitchBack variant (and StandardLinear) vs bf16 nn.Linear at ViT-H and ViT-bigG MLP
shapes (tokens x 1280->5120, 5120->1280, 1664->8192), forward + backward ms and memory; then ViT-H-14's whole
image tower (32 blocks) forward + backward with and without --use-bnb-linear.

Layer arms and their memory figures are bench/int8_linear.py's (saved-for-backward bytes; CUDA peak above the
inputs); every arm runs under bf16 autocast except linear-fp32.
"""

from __future__ import annotations

import torch
from common import Recorder, device, free_memory, is_oom, part_args, peak_mib, time_ms
from int8_linear import ARMS, INT8_MATMULS, SHAPES, make_layer, reset_int8_matmuls, saved_bytes

from bigclip.model import create_model, get_model_config
from bigclip.model.switchback import VARIANTS


def layer_rows(rec: Recorder, tokens: int, repeats: int, dev: torch.device, shrink: int = 1) -> None:
    for shape, (d_in, d_out) in SHAPES.items():
        d_in, d_out = d_in // shrink, d_out // shrink
        torch.manual_seed(0)
        x = torch.randn(tokens, d_in, device=dev, requires_grad=True)
        grad = torch.randn(tokens, d_out, device=dev)
        base = None
        for arm in ARMS:
            layer = make_layer(arm, d_in, d_out, dev)
            autocast = arm != "linear-fp32"

            def one(layer=layer, autocast=autocast, x=x, grad=grad):
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                    y = layer(x)
                y.backward(grad.to(y.dtype))
                layer.zero_grad(set_to_none=True)
                x.grad = None

            kept = saved_bytes(layer, x, autocast)
            reset_int8_matmuls()
            ms = time_ms(one, dev, warmup=2, repeats=repeats)
            int8_calls = sum(INT8_MATMULS.values()) // (repeats + 2)
            mib = peak_mib(one, dev)
            base = ms if arm == "linear-bf16" else base
            rec.row(
                "layers",
                shape=f"{shape} {d_in}->{d_out}",
                tokens=tokens,
                arm=arm,
                fwd_bwd_ms=round(ms, 3),
                speed_vs_bf16=None if base is None else f"{base / ms:.2f}x",
                int8_matmuls=int8_calls,
                saved_for_backward_mib=round(kept / 2**20, 1),
                peak_mib=None if mib is None else round(mib),
            )


def tower_rows(rec: Recorder, model_name: str, batch: int, repeats: int, dev: torch.device) -> None:
    size = get_model_config(model_name)["vision_cfg"]["image_size"]
    images = torch.randn(batch, 3, size, size, device=dev)
    base = None
    for variant in (None, *VARIANTS):
        try:
            torch.manual_seed(0)
            visual = create_model(model_name, int8_linear=variant, device=dev).visual
            replaced = sum(type(m).__name__ == variant for m in visual.modules()) if variant else 0

            def one(visual=visual):
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    out = visual(images)
                out.float().square().mean().backward()
                visual.zero_grad(set_to_none=True)

            ms = time_ms(one, dev, warmup=2, repeats=repeats)
            mib = peak_mib(one, dev)
            base = ms if variant is None else base
            rec.row(
                "image tower",
                model=model_name,
                batch=batch,
                use_bnb_linear=variant or "(none: nn.Linear, bf16 autocast)",
                linears_replaced=replaced,
                fwd_bwd_ms=round(ms, 1),
                speed_vs_linear=f"{base / ms:.2f}x",
                peak_mib=None if mib is None else round(mib),
            )
        except Exception as e:  # noqa: BLE001 - one variant failing is a finding; the others still run
            rec.row("image tower", model=model_name, batch=batch, use_bnb_linear=variant or "(none)",
                    fwd_bwd_ms="OOM" if is_oom(e) else f"error: {str(e)[:100]}")  # fmt: skip
        visual = None
        free_memory()


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    if args.smoke:
        layer_rows(rec, tokens=16, repeats=1, dev=dev, shrink=16)  # the same arms at 1/16 of the widths
        tower_rows(rec, "test-tiny", batch=4, repeats=1, dev=dev)
    else:
        layer_rows(rec, tokens=16384, repeats=10, dev=dev)  # ViT-H/14 at 224 px: 257 tokens x batch 64
        tower_rows(rec, "ViT-H-14", batch=64, repeats=5, dev=dev)


if __name__ == "__main__":
    main()
