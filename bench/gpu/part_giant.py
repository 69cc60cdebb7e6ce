"""GPU kit, giant tower: the largest of ViT-bigG-14 / ViT-H-14 that trains on the one GPU with the leanest setup
bigclip has today (FSDP2, --grad-checkpointing, --precision amp_bf16, AdamW): the batch that fit (halved from 64
on out-of-memory), seconds per step, peak memory, next to `bigclip plan`'s prediction.
"""

from __future__ import annotations

import statistics
import time

import torch
from common import Recorder, device, free_memory, is_oom, part_args
from part_engines import batches

from bigclip.build import build_engine, build_loss_fn, build_model
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.loop import forward_backward, optimizer_step
from bigclip.plan import activation_bytes, model_facts, state_bytes


def train_steps(model: str, batch: int, steps: int, world: World, precision: str) -> tuple[list[float], float, float]:
    cfg = resolve(dict(model=model, dataset_type="synthetic", precision=precision, batch_size=batch, lr=1e-5,
                       workers=0, engine="fsdp", grad_checkpointing=True))  # fmt: skip
    t = time.perf_counter()
    engine = build_engine(cfg.sections.engine, build_model(cfg.sections.model, cfg.sections.engine, world), world)
    built_s = time.perf_counter() - t
    loss_fn = build_loss_fn(cfg.sections.loss, world)
    engine.set_lr(1e-5)
    times = []
    for images, texts in batches(model, batch, steps, world.device):
        t = time.perf_counter()
        forward_backward(engine, loss_fn, [(images, texts)], world)
        optimizer_step(engine)
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if world.device.type == "cuda" else 0
    return times, peak, built_s


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    world = World(device=dev)
    candidates, batch0, steps = (("test-tiny",), 4, 3) if args.smoke else (("ViT-bigG-14", "ViT-H-14"), 64, 5)
    precision = "fp32" if args.smoke else "amp_bf16"
    for model in candidates:
        batch = batch0
        while batch >= 1:
            free_memory()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                times, peak, built_s = train_steps(model, batch, steps, world, precision)
            except Exception as e:  # noqa: BLE001 - out of memory halves the batch; anything else is reported
                if not is_oom(e):
                    rec.row("giant", model=model, batch=batch, result=f"error: {type(e).__name__}: {str(e)[:160]}")
                    break
                rec.note(f"{model}: batch {batch} ran out of memory")
                batch //= 2
                continue
            facts = model_facts(model)
            plan = state_bytes("fsdp", facts.params, 1, "amp", facts) + activation_bytes(facts, batch, True)
            rec.row(
                "giant",
                model=model,
                params_b=round(facts.params / 1e9, 2),
                setup=f"fsdp2 + grad checkpointing + {precision}, AdamW",
                batch=batch,
                build_s=round(built_s, 1),
                s_per_step=round(statistics.median(times[1:] or times), 3),
                samples_per_s=round(batch / statistics.median(times[1:] or times), 1),
                peak_gib=round(peak / 2**30, 2) if dev.type == "cuda" else None,
                plan_gib=round(plan / 2**30, 2),
            )
            return  # the largest candidate that trains is the answer


if __name__ == "__main__":
    main()
