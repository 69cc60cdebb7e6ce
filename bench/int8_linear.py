"""One linear layer, forward + backward, at ViT-H/bigG MLP shapes: nn.Linear in fp32 and bf16 vs StandardLinear
and each SwitchBack variant (bigclip/model/switchback.py), side by side in one run.

    python bench/int8_linear.py                          # CPU: tokens 512, shapes 1280->5120, 5120->1280, 1664->8192
    python bench/int8_linear.py --tokens 8192 --repeats 20   # on a GPU node (CUDA: the Triton kernels)

Arms: `linear-fp32` (nn.Linear, fp32), `bf16` (nn.Linear under bf16 autocast, fp32 weights: what
--precision amp_bf16 runs), `StandardLinear` and the SwitchBack variants, all under the same bf16 autocast
(the int8 layers quantize from the bf16 activations, as in the paper). Time: median of --repeats timed
forward+backward passes after 2 warm-up passes, input requiring grad (so all three matmuls run). Memory:
the bytes the layer keeps for its backward (torch.autograd.graph.saved_tensors_hooks, each storage once:
what MemEfficient saves), and on CUDA the peak allocated during the pass above what was allocated before.
Ratios are against bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bigclip.model.switchback import INT8_MATMULS, VARIANTS, replace_linears, reset_int8_matmuls  # noqa: E402

SHAPES = {
    "ViT-H fc1": (1280, 5120),
    "ViT-H fc2": (5120, 1280),
    "ViT-bigG fc1": (1664, 8192),
    "ViT-bigG fc2": (8192, 1664),
}
ARMS = ("linear-fp32", "bf16", *VARIANTS)
# The GPU kit's arms: fp8 through torchao.float8 (--use-fp8-linear) and torchao's int8 mixed-precision training
# (a peer: bf16 weights, int8 matmuls in all three products) need CUDA.
GPU_ARMS = ("bf16", *VARIANTS, "fp8-tensorwise", "fp8-rowwise", "torchao-int8")


def make_layer(arm: str, d_in: int, d_out: int, device: torch.device) -> nn.Module:
    """One MLP linear as `arm` runs it ("bf16" and "linear-fp32" are plain nn.Linear; autocast decides)."""
    holder = nn.Module()
    holder.c_fc = nn.Linear(d_in, d_out, device=device)
    if arm in VARIANTS:
        replace_linears(holder, arm, ("c_fc",))
    elif arm.startswith("fp8-"):
        from bigclip.model.fp8_linear import replace_linears_fp8

        replace_linears_fp8(holder, arm.removeprefix("fp8-"))
    elif arm == "torchao-int8":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        holder.to(torch.bfloat16)
        quantize_(holder, int8_mixed_precision_training())
    return holder.c_fc


def saved_bytes(layer: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward (weights included)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            layer(x).sum().backward()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def timed(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool, repeats: int) -> tuple[float, int]:
    device = x.device

    def one() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.backward(grad.to(y.dtype))
        layer.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(2):
        one()
    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512, help="rows of X (batch x sequence)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, tokens {args.tokens}, "
          f"median of {args.repeats}")  # fmt: skip
    print()
    header = "| shape | arm | fwd+bwd ms | speed vs bf16 | int8 matmuls | saved for backward (MiB) | vs bf16 |"
    print(header + (" CUDA peak (MiB) |" if device.type == "cuda" else ""))
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|" if device.type == "cuda" else ""))
    for shape in args.shapes:
        d_in, d_out = SHAPES[shape]
        torch.manual_seed(0)
        x = torch.randn(args.tokens, d_in, device=device, requires_grad=True)
        grad = torch.randn(args.tokens, d_out, device=device)
        results = {}
        for arm in ARMS:
            layer = make_layer(arm, d_in, d_out, device)
            autocast = arm != "linear-fp32"
            kept = saved_bytes(layer, x, autocast)
            reset_int8_matmuls()
            seconds, peak = timed(layer, x, grad, autocast, args.repeats)
            calls = sum(INT8_MATMULS.values()) // (args.repeats + 2)
            results[arm] = (seconds, kept, peak, calls)
        base_s, base_kept = results["bf16"][:2]
        for arm, (seconds, kept, peak, calls) in results.items():
            row = (f"| {shape} {d_in}->{d_out} | {arm} | {seconds * 1e3:.1f} | {base_s / seconds:.2f}x | {calls} | "
                   f"{kept / 2**20:.1f} | {kept / base_kept:.2f}x |")  # fmt: skip
            if device.type == "cuda":
                row += f" {peak / 2**20:.0f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
