"""What every benchmark that trains builds, built once: flags -> resolved config -> engine, loss, step function and
synthetic batches, through the pieces `bigclip train` runs (so a benchmark measures what training runs).

    cfg = harness.config(model="ViT-B-32", batch_size=4, precision="fp32", **harness.zero(2))
    bench = harness.build(cfg, world)                     # build.py: seed, build_model, build_engine, build_loss_fn
    for images, texts in harness.synthetic_batches(cfg, world, steps=3):
        loss, seconds = bench.step(images, texts)         # loop.py: forward_backward, optimizer_step

and, for benchmarks that run the trainer itself as a subprocess (launch/train.py beside OpenCLIP's
open_clip_train): trainer_flags (the flags both take), bigclip_records (its metrics.jsonl) and open_clip_records
(its log lines).

Every benchmark under bench/ and every part of the GPU kit (bench/gpu/, which has bench/ on its path) imports it
as `harness`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402  (after bigclip's folder is on the path)

from bigclip.build import build_engine, build_loss_fn, build_model, seed_everything  # noqa: E402
from bigclip.config import resolve  # noqa: E402
from bigclip.dist import World  # noqa: E402
from bigclip.loop import forward_backward, optimizer_step  # noqa: E402
from bigclip.memory import memory_setup, memory_setups  # noqa: E402
from bigclip.model import get_model_config, preprocess_cfg  # noqa: E402
from bigclip.precision import resolve_precision  # noqa: E402

# What every in-process benchmark sets: data it makes itself, no loader workers, a constant learning rate.
BENCH_FLAGS = {"dataset_type": "synthetic", "workers": 0, "lr": 1e-4, "warmup": 1}


def config(**flags):
    """The TrainConfig for `flags` (TrainConfig field names: model, batch_size, precision, engine, ds_config, ...)
    over BENCH_FLAGS, checked by resolve() as `bigclip train` checks a command line (a refused setup raises its
    UserError)."""
    return resolve({**BENCH_FLAGS, **flags})


def zero(stage: int) -> dict:
    """The flags that select DeepSpeed ZeRO-`stage` with the repository's config (ds_configs/zero<stage>.json)."""
    return {"ds_config": os.path.join(REPO, "ds_configs", f"zero{stage}.json")}


def setup_flags(setup: str) -> dict:
    """The flags that select memory setup `setup` (a row of `bigclip plan`), as its engine lists them
    (bigclip.memory.memory_setups(); the shipped configs' paths made absolute)."""
    return {
        name: os.path.join(REPO, value) if isinstance(value, str) and value.startswith("ds_configs/") else value
        for name, value in memory_setup(setup).flags.items()
    }


def measurable_setups() -> list[str]:
    """Every memory setup whose state is on the device (offloaded ones hold only buffers there), in plan order."""
    return [name for name, setup in memory_setups().items() if not setup.offloaded]


def synthetic_batches(cfg, world: World, steps: int, seed: int | None = None) -> Iterator[tuple]:
    """`steps` batches (images, texts), made one at a time: random normalised pixels at the model's image size and
    random token ids at its context length, on the run's device, images in the dtype the loop feeds the model
    (the weights' under pure bf16). `seed` defaults to the rank (each rank its own data, as a sampler gives)."""
    model = cfg.sections.model
    arch = get_model_config(model.model, model.cache_dir)
    size = preprocess_cfg(model.model, model.image_size, model.cache_dir)["size"]
    context = model.force_context_length or arch["text_cfg"]["context_length"]
    vocab = arch["text_cfg"].get("vocab_size", 49408)
    dtype = resolve_precision(cfg.precision, world.device).param_dtype
    g = torch.Generator().manual_seed(world.rank if seed is None else seed)
    for _ in range(steps):
        images = torch.randn(cfg.batch_size, 3, *size, generator=g)
        texts = torch.randint(1, vocab - 1, (cfg.batch_size, context), generator=g)
        yield images.to(world.device, dtype=dtype), texts.to(world.device)


