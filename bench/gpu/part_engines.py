"""GPU kit, engines on CUDA/NCCL: DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, world size 1, ViT-L-14, 10 steps on
the same synthetic batches from the same initial weights: each step's loss next to DDP's, and the measured peak
memory next to `bigclip plan`'s prediction for the same setup (state + activations; plan adds 3 GiB of
reserve for the CUDA context and fragmentation, which is left out of both columns here).

Each engine is built and stepped by bench/harness.py, the way `bigclip train` builds and steps it (build.py's
build_model, build_engine and build_loss_fn, loop.py's forward_backward and optimizer_step), one after another in
this process, under a 1-rank NCCL group.
"""

from __future__ import annotations

import time

import harness
import torch
from common import Recorder, device, free_memory, part_args

from bigclip.dist import World
from bigclip.engine import describe_plan
from bigclip.memory import StateRecipe, model_facts, peak_parts

ENGINES = {  # label -> the flags that select it (the first is the reference the others are compared with)
    "ddp": {"engine": "ddp"},
    "fsdp2": {"engine": "fsdp"},
    "zero2": harness.zero(2),
    "zero3": harness.zero(3),
}
BF16_TOLERANCE = 2e-2  # relative: bf16 autocast keeps ~3 significant digits; engines order reductions differently


def run_engine(flags: dict, model: str, batch: int, data, world: World, precision: str) -> tuple[list, float, str]:
    cfg = harness.config(model=model, precision=precision, batch_size=batch, **flags)
    bench = harness.build(cfg, world)
    losses = [bench.step(images, texts)[0] for images, texts in data]
    peak = torch.cuda.max_memory_allocated() if world.device.type == "cuda" else 0
    setup, _ = describe_plan(cfg.sections.engine, world, model_facts(model).params)  # the plan's row for it
    return losses, peak, setup


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    world = World(device=dev)
    model, batch, steps, precision = ("test-tiny", 4, 3, "fp32") if args.smoke else ("ViT-L-14", 32, 10, "amp_bf16")
    shapes = harness.config(model=model, batch_size=batch, precision=precision)
    data = list(harness.synthetic_batches(shapes, world, steps, seed=0))  # the same batches for every engine
    facts = model_facts(model)
    recipe = StateRecipe(precision)
    reference = None
    for label, flags in ENGINES.items():
        free_memory()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        t = time.perf_counter()
        try:
            losses, peak, setup = run_engine(flags, model, batch, data, world, precision)
        except Exception as e:  # noqa: BLE001 - one engine failing is a finding; the others still run
            rec.row("engines", engine=label, result=f"error: {type(e).__name__}: {str(e)[:160]}")
            continue
        reference = reference or losses  # the first engine listed (DDP) is the reference
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) if reference else None
        plan = peak_parts(setup, facts, 1, recipe, batch, False, dev.type)
        rec.row(
            "engines",
            engine=label,
            model=model,
            batch=batch,
            precision=precision,
            first_loss=round(losses[0], 5),
            last_loss=round(losses[-1], 5),
            max_rel_diff_vs_ddp=None if worst is None else f"{worst:.1e}",
            within_bf16_tolerance=None if worst is None else worst <= BF16_TOLERANCE,
            peak_gib=round((peak - baseline) / 2**30, 2) if dev.type == "cuda" else None,
            plan_gib=round(plan["peak"] / 2**30, 2),
            plan_state_gib=round(plan["state"] / 2**30, 2),
            wall_s=round(time.perf_counter() - t, 1),
        )
        rec.data.setdefault("losses", {})[label] = losses
        rec.flush()


if __name__ == "__main__":
    main()
