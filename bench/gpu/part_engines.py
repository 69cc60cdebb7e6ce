"""GPU kit, engines on CUDA/NCCL: DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, world size 1, ViT-L-14, 10 steps on
the same synthetic batches from the same initial weights: each step's loss next to DDP's, and the measured peak
memory next to `bigclip plan`'s prediction for the same setup (state + activations; plan adds 3 GiB of
reserve for the CUDA context and fragmentation, which is left out of both columns here).

Each engine is built the way `bigclip train` builds it (build.build_model, build.build_engine, loop's
forward_backward and optimizer_step), one after another in this process, under a 1-rank NCCL group.
"""

from __future__ import annotations

import os
import time

import torch
from common import REPO, Recorder, device, free_memory, part_args

from bigclip.build import build_engine, build_loss_fn, build_model
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.engine import describe_plan
from bigclip.engine.config import StateRecipe
from bigclip.loop import forward_backward, optimizer_step
from bigclip.model import get_model_config
from bigclip.plan import model_facts, peak_parts

ENGINES = {  # label -> the flags that select it (the first is the reference the others are compared with)
    "ddp": {"engine": "ddp"},
    "fsdp2": {"engine": "fsdp"},
    "zero2": {"ds_config": os.path.join(REPO, "ds_configs", "zero2.json")},
    "zero3": {"ds_config": os.path.join(REPO, "ds_configs", "zero3.json")},
}
BF16_TOLERANCE = 2e-2  # relative: bf16 autocast keeps ~3 significant digits; engines order reductions differently


def batches(model: str, batch: int, steps: int, dev: torch.device):
    arch = get_model_config(model)
    size, ctx = arch["vision_cfg"]["image_size"], arch["text_cfg"]["context_length"]
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, 3, size, size, generator=g).to(dev),
            torch.randint(1, 250, (batch, ctx), generator=g).to(dev),
        )
        for _ in range(steps)
    ]


def run_engine(
    flags: dict, model: str, batch: int, data, world: World, precision: str
) -> tuple[list[float], float, str]:
    cfg = resolve(dict(model=model, dataset_type="synthetic", precision=precision, batch_size=batch, lr=1e-4,
                       warmup=0, workers=0, seed=0, **flags))  # fmt: skip
    torch.manual_seed(0)
    engine = build_engine(cfg.sections.engine, build_model(cfg.sections.model, cfg.sections.engine, world), world)
    loss_fn = build_loss_fn(cfg.sections.loss, world)
    engine.set_lr(1e-4)
    losses = []
    for images, texts in data:
        loss, _ = forward_backward(engine, loss_fn, [(images, texts)], world)
        optimizer_step(engine)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() if world.device.type == "cuda" else 0
    setup, _ = describe_plan(cfg.sections.engine, world, model_facts(model).params)  # the plan's row for it
    return losses, peak, setup


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    world = World(device=dev)
    model, batch, steps, precision = ("test-tiny", 4, 3, "fp32") if args.smoke else ("ViT-L-14", 32, 10, "amp_bf16")
    data = batches(model, batch, steps, dev)
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
