"""Giant towers on a small machine: ViT-bigG-14 trained by 2 FSDP2 ranks on one 24 GB, 2-core CPU machine.

    python bench/giant_on_small.py                                   # the bigG demonstration
    python bench/giant_on_small.py --models ViT-H-14 ViT-bigG-14 --json rows.json

Each (model, setup) is its own `torchrun` launch of 2 ranks (FSDP2, --grad-checkpointing, batch 1 per rank,
random images and texts) through the pieces of a training run (bench/harness.py: build_model on meta and sharded
init, build_engine, the loop's forward_backward and optimizer step). The setups, leanest last:

    fp32_adamw                 fp32 weights, gradients and AdamW moments: 16 bytes per parameter (today's FSDP,
                               and what OpenCLIP's FSDP2 keeps)
    bf16_adamw                 --precision pure_bf16: bf16 weights and gradients, AdamW moments in bf16, updates
                               rounded stochastically into the weights: 8 bytes per parameter
    bf16_adamw8bit             ... with --opt adamw8bit: 8-bit moments, 6 bytes per parameter
    bf16_adamw8bit_in_backward ... with --optimizer-in-backward: no gradients kept, 4 bytes per parameter plus
                               about one block's gradients

A setup whose state alone (bytes per parameter x parameters) would not fit in 85% of the machine's available
memory is not launched (printed as such). Measured per setup: the state bytes per parameter each rank holds after
a backward (engine.state_bytes(): weights, gradients kept after the backward, optimizer state), each rank's peak
resident memory (VmHWM), the machine's peak (used memory sampled every 0.2 s, above what was used before the
launch), seconds per step (median of the steps after the first), the losses, and whether the weights changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import harness
import ranks
from ranks import write_from_rank0

GB = 1e9
SETUPS = {  # name -> the flags; the state's bytes per parameter are the memory model's (StateRecipe.per_param)
    "fp32_adamw": {"precision": "fp32", "opt": "adamw"},
    "bf16_adamw": {"precision": "pure_bf16", "opt": "adamw"},
    "bf16_adamw8bit": {"precision": "pure_bf16", "opt": "adamw8bit"},
    "bf16_adamw8bit_in_backward": {"precision": "pure_bf16", "opt": "adamw8bit", "optimizer_in_backward": True},
}
FIT_SHARE = 0.85


# ------------------------------------------------------------------------------------------- worker side
def worker(args) -> None:
    from bigclip.dist import init_distributed, shutdown
    from bigclip.engine.memory import peak_rss_bytes

    world = init_distributed("cpu")
    flags = SETUPS[args.setup]
    cfg = harness.config(model=args.model, engine="fsdp", batch_size=args.batch_size, grad_checkpointing=True,
                         **flags)  # fmt: skip
    bench = harness.build(cfg, world)
    params = sum(p.numel() for p in bench.engine.model.parameters())  # global shapes (DTensors)
    before = _checksum(bench.engine)
    losses, times, state = [], [], []
    for step, (images, texts) in enumerate(harness.synthetic_batches(cfg, world, args.steps)):
        # after a backward (what the ordinary step keeps until it steps), with optimizer state; not timed
        count = (lambda: state.append(bench.engine.state_bytes())) if step == 1 else None
        loss, seconds = bench.step(images, texts, inspect=count)
        times.append(seconds)
        losses.append(loss)
        print(f"rank {world.rank} step {step}: loss {loss:.4f}, {times[-1]:.1f} s", flush=True)
    out = {
        "rank": world.rank,
        "params": params,
        "state": state[0],
        "peak_rss": peak_rss_bytes(),
        "losses": losses,
        "s_per_step": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0],
        "weights_changed": _checksum(bench.engine) != before,
    }
    write_from_rank0(out, args.out, world.world_size, world.rank)
    shutdown()


def _checksum(engine) -> float:
    import torch

    with torch.no_grad():
        return sum(float(getattr(p, "_local_tensor", p).double().sum()) for p in engine.model.parameters())


# ------------------------------------------------------------------------------------------- driver side
def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}


def _used() -> int:
    info = _meminfo()
    return info["MemTotal"] - info["MemAvailable"]


class MachinePeak:
    """The machine's used memory, sampled in a thread while a launch runs, above what was used before it."""

    def __init__(self, every_s: float = 0.2):
        self.baseline = _used()
        self.peak = 0
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, _used() - self.baseline)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def launch(model: str, setup: str, args) -> tuple[list[dict] | str, int]:
    """Each rank's results (or why the launch failed) and the machine's peak memory during it."""
    worker_args = ["--model", model, "--setup", setup, "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    with MachinePeak() as machine:  # tensors of 4 MB+ are mmap'ed: freed memory leaves the process
        result = ranks.launch(__file__, 2, worker_args, args.timeout, mmap_threshold=4 << 20)
    return result, machine.peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["ViT-bigG-14"])
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1, help="per rank")
    p.add_argument("--json", metavar="FILE", help="write every figure as a list of rows")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--setup", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from bigclip.memory import StateRecipe, model_facts

    available = _meminfo()["MemAvailable"]
    total = _meminfo()["MemTotal"]
    print(f"# 2 FSDP2 ranks, --grad-checkpointing, batch {args.batch_size} per rank, {args.steps} steps; machine: "
          f"{total / GB:.1f} GB, {available / GB:.1f} GB available, {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| model | setup | state B/param (measured) | peak GB per rank | peak GB machine | s/step | losses | "
          "weights changed |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---|---|")
    rows = []
    for model in args.models:
        psi = model_facts(model).params
        for setup in args.setups:
            flags = SETUPS[setup]
            recipe = StateRecipe(flags["precision"], flags["opt"], flags.get("optimizer_in_backward", False))
            state_per_param = recipe.per_param
            if state_per_param * psi > FIT_SHARE * available:
                need = f"{state_per_param * psi / GB:.1f} GB"
                print(f"| {model} | {setup} | ({state_per_param:.2f}) | does not fit: {need} "
                      f"of state, {available / GB:.1f} GB available | | | | |", flush=True)  # fmt: skip
                continue
            result, machine_peak = launch(model, setup, args)
            if isinstance(result, str):
                print(f"| {model} | {setup} | | {result} | {machine_peak / GB:.1f} | | | |", flush=True)
                continue
            state = sum(r["state"]["total"] for r in result)
            row = {
                "model": model,
                "setup": setup,
                "steps": len(result[0]["losses"]),
                "losses": result[0]["losses"],
                "state_bytes_per_param": state / result[0]["params"],
                "peak_gb_per_rank": max(r["peak_rss"] for r in result) / GB,
                "peak_gb_machine": machine_peak / GB,
                "s_per_step": max(r["s_per_step"] for r in result),
                "weights_changed": all(r["weights_changed"] for r in result),
            }
            rows.append(row)
            losses = ", ".join(f"{x:.3f}" for x in row["losses"])
            print(
                f"| {model} | {setup} | {row['state_bytes_per_param']:.2f} | {row['peak_gb_per_rank']:.1f} | "
                f"{row['peak_gb_machine']:.1f} | {row['s_per_step']:.1f} | {losses} | {row['weights_changed']} |",
                flush=True,
            )
            if args.json:  # after every row: a launch that fails later still leaves the rows before it
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        # what OpenCLIP keeps for the same model: fp32 weights, gradients and AdamW moments
        print(
            f"\n{model}: {psi / 1e9:.2f}B parameters; OpenCLIP's fp32 state: DDP {16 * psi / GB:.1f} GB per rank "
            f"({2 * 16 * psi / GB:.1f} GB for 2 ranks), FSDP2 {16 * psi / 2 / GB:.1f} GB per rank of 2\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
