"""--eval-ema's swap of the moving average into the weights: the memory it takes beside the model and its time,
against a copy of every live weight (how bigclip swapped until 2026-11-29), on the same model and average.

    python bench/ema_swap.py                      # ViT-B-32 on this CPU, float32 and bf16 weights
    python bench/ema_swap.py --model ViT-L-14

Measured: the process's resident memory above its level before the swap (Linux's VmHWM, reset through
/proc/self/clear_refs; glibc returns freed allocations of 64 KiB+ to the system, set below, so resident memory
follows live bytes) and the median wall time of a swap in and back. float32 weights exchange values with the
average tensor by tensor (engine/ema.py); bf16 weights are stashed, in host memory on an accelerator, so on this
CPU their row still copies every weight (the stash is host memory here).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from ranks import reset_resident_peak, resident_bytes  # noqa: E402

from bigclip.dist import local_shard  # noqa: E402
from bigclip.engine.ema import WeightsEMA  # noqa: E402
from bigclip.engine.memory import peak_rss_bytes  # noqa: E402
from bigclip.model import create_model  # noqa: E402

MiB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@torch.no_grad()
def copy_every_weight(ema: WeightsEMA) -> None:
    """The previous swap: a copy of each live weight, the average written in, the copies written back."""
    params = dict(ema.model.named_parameters())
    live = {n: local_shard(p).clone() for n, p in params.items()}
    for name, p in params.items():
        local_shard(p).copy_(local_shard(ema.params[name]))
    for name, p in params.items():
        local_shard(p).copy_(live[name])


def exchange_or_stash(ema: WeightsEMA) -> None:
    with ema.swapped_in():
        pass


def measure(swap, ema: WeightsEMA, repeats: int) -> tuple[float, float]:
    """(MiB above the level before the swap, median seconds of one swap in and back)."""
    gc.collect()
    before = resident_bytes()
    reset_resident_peak()
    swap(ema)
    above = peak_rss_bytes() - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        swap(ema)
        times.append(time.perf_counter() - start)
    return above / MiB, statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 << 10)
    torch.manual_seed(0)
    print(f"{args.model}, {torch.get_num_threads()} thread(s), CPU\n")
    print("| weights | model MiB | swap | MiB above the model | ratio | ms per swap in and back | ratio |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        model = create_model(args.model).to(dtype)
        ema = WeightsEMA(model, 0.999)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param), alpha=1e-3)  # the weights moved away from the average
        weights = sum(q.numel() * q.element_size() for q in model.parameters()) / MiB
        old_mib, old_s = measure(copy_every_weight, ema, args.repeats)
        new_mib, new_s = measure(exchange_or_stash, ema, args.repeats)
        name = str(dtype).removeprefix("torch.")
        print(f"| {name} | {weights:.0f} | a copy of every weight | {old_mib:.0f} | 1.00 | {old_s * 1e3:.0f} | 1.00 |")
        ratio = new_mib / max(old_mib, 1e-9)
        print(
            f"| {name} | {weights:.0f} | exchange (float32) / stash | {new_mib:.0f} | {ratio:.2f} "
            f"| {new_s * 1e3:.0f} | {new_s / old_s:.2f} |"
        )
        del model, ema
    return 0


if __name__ == "__main__":
    sys.exit(main())
