"""What DCP's plan cache saves per checkpoint: bigclip's cached planner (bigclip/ckpt/dcp_layout.py) vs DCP's
default planner, side by side on the same gloo ranks and the same state.

    python bench/dcp_plan_cache.py [--ranks 2,4] [--model ViT-bigG-14] [--saves 6]

Each rank holds its share of the model's AdamW state as DDP's split gives it (every parameter, exp_avg, exp_avg_sq
and step, dealt out by size as bigclip does), each tensor shrunk to 8 elements so that a save's time is its
planning (the local plans gathered on the coordinator, the global plan scattered back, the metadata) and not its
bytes. Printed: the median seconds of the saves after the first, per planner and world size, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from ranks import free_port
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bigclip.ckpt.dcp_layout import _CachedPlanner, forget_plans, split_replicated  # noqa: E402


def adamw_state_names(model: str) -> list[str]:
    """The FQNs of the model's parameters (built on meta, nothing allocated)."""
    from bigclip.model import create_model

    with torch.device("meta"):
        return [name for name, _ in create_model(model).named_parameters()]


def _worker(rank: int, world: int, port: int, names: list[str], saves: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    tiny = {name: torch.zeros(8) for name in names}
    state = {
        "model": tiny,
        "optimizer": {
            "state": {
                n: {"exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8), "step": torch.zeros(())} for n in names
            }
        },  # fmt: skip
    }
    share = split_replicated(state, rank, world)
    times: dict[str, list[float]] = {}
    for label in ("default", "cached"):
        times[label] = []
        for save in range(saves):
            planner = DefaultSavePlanner() if label == "default" else _CachedPlanner("bench")
            writer = FileSystemWriter(os.path.join(root, f"{label}-{save}"), single_file_per_rank=True)
            dist.barrier(group)
            start = time.perf_counter()
            dcp.save(share, storage_writer=writer, planner=planner, process_group=group)
            times[label].append(time.perf_counter() - start)
        forget_plans("bench")
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--model", default="ViT-bigG-14")
    p.add_argument("--saves", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    names = adamw_state_names(args.model)
    print(f"{args.model}: {len(names)} parameters, {4 * len(names)} AdamW state tensors (8 elements each)")
    print("| ranks | default planner (s per save) | bigclip's cached planner | cached / default |")
    print("|---:|---:|---:|---:|")
    for world in (int(r) for r in args.ranks.split(",")):
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
            out = os.path.join(root, "times.pt")
            mp.start_processes(_worker, args=(world, free_port(), names, args.saves, root, out), nprocs=world,
                               start_method="spawn")  # fmt: skip
            times = torch.load(out)
        default, cached = (statistics.median(times[k][1:]) for k in ("default", "cached"))
        print(f"| {world} | {default:.3f} | {cached:.3f} | {cached / default:.2f} |")


if __name__ == "__main__":
    main()