@dataclass
class Bench:
    """A built run: its config, world, engine and loss."""

    cfg: object
    world: World
    engine: object
    loss_fn: torch.nn.Module

    def step(
        self, images: torch.Tensor, texts: torch.Tensor, wait: Callable | None = None, inspect: Callable | None = None
    ) -> tuple[float, float]:
        """One optimizer step as the training loop takes it; returns (loss, seconds). `inspect()` runs after the
        backward, before the update, and is not timed (a benchmark's own measurement: engine.state_bytes());
        `wait()` runs there too and is timed (what the loop itself waits for there: a save's staging copy; where
        the backward updates the parameters, --optimizer-in-backward, right before its first update, as the loop).
        On CUDA the seconds include the step's kernels. A loss that is not finite skips the update, as the loop
        does (the loss returned is nan)."""
        return self.accumulated_step([(images, texts)], wait, inspect)

    def accumulated_step(
        self, micro_batches: list[tuple], wait: Callable | None = None, inspect: Callable | None = None
    ) -> tuple[float, float]:
        """step() over several micro-batches (--accum-freq: the loop's feature cache, gradients synchronised in
        the last micro-batch's backward)."""
        start = time.perf_counter()
        if wait is not None and self.engine.steps_in_backward:  # the backward updates the parameters: as the loop,
            self.engine.before_updates_in_backward(wait)  # wait right before its first update
        loss, out = forward_backward(self.engine, self.loss_fn, micro_batches, self.world)
        if inspect is not None:
            paused = time.perf_counter()
            inspect()
            start += time.perf_counter() - paused
        if wait is not None:
            wait()  # where the backward waited already: returns at once
        if out is None:
            self.engine.zero_grad()
        else:
            optimizer_step(self.engine)
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()
        return loss, time.perf_counter() - start


def build(cfg, world: World | None = None) -> Bench:
    """The engine and loss of `cfg` as `bigclip train` builds them (seed_everything, build_model: where the engine
    wants the model, build_engine, build_loss_fn), in training mode at cfg.lr. `world`: the process's (from
    bigclip.dist.init_distributed under torchrun); default one CPU process."""
    world = world or World()
    seed_everything(cfg.seed)  # the same initial weights on every rank and for every setup compared
    run = cfg.sections
    engine = build_engine(run.engine, build_model(run.model, run.engine, world), world)
    engine.train()
    engine.set_lr(cfg.lr)
    return Bench(cfg, world, engine, build_loss_fn(run.loss, world))


# ------------------------------------------------------------------------------- the trainer as a subprocess
def trainer_flags(
    model: str, batch_size: int, samples: int, logs: str, name: str, precision: str = "fp32", workers: int = 0
) -> list[str]:
    """The flags launch/train.py and open_clip_train both take for a throughput run: synthetic data, one epoch of
    `samples`, a log line (and a metrics record) every step, no checkpoints, the run folder logs/name."""
    return [
        *("--model", model, "--dataset-type", "synthetic", "--train-num-samples", str(samples)),
        *("--batch-size", str(batch_size), "--epochs", "1", "--precision", precision, "--workers", str(workers)),
        *("--log-every-n-steps", "1", "--warmup", "10", "--save-frequency", "0", "--logs", logs, "--name", name),
    ]


def trainer_env(**extra: str) -> dict:
    """The environment a trainer subprocess runs in: this one, with bigclip's folder first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def bigclip_records(logs: str, name: str) -> list[dict]:
    """The step records of a bigclip run's metrics.jsonl (samples_per_s, samples_per_s_per_gpu, data_time, ...)."""
    with open(os.path.join(logs, name, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "samples_per_s" in r]


OPEN_CLIP_LINE = re.compile(r"Data \(t\): ([0-9.]+) Batch \(t\): [0-9.]+, [0-9.e+]+/s, ([0-9.e+]+)/s/gpu")


def open_clip_records(logs: str, name: str) -> list[tuple[float, float]]:
    """(data seconds, samples/s per GPU) of each step line in an open_clip_train run's out.log."""
    with open(os.path.join(logs, name, "out.log")) as f:
        return [(float(m.group(1)), float(m.group(2))) for m in map(OPEN_CLIP_LINE.search, f) if m]
