"""What each memory lever costs on a GPU, one at a time: ViT-bigG-14 (by default) under FSDP2 with
--grad-checkpointing at a fixed batch: amp_bf16 + AdamW (the reference), pure bf16 weights + AdamW, then + 8-bit
moments, then + the optimizer in the backward (without the 8-bit moments), and all levers together (the leanest).
Not a kit part (about 150 s on an H100 for bigG at batch 64); run it on the GPU machine with the kit's wheels:

    site=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --target $site bench/gpu/wheels/*.whl
    PYTHONPATH=$site python3 bench/gpu/giant_levers.py [--model ViT-bigG-14] [--batch 64] [--profile]

Prints one JSON line per setup: seconds per step (median after the first), every step's time, peak memory, its
ratio to amp_bf16 + AdamW's step (issue 41's target: <= 1.10). With --profile, one more step of each setup runs
under torch.profiler and its row adds the top operations by self device time (CPU time on a CPU) and the number
of calls of the compiled optimizer update.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from common import device, free_memory
from part_giant import harness, train_steps  # bench/harness.py, importable once common has set the path

from bigclip.dist import World

LEVERS = {
    "amp_bf16, adamw": {"precision": "amp_bf16", "opt": "adamw"},
    "pure_bf16, adamw": {"precision": "pure_bf16", "opt": "adamw"},
    "pure_bf16, adamw8bit": {"precision": "pure_bf16", "opt": "adamw8bit"},
    "pure_bf16, adamw, optimizer in backward": {
        "precision": "pure_bf16",
        "opt": "adamw",
        "optimizer_in_backward": True,
    },
    "pure_bf16, adamw8bit, optimizer in backward (leanest)": {
        "precision": "pure_bf16",
        "opt": "adamw8bit",
        "optimizer_in_backward": True,
    },
}
TOP_OPERATIONS = 12


def profile_step(model: str, batch: int, world: World, flags: dict) -> dict:
    """One step after two warm-up steps, under torch.profiler: the top operations by self device time (CPU time
    without a GPU) and the calls of the compiled window update (bigclip/optim/packed_update.py)."""
    cfg = harness.config(model=model, batch_size=batch, lr=1e-5, engine="fsdp", grad_checkpointing=True, **flags)
    bench = harness.build(cfg, world)
    data = list(harness.synthetic_batches(cfg, world, 3, seed=0))
    for images, texts in data[:2]:
        bench.step(images, texts)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if world.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        bench.step(*data[2])
    events = prof.key_averages()
    on_device = world.device.type == "cuda"
    time_of = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)  # noqa: E731
    top = sorted(events, key=time_of, reverse=True)[:TOP_OPERATIONS]
    updates = sum(e.count for e in events if e.key == "bigclip.packed_adamw_window")  # packed_update.PROFILER_LABEL
    return {
        "profile_clock": "device" if on_device else "cpu",
        "profile_top": [{"name": e.key[:80], "ms": round(time_of(e) / 1e3, 2), "calls": e.count} for e in top],
        "window_update_calls": updates,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-bigG-14")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="one more step per setup under torch.profiler")
    args = p.parse_args()
    world = World(device=device())
    reference = None
    for name, flags in LEVERS.items():
        free_memory()
        if world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, peak, _, _ = train_steps(args.model, args.batch, args.steps, world, flags)
        step = statistics.median(times[1:])
        reference = reference or step  # amp_bf16 + AdamW, the first setup
        row = dict(model=args.model, batch=args.batch, setup=name, s_per_step=round(step, 3),
                   vs_amp=round(step / reference, 3), times=[round(t, 3) for t in times],
                   peak_gib=round(peak / 2**30, 2))  # fmt: skip
        if args.profile:
            free_memory()
            row.update(profile_step(args.model, args.batch, world, flags))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
