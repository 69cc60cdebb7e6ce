"""GPU kit, giant tower: the largest of ViT-bigG-14 / ViT-H-14 that trains on the one GPU under FSDP2 with
--grad-checkpointing, in two setups: amp_bf16 with AdamW (fp32 state, 16 bytes per parameter) and the leanest
(--precision pure_bf16 --opt adamw8bit --optimizer-in-backward: about 4 bytes per parameter); then the largest
tower OpenCLIP names, EVA02-E-14 (4.7B parameters, timm's EVA trunk), in the leanest setup only (amp's 16 bytes
per parameter, 75 GB, do not fit one GPU), at batch 32 for 3 steps: the batch that fit (halved on out-of-memory),
seconds per step, peak memory, next to `bigclip plan`'s prediction (for EVA, its activations traced on meta).
The smoke run trains test-tiny and a tiny EVA (timm's eva02_tiny_patch14_224 as an OpenCLIP local-dir: model).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import harness
import torch
from common import Recorder, device, free_memory, is_oom, part_args

from bigclip.dist import World
from bigclip.engine import describe_plan
from bigclip.memory import StateRecipe, model_facts, peak_parts

LEAN = "pure_bf16, adamw8bit, optimizer in backward"
# setup name -> the flags it adds (the smoke run on CPU uses fp32 for the first: CPU autocast is not measured here)
SETUPS = {
    "amp_bf16, AdamW": {"precision": "amp_bf16", "opt": "adamw"},
    LEAN: {
        "precision": "pure_bf16",
        "opt": "adamw8bit",
        "optimizer_in_backward": True,
    },
}


def train_steps(model: str, batch: int, steps: int, world: World, flags: dict) -> tuple[list[float], float, float, str]:
    """Step times, peak bytes, build seconds, and the memory setup (bigclip/memory/setups.py) the flags select."""
    cfg = harness.config(model=model, batch_size=batch, lr=1e-5, engine="fsdp", grad_checkpointing=True, **flags)
    t = time.perf_counter()
    bench = harness.build(cfg, world)
    built_s = time.perf_counter() - t
    data = list(harness.synthetic_batches(cfg, world, steps, seed=0))
    times = [bench.step(images, texts)[1] for images, texts in data]
    peak = torch.cuda.max_memory_allocated() if world.device.type == "cuda" else 0
    setup, _ = describe_plan(cfg.sections.engine, world, model_facts(model).params)
    return times, peak, built_s, setup


def largest_that_trains(rec: Recorder, world: World, candidates, batch0: int, steps: int, name: str, flags: dict):
    """One row: the first candidate that trains at some batch (halved from batch0 on out-of-memory)."""
    for model in candidates:
        batch = batch0
        while batch >= 1:
            free_memory()
            if world.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                times, peak, built_s, setup = train_steps(model, batch, steps, world, flags)
            except Exception as e:  # noqa: BLE001 - out of memory halves the batch; anything else is reported
                if not is_oom(e):
                    rec.row("giant", model=model, setup=name, batch=batch,
                            result=f"error: {type(e).__name__}: {str(e)[:160]}")  # fmt: skip
                    break
                rec.note(f"{model}, {name}: batch {batch} ran out of memory")
                batch //= 2
                continue
            facts = model_facts(model)
            recipe = StateRecipe(flags["precision"], flags["opt"], flags.get("optimizer_in_backward", False))
            plan = peak_parts(setup, facts, 1, recipe, batch, True, world.device.type)
            step_s = statistics.median(times[1:] or times)
            rec.row(
                "giant",
                model=model,
                params_b=round(facts.params / 1e9, 2),
                setup=f"fsdp2 + grad checkpointing + {name}",
                bytes_per_param=recipe.per_param,
                batch=batch,
                build_s=round(built_s, 1),
                s_per_step=round(step_s, 3),
                samples_per_s=round(batch / step_s, 1),
                peak_gib=round(peak / 2**30, 2) if world.device.type == "cuda" else None,
                plan_state_gib=round(plan["state"] / 2**30, 2),
                plan_gib=round(plan["peak"] / 2**30, 2),
            )
            return


def tiny_eva(work: str) -> str:
    """An OpenCLIP local-dir: model whose image tower is timm's smallest EVA02 (5.5M parameters, the same trunk
    code as EVA02-E-14) with a byte-level text tower: what the smoke run trains in place of EVA02-E-14."""
    folder = os.path.join(work, "eva02-tiny")
    os.makedirs(folder, exist_ok=True)
    vision = {"timm_model_name": "eva02_tiny_patch14_224", "timm_pool": "token", "timm_proj": None, "image_size": 224}
    text = {"context_length": 16, "vocab_size": 259, "width": 64, "heads": 4, "layers": 2}
    with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
        model_cfg = {"embed_dim": 64, "tokenizer": "byte", "vision_cfg": vision, "text_cfg": text}
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": {}}, f)
    return f"local-dir:{folder}"


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    world = World(device=device())
    candidates, batch0, steps = (("test-tiny",), 4, 3) if args.smoke else (("ViT-bigG-14", "ViT-H-14"), 64, 5)
    for name, flags in SETUPS.items():
        if args.smoke and flags["precision"] == "amp_bf16":
            name, flags = name.replace("amp_bf16", "fp32"), {**flags, "precision": "fp32"}
        largest_that_trains(rec, world, candidates, batch0, steps, name, flags)
    # EVA02-E-14: 64 blocks of width 1792, ~1.8 s per step at batch 32 on an H100 by the FLOPs; 3 steps (the first
    # compiles the 8-bit update) and its build (timm's init on the CPU) fit the part's budget after bigG's rows.
    eva, eva_batch, eva_steps = (
        ((tiny_eva(args.work or tempfile.mkdtemp()),), 2, 2) if args.smoke else (("EVA02-E-14",), 32, 3)
    )
    largest_that_trains(rec, world, eva, eva_batch, eva_steps, LEAN, SETUPS[LEAN])


if __name__ == "__main__":
    main()
