"""Per-rank memory and time of the distributed contrastive losses at a fixed per-rank batch, 2 and 4 gloo ranks
on CPU, side by side: the exchanges that move one rank's texts at a time (CLIP ring, SigLIP bidir and shift)
against the all-gather paths, whose memory grows with the world.

    python bench/loss_ranks.py                         # 2, 3, 4 ranks; B_local = 4096, d = 1024, fp32, chunked
    python bench/loss_ranks.py --batch 2048 --dim 512 --worlds 2 4

A rank's "loss memory" is its peak resident memory during one forward + backward minus its resident memory just
before the call (features made, the same loss warmed up on a tiny batch); glibc returns freed buffers of 1 MiB and
more to the system (bench/ranks.py), so resident memory follows live tensors. The table gives the largest rank's.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

CASES = [("clip", "gather"), ("clip", "ring"), ("siglip", "gather"), ("siglip", "bidir"), ("siglip", "shift")]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from bigclip.loss import LossConfig, build_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    cfg = LossConfig(loss=args.family, loss_impl=args.impl, loss_dist_impl=args.dist_impl,
                     local_loss=args.family == "clip", gather_with_grad=args.family == "clip")  # fmt: skip
    loss_fn = build_loss(cfg, rank, world)
    scale = torch.tensor(10.0, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True) if args.family == "siglip" else None

    def step(n: int) -> float:
        image = F.normalize(torch.randn(n, args.dim), dim=-1).requires_grad_()
        text = F.normalize(torch.randn(n, args.dim), dim=-1).requires_grad_()
        before = _rss()
        start = time.perf_counter()
        loss_fn(image, text, scale, bias).backward()
        return before, time.perf_counter() - start

    step(64)  # every code path and buffer the loss sets up once, outside the measurement
    dist.barrier()
    before, seconds = step(args.batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ranks.write_from_rank0({"extra": peak - before, "seconds": seconds}, args.out, world, rank)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4096, help="per-rank batch")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--impl", default="chunked")
    p.add_argument("--cases", nargs="+", default=[f"{f}:{d}" for f, d in CASES], help="family:dist_impl pairs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--family", default="clip", help=argparse.SUPPRESS)
    p.add_argument("--dist-impl", default="ring", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"Loss memory per rank (largest rank), B_local = {args.batch}, d = {args.dim}, fp32, --loss-impl {args.impl}")
    worlds = args.worlds
    header = ["family", "dist_impl"] + [f"{w} ranks" for w in worlds] + [f"s at {w}" for w in worlds]
    header += [f"{w} / {worlds[0]} ranks" for w in worlds[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for family, dist_impl in (case.split(":") for case in args.cases):
        mib, secs = [], []
        for world in worlds:
            worker_args = ["--family", family, "--dist-impl", dist_impl, "--batch", str(args.batch),
                           "--dim", str(args.dim), "--impl", args.impl]  # fmt: skip
            result = ranks.launch(__file__, world, worker_args, timeout=1800)
            if isinstance(result, str):
                mib.append(result)
                secs.append("")
                continue
            mib.append(max(r["extra"] for r in result) / 2**20)
            secs.append(max(r["seconds"] for r in result))
        ratios = [f"{m / mib[0]:.2f}x" if isinstance(m, float) and isinstance(mib[0], float) else "" for m in mib[1:]]
        cells = [f"{m:.0f} MiB" if isinstance(m, float) else m for m in mib]
        cells += [f"{s:.1f}" if isinstance(s, float) else s for s in secs]
        print(f"| {family} | {dist_impl} | " + " | ".join(cells + ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
