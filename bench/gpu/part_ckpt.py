"""GPU kit, checkpoint stall: training on the GPU while bigclip saves its state asynchronously, with each writer
(thread and process; `default` marks the one --checkpoint-async auto picks: bigclip/ckpt/config.py DEFAULT_WRITER),
for two states: ViT-L-14 + AdamW (amp_bf16, DDP on one rank, batch 32: 4.8 GiB) and ViT-bigG-14's leanest state
(pure bf16 weights, 8-bit AdamW, optimizer in the backward; FSDP2 + checkpointing, batch 32: ~10 GiB).

Per writer: the first save (it allocates the host buffers: repetition 0) and 3 repetitions. Each save is timed as
the loop sees it: a few steps with no save right before it (its steady state), the save, the steps that run while
it is written, then the commit. Rows (`saves`): state, writer, default, repetition, blocked_s (time in save() plus
the wait before the next update: the loop's stall), slowdown_pct (median step while the save runs vs the steady
state before it), commit_s (save() to manifest), within_target (issue goal: blocked <= 1 s and slowdown <= 5%),
peak_gib_steady / peak_gib_with_save (the device's allocated peak over the steps before the save / over the save
and the steps beside it: what a save adds to a run's memory).
Checkpoints are written to RAM (/dev/shm where it has room for them, else the scratch folder; column `storage`):
the loop's cost of a save is the copy and the writer's CPU work, which RAM compresses into less time rather than
hides, and the part's budget does not depend on the machine's disk.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator

import torch
from checkpoint_stall import build, state_bytes, steps_while
from common import Recorder, device, free_memory, part_args
from suite import RAM_PREFIX

from bigclip.ckpt import CheckpointManager
from bigclip.ckpt.config import DEFAULT_WRITER

WRITERS = ("thread", "process")
REPETITIONS = 3
BLOCKED_TARGET_S, SLOWDOWN_TARGET_PCT = 1.0, 5.0
# label -> (model, batch, steady-state steps before each save, the flags beyond the model and batch)
STATES = {
    "ViT-L-14 + AdamW": ("ViT-L-14", 32, 8, {"precision": "amp_bf16"}),
    "ViT-bigG-14 leanest": (
        "ViT-bigG-14",
        32,
        3,
        {
            "precision": "pure_bf16",
            "opt": "adamw8bit",
            "optimizer_in_backward": True,
            "engine": "fsdp",
            "grad_checkpointing": True,
        },
    ),
}
SMOKE = {  # the smoke run: test-tiny in both setups (fp32 for the first: CPU autocast is not what is measured)
    "ViT-L-14 + AdamW": ("test-tiny", 4, 2, {"precision": "fp32"}),
    "ViT-bigG-14 leanest": ("test-tiny", 4, 2, {**STATES["ViT-bigG-14 leanest"][3]}),
}


def checkpoint_root(work: str | None, state_bytes: int) -> tuple[str, str]:
    """A folder in RAM with room for six times the run's state (a checkpoint of 8-bit AdamW's state is 2.5 times
    it: float32 moments; the process writer's shared-memory copy as much again; slack), else the scratch folder:
    (path, what it is)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free >= 6 * state_bytes:
        return tempfile.mkdtemp(prefix=f"{RAM_PREFIX}{os.getpid()}-", dir=shm), "RAM (/dev/shm)"
    return tempfile.mkdtemp(prefix=f"{RAM_PREFIX}{os.getpid()}-", dir=work), "scratch folder (disk)"


def peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    """The device's allocated peak since peak_reset() (None off CUDA)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def timed_saves(engine, world, step, writer: str, root: str, steady_steps: int, repetitions: int) -> Iterator[dict]:
    """The first save and `repetitions` more, each after `steady_steps` steps with no save: a row per save, as it
    is measured (a part out of time keeps what it measured)."""
    manager = CheckpointManager(root, engine, world, async_mode=writer)
    try:
        for repetition in range(repetitions + 1):
            peak_reset()
            steady = statistics.median(step() for _ in range(steady_steps))
            steady_peak = peak_gib()
            peak_reset()
            tag = f"save{repetition}"
            manager.save(tag, repetition, 0)
            during = steps_while(lambda: not manager._pending.done(), lambda: step(manager.wait_staged), steady_steps)
            manager.wait()
            save_peak = peak_gib()
            result = manager.results[-1]
            if result.error is not None:
                raise RuntimeError(result.error)
            slowdown = 100 * (statistics.median(during) / steady - 1)
            yield dict(
                repetition=repetition,
                blocked_s=round(result.blocked_s, 3),
                slowdown_pct=round(slowdown, 1),
                commit_s=round(result.commit_s, 2),
                steps_during_save=len(during),
                step_s_during=round(statistics.median(during), 4),
                step_s_steady=round(steady, 4),
                within_target=result.blocked_s <= BLOCKED_TARGET_S and slowdown <= SLOWDOWN_TARGET_PCT,
                peak_gib_steady=steady_peak,
                peak_gib_with_save=save_peak,
            )
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)  # RAM for the next one
    finally:
        manager.close()


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    for label, (model, batch, steady_steps, flags) in (SMOKE if args.smoke else STATES).items():
        try:
            engine, world, step = build(model, batch, device=dev, **flags)
        except Exception as e:  # noqa: BLE001 - a state that does not build is a finding; the next one still runs
            rec.row("saves", state=label, result=f"error: {type(e).__name__}: {str(e)[:160]}")
            continue
        for _ in range(2):
            step()  # warm-up: kernels, allocator, optimizer state (the 8-bit update compiles here)
        gib = state_bytes(engine) / 2**30
        root, storage = checkpoint_root(args.work, state_bytes(engine))
        try:
            for writer in WRITERS:
                try:
                    for row in timed_saves(
                        engine, world, step, writer, root, steady_steps, 1 if args.smoke else REPETITIONS
                    ):
                        rec.row("saves", state=label, model=model, batch=batch, state_gib=round(gib, 2),
                                storage=storage, writer=writer, default=writer == DEFAULT_WRITER, **row)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a writer that fails is a finding; the other still runs
                    rec.row("saves", state=label, writer=writer, result=f"error: {type(e).__name__}: {str(e)[:160]}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
            engine = step = None
            gc.collect()
            free_memory()
    rec.note(
        f"within_target: blocked <= {BLOCKED_TARGET_S:.0f} s and step time during the save within "
        f"{SLOWDOWN_TARGET_PCT:.0f}% of the steps right before it; repetition 0 is the first save (host buffers "
        f"allocated); --checkpoint-async auto is the {DEFAULT_WRITER} writer"
    )


if __name__ == "__main__":
    main()
