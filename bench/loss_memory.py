"""Peak memory and time of the CLIP loss, forward + backward: naive vs chunked, side by side.

    python bench/loss_memory.py                       # N = 4096 ... 65536, d = 512, fp32, CPU
    python bench/loss_memory.py --sizes 4096 8192 --dim 256

Each (N, impl) runs in a fresh child process so that peak RSS (resource.getrusage) belongs to
that run alone. "loss memory" is the child's peak RSS minus its RSS just before the loss call,
when the features already exist: the memory the loss itself needs (logits, tiles, statistics
and the feature gradients, which both paths allocate). Children run with
MALLOC_MMAP_THRESHOLD_=1048576 so that RSS follows live allocations (see run_child).
The naive path is skipped above --naive-max-gb of estimated need (OpenCLIP's recipe holds about
four N x N fp32 matrices at once).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

NAIVE_BYTES_PER_LOGIT = 4 * 4  # four live N x N float32 matrices (logits, their transpose's CE, grads)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(n: int, dim: int, impl: str, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from bigclip.loss import ClipLoss

    torch.manual_seed(seed)
    loss_fn = ClipLoss(impl=impl)
    # Warm up the code paths on a tiny batch so one-time setup is not timed.
    small = [F.normalize(torch.randn(64, dim), dim=-1).requires_grad_() for _ in range(2)]
    loss_fn(*small, torch.tensor(10.0, requires_grad=True)).backward()

    image = F.normalize(torch.randn(n, dim), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(n, dim), dim=-1).requires_grad_()
    scale = torch.tensor(10.0, requires_grad=True)
    before = _rss_bytes()
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    loss = loss_fn(image, text, scale)
    loss.backward()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"loss": loss.item(), "seconds": seconds, "cpu": cpu, "peak": peak, "extra": peak - before}


def _cpu_seconds() -> float:
    # CPU time of all threads: steadier than wall time when other jobs share the cores.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(n: int, dim: int, impl: str, seed: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--sizes",
        str(n),
        "--dim",
        str(dim),
        "--impl",
        impl,
        "--seed",
        str(seed),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    # glibc keeps freed blocks below its (self-raising) mmap threshold resident, so RSS would
    # depend on allocation history; a fixed 1 MiB threshold returns every large buffer to the OS
    # when freed and peak RSS measures the memory actually alive at the peak. Same for both paths.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gb(b: float) -> str:
    return f"{b / 2**30:.2f} GB" if b >= 2**30 else f"{b / 2**20:.0f} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--naive-max-gb", type=float, default=12.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default="chunked")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.sizes[0], args.dim, args.impl, args.seed)))
        return

    print(f"CLIP loss forward+backward, d={args.dim}, fp32, CPU ({os.cpu_count()} cores)")
    header = (
        "| N | naive loss memory | chunked loss memory | memory ratio "
        "| naive time | chunked time | time ratio "
        "| naive CPU time | chunked CPU time | CPU time ratio "
        "| naive peak RSS | chunked peak RSS | loss rel. diff |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    results = {}
    for n in args.sizes:
        need = NAIVE_BYTES_PER_LOGIT * n * n
        naive = run_child(n, args.dim, "naive", args.seed) if need <= args.naive_max_gb * 2**30 else None
        chunked = run_child(n, args.dim, "chunked", args.seed)
        results[n] = (naive, chunked)
        if "error" in chunked:
            print(f"| {n} | chunked failed: {chunked['error']} |")
            continue
        if naive is None or "error" in naive:
            why = f"n/a (needs {need / 2**30:.0f} GB)" if naive is None else f"failed: {naive['error']}"
            print(
                f"| {n} | {why} | {_gb(chunked['extra'])} | | | {chunked['seconds']:.1f} s | | | "
                f"{chunked['cpu']:.1f} s | | | {_gb(chunked['peak'])} | |"
            )
            continue
        rel = abs(naive["loss"] - chunked["loss"]) / abs(naive["loss"])
        print(
            f"| {n} | {_gb(naive['extra'])} | {_gb(chunked['extra'])} | "
            f"1/{naive['extra'] / chunked['extra']:.0f} | "
            f"{naive['seconds']:.1f} s | {chunked['seconds']:.1f} s | "
            f"{chunked['seconds'] / naive['seconds']:.2f}x | {naive['cpu']:.1f} s | {chunked['cpu']:.1f} s | "
            f"{chunked['cpu'] / naive['cpu']:.2f}x | "
            f"{_gb(naive['peak'])} | {_gb(chunked['peak'])} | {rel:.1e} |"
        )
        sys.stdout.flush()
    report_targets(results)


def report_targets(results: dict) -> None:
    """The issue's targets: at N=16384 <= 1/20 of naive memory and <= 1.5x its time; N=65536 < 2 GB."""
    print()
    if 16384 in results:
        naive, chunked = results[16384]
        if naive and "error" not in naive and "error" not in chunked:
            memory = naive["extra"] / chunked["extra"]
            wall = chunked["seconds"] / naive["seconds"]
            cpu = chunked["cpu"] / naive["cpu"]
            print(
                f"N=16384: chunked loss memory 1/{memory:.0f} of naive (target <= 1/20): "
                f"{'met' if memory >= 20 else 'MISSED'}; time {wall:.2f}x wall, {cpu:.2f}x CPU "
                f"(target <= 1.5x): {'met' if max(wall, cpu) <= 1.5 else 'MISSED'}"
            )
    if 65536 in results and "error" not in results[65536][1]:
        peak = results[65536][1]["peak"]
        print(
            f"N=65536: chunked peak RSS of the whole process {_gb(peak)} (target < 2 GB): "
            f"{'met' if peak < 2 * 2**30 else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
