"""What each memory lever costs on a GPU, one at a time: ViT-bigG-14 (by default) under FSDP2 with
--grad-checkpointing at a fixed batch, with pure bf16 weights + AdamW, then + 8-bit moments, then + the optimizer
in the backward (without the 8-bit moments); the kit's giant part measures amp_bf16 AdamW and all levers together.
Not a kit part (about 90 s on an H100 for bigG at batch 64); run it on the GPU machine with the kit's wheels:

    site=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --target $site bench/gpu/wheels/*.whl
    PYTHONPATH=$site python3 bench/gpu/giant_levers.py [--model ViT-bigG-14] [--batch 64]

Prints one JSON line per setup: seconds per step (median after the first), every step's time, peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from common import device, free_memory
from part_giant import train_steps

from bigclip.dist import World

LEVERS = {
    "pure_bf16, adamw": {"precision": "pure_bf16", "opt": "adamw"},
    "pure_bf16, adamw8bit": {"precision": "pure_bf16", "opt": "adamw8bit"},
    "pure_bf16, adamw, optimizer in backward": {
        "precision": "pure_bf16",
        "opt": "adamw",
        "optimizer_in_backward": True,
    },
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-bigG-14")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    world = World(device=device())
    for name, flags in LEVERS.items():
        free_memory()
        if world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, peak, _, _ = train_steps(args.model, args.batch, args.steps, world, flags)
        row = dict(model=args.model, batch=args.batch, setup=name, s_per_step=round(statistics.median(times[1:]), 3),
                   times=[round(t, 3) for t in times], peak_gib=round(peak / 2**30, 2))  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
