"""torchrun worker for the engine <-> checkpoint-layout contract (tests/test_contracts.py).

    torchrun --nproc_per_node 2 tests/layout_worker.py ROOT OUT.json

For each engine: train 2 steps, then save through nothing but the CheckpointLayout interface the engine
names (stage -> wait -> write into a folder, files handed to a sink), build a fresh engine from another seed,
load through its layout, and record whether the weights equal the saved ones exactly, whether the next step
gives the same loss on both and so does the one after an update (the optimizer state came back too), what
read_model_state gives in one
process, and which files each rank handed over. Also records what raise_together does when one rank fails.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

from bigclip.build import build_loss_fn
from bigclip.ckpt.layout import CheckpointLayout
from bigclip.ckpt.layouts import LAYOUTS
from bigclip.config import resolve
from bigclip.dist import World, init_distributed, raise_together, shutdown
from bigclip.engine import build_engine, build_model
from bigclip.errors import UserError
from bigclip.loop import forward_backward, optimizer_step
from bigclip.model import create_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = {
    "ddp": {},
    "fsdp": {"engine": "fsdp"},
    "zero2": {"ds_config": os.path.join(REPO, "ds_configs", "zero2.json")},
    "zero3": {"ds_config": os.path.join(REPO, "ds_configs", "zero3.json")},
}


class ListSink:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def submit(self, path: str) -> None:
        assert os.path.isfile(path), path  # only finished files are handed over
        self.paths.append(path)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    texts = torch.randint(1, 250, (4, 16), generator=g)
    return torch.randn(4, 3, 16, 16, generator=g), texts


def train(engine, loss_fn, world: World, steps) -> list[float]:
    losses = []
    for step in steps:
        engine.set_lr(1e-3)
        loss, _ = forward_backward(engine, loss_fn, [batch(step, world.rank)], world)
        optimizer_step(engine)
        losses.append(loss)
    return losses


def full_model(engine) -> dict[str, torch.Tensor]:  # collective
    if engine.name == "deepspeed":
        import deepspeed

        params = dict(engine.model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().float().clone() for n, p in params.items()}
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for n, p in engine.model.named_parameters()
    }


def fresh_engine(cfg, world: World, seed: int):
    torch.manual_seed(seed)
    return build_engine(
        cfg.sections.engine, build_model(cfg.sections.engine, world, functools.partial(create_model, cfg.model)), world
    )


def round_trip(name: str, flags: dict, root: str, world: World, group) -> dict:
    cfg = resolve(
        {"dataset_type": "synthetic", "precision": "fp32", "model": "test-tiny", "batch_size": 4, "lr": 1e-3,
         "wd": 0.1, "seed": 0, "workers": 0, **flags}
    )  # fmt: skip
    a = fresh_engine(cfg, world, seed=0)
    loss_fn = build_loss_fn(cfg.sections.loss, world)
    train(a, loss_fn, world, range(2))
    layout = a.checkpoint_layout(group, "thread")
    directory = os.path.join(root, name)
    if world.is_main:
        os.makedirs(directory)
    dist.barrier()
    sink = ListSink()
    staged = layout.stage(directory)
    staged.result()
    layout.write(staged, directory, sink)
    extra = layout.describe()
    saved = full_model(a)
    dist.barrier()

    b = fresh_engine(cfg, world, seed=1)
    differs_before = any(not torch.equal(saved[k], v) for k, v in full_model(b).items())
    b_layout = b.checkpoint_layout(group, "thread")
    b_layout.load(directory, world.world_size, extra)
    loaded = full_model(b)
    # step 2's loss reads the weights only; step 3's comes after an update from the loaded optimizer state
    next_a, next_b = train(a, loss_fn, world, [2, 3]), train(b, loss_fn, world, [2, 3])

    out = {
        "is_layout": isinstance(layout, CheckpointLayout),
        "layout": layout.name,
        "extra": extra,
        "differs_before": differs_before,
        "weights_equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
        "next_loss": [next_a[0], next_b[0]],
        "loss_after_update": [next_a[1], next_b[1]],
        "files": sorted(os.path.relpath(p, directory) for p in sink.paths),
    }
    if world.is_main:  # what `bigclip export` reads: one process, no group, no engine
        exported = LAYOUTS[layout.name].read_model_state(directory)
        out["export_equal"] = sorted(exported) == sorted(saved) and all(
            torch.equal(exported[k].float(), saved[k]) for k in saved
        )
    layout.close()
    b_layout.close()
    return out


def main() -> int:
    root, out_path = sys.argv[1], sys.argv[2]
    world = init_distributed("cpu", "gloo")
    group = dist.new_group(backend="gloo")
    results: dict = {}
    for name, flags in ENGINES.items():
        results[name] = round_trip(name, flags, root, world, group)
    files: list = [None] * world.world_size
    dist.all_gather_object(files, {name: r["files"] for name, r in results.items()})
    results["files_by_rank"] = files

    def fails_on_rank_1() -> str:
        if world.rank == 1:
            raise UserError("rank 1 found a problem")
        return "fine"

    try:
        raise_together(world, fails_on_rank_1, runs_here=True)
        results["raise_together"] = "no error"
    except UserError as e:
        results["raise_together"] = str(e)
    results["raise_together_result"] = raise_together(world, lambda: world.rank + 41, runs_here=world.is_main)
    if world.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    shutdown()  # frees the DDP wrappers while the group exists
    return 0


if __name__ == "__main__":
    sys.exit(main())
