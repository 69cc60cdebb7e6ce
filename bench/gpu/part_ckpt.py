"""GPU kit, checkpoint stall: ViT-L-14 + AdamW training on the GPU while bigclip saves its state asynchronously
to local disk: the loop's blocked time per save (first save, which allocates the host buffers, and a later one),
the step time while the save runs vs steps without one (goal: within 10%), and the time to commit.

The model, step and save are bench/checkpoint_stall.py's (CheckpointManager with a thread or process writer,
no remote store), here on the GPU with --precision amp_bf16.
"""

from __future__ import annotations

import statistics
import tempfile

from checkpoint_stall import bigclip_save, build
from common import Recorder, device, part_args


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    model, batch, baseline_steps = ("test-tiny", 4, 3) if args.smoke else ("ViT-L-14", 32, 8)
    engine, world, step = build(model, batch, device=dev, precision="fp32" if args.smoke else "amp_bf16")
    for _ in range(2):
        step()  # warm-up: kernels, allocator, AdamW state
    baseline = statistics.median(step() for _ in range(baseline_steps))
    rec.row("baseline", model=model, batch=batch, step_s=round(baseline, 4))
    for mode in ("thread", "process"):
        with tempfile.TemporaryDirectory(dir=args.work) as local:
            try:
                r = bigclip_save(engine, world, step, mode, local, None, steps_during=baseline_steps)
            except Exception as e:  # noqa: BLE001 - a writer that fails is a finding; the other still runs
                rec.row("saves", writer=mode, result=f"error: {type(e).__name__}: {str(e)[:160]}")
                continue
        during = statistics.median(r["during"])
        rec.row(
            "saves",
            writer=mode,
            state_gib=round(r["bytes"] / 2**30, 2),
            first_save_blocked_s=round(r["first_blocked"], 3),
            blocked_s=round(r["blocked"], 3),
            commit_s=round(r["commit"], 2),
            idle_commit_s=round(r["idle_commit"], 2),
            steps_during_save=len(r["during"]),
            step_s_during=round(during, 4),
            step_s_without=round(baseline, 4),
            slowdown=f"{100 * (during / baseline - 1):+.1f}%",
            within_10_percent=during <= 1.10 * baseline,
        )


if __name__ == "__main__":
    main()
