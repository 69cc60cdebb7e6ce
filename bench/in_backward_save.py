"""A save's stall with --optimizer-in-backward: where the loop waits for the save's copy of the state, side by side.

    python bench/in_backward_save.py [--model ViT-B-32] [--batch-size 8] [--saves 4]

With the optimizer stepped in the backward, the parameters change during the backward, so a save's background copy
must be done before the first update. The loop used to wait before the forward (the whole copy was the loop's
stall); it now waits right before the first update (engine.before_updates_in_backward), so the forward and the
backward up to the first final gradient run beside the copy. Both placements on the same engine, state and batch
(one process, fp32 weights + AdamW stepped in the backward, the thread writer into RAM): the loop's blocked time per
save (time in save() plus its wait for the copy; median over the saves after the first) and the step time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

from checkpoint_stall import build, state_bytes


def blocked_per_save(engine, world, step, root: str, saves: int, before_forward: bool) -> list[float]:
    from bigclip.ckpt import CheckpointManager

    manager = CheckpointManager(root, engine, world, async_mode="thread")
    blocked = []
    try:
        for i in range(saves + 1):  # the first save allocates the host buffers: left out
            manager.save(f"s{i}", i, 0)
            if before_forward:
                manager.wait_staged()  # the old placement: the whole copy before the next step starts
                step()
            else:
                step(manager.wait_staged)  # harness: the engine calls it right before the first update
            manager.wait()
            blocked.append(manager.results[-1].blocked_s)
            shutil.rmtree(os.path.join(root, f"s{i}"), ignore_errors=True)
    finally:
        manager.close()
    return blocked[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--saves", type=int, default=4)
    args = p.parse_args()
    engine, world, step = build(args.model, args.batch_size, optimizer_in_backward=True)
    for _ in range(2):
        step()  # AdamW state exists from here on
    steady = statistics.median(step() for _ in range(3))
    gib = state_bytes(engine) / 2**30
    root = tempfile.mkdtemp(prefix="bigclip-in-backward-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        rows = {}
        for label, before_forward in (("before the forward (until 2026-11-30)", True),
                                      ("right before the first update (now)", False)):  # fmt: skip
            rows[label] = statistics.median(blocked_per_save(engine, world, step, root, args.saves, before_forward))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.model}, batch {args.batch_size}: state {gib:.2f} GiB, step {steady:.2f} s without a save")
    print("| the loop waits for the save's copy | blocked per save (s) | vs before the forward |")
    print("|---|---:|---:|")
    first = next(iter(rows.values()))
    for label, blocked in rows.items():
        print(f"| {label} | {blocked:.3f} | {blocked / first:.2f} |")


if __name__ == "__main__":
    main()
