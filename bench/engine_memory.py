"""Per-rank memory of DDP, ZeRO-1/2/3 and FSDP2 side by side, against `bigclip plan`'s arithmetic.

    python bench/engine_memory.py --model ViT-B-32 --world-sizes 2 4 --batch-size 4 --steps 6

Each (engine, world size) runs in a fresh `torchrun` launch so its peak process memory is its own. Inside,
the same bigclip pieces as a training run (bench/harness.py: build_model, build_engine, the loop's
forward_backward and optimizer_step) train on random batches; after the backward of the third step (Adam
moments exist, gradients not yet freed) engine.state_bytes() counts the bytes of parameters, gradients and
optimizer state the rank holds (engine/memory.py: distinct tensor storages reachable from the model and the
optimizer). Printed per rank: that state, its ratio to DDP's, the plan's prediction for it, peak RSS, and
samples/s.
"""

from __future__ import annotations

import argparse
import sys

import harness
import ranks
from ranks import write_from_rank0


# ------------------------------------------------------------------------------------------- worker side
def worker(args) -> None:
    from bigclip.dist import init_distributed, shutdown
    from bigclip.engine.memory import peak_rss_bytes

    world = init_distributed("cpu")
    cfg = harness.config(model=args.model, precision=args.precision, batch_size=args.batch_size,
                         grad_checkpointing=args.grad_checkpointing, **harness.setup_flags(args.engine))  # fmt: skip
    bench = harness.build(cfg, world)
    state, times = [], []
    for step, (images, texts) in enumerate(harness.synthetic_batches(cfg, world, args.steps)):
        # after the third backward (not timed): Adam moments exist, gradients not yet freed by the step
        count = (lambda: state.append(bench.engine.state_bytes())) if step == 2 else None
        _, seconds = bench.step(images, texts, inspect=count)
        if step >= 2:  # the first steps build optimizer state and warm caches
            times.append(seconds)
    step_s = sorted(times)[len(times) // 2]
    out = {"rank": world.rank, "state": state[0], "peak_rss": peak_rss_bytes(), "step_s": step_s}

    write_from_rank0(out, args.out, world.world_size, world.rank)
    shutdown()  # frees the DDP wrapper while the group exists


# ------------------------------------------------------------------------------------------- driver side
def launch(engine: str, world_size: int, args) -> list[dict] | str:
    worker_args = ["--engine", engine, "--model", args.model, "--batch-size", str(args.batch_size), "--steps",
                   str(args.steps), "--precision", args.precision]  # fmt: skip
    worker_args += ["--grad-checkpointing"] if args.grad_checkpointing else []
    # tensors of 4 MB+ are mmap'ed: freed memory leaves the process, RSS means live bytes
    return ranks.launch(__file__, world_size, worker_args, args.timeout, mmap_threshold=4 << 20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2])
    setups = harness.measurable_setups()
    p.add_argument("--engines", nargs="+", default=setups, choices=setups, help="memory setups (bigclip plan's rows)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from bigclip.memory import model_facts, state_bytes

    facts = model_facts(args.model)
    plan_precision = "fp32" if args.precision == "fp32" else "amp"
    MiB = 2**20
    print(
        f"# {args.model} ({facts.params / 1e6:.1f}M parameters), precision {args.precision}, "
        f"batch {args.batch_size} per rank, CPU + gloo\n"
    )
    print(
        f"| engine | world | params MiB | grads MiB | optimizer MiB | state MiB/rank | vs {args.engines[0]} | "
        "plan MiB | measured/plan | peak RSS MiB/rank | samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.world_sizes:
        base_state = None
        for engine in args.engines:
            result = launch(engine, n, args)
            if isinstance(result, str):
                print(f"| {engine} | {n} | {result} |")
                continue
            r0 = result[0]
            s = r0["state"]
            if engine == args.engines[0]:  # the baseline: the first engine listed (default: DDP, replicated)
                base_state = s["total"]
            plan = state_bytes(engine, facts.params, n, plan_precision, facts if plan_precision == "amp" else None)
            peak = max(r["peak_rss"] for r in result)
            step_s = max(r["step_s"] for r in result)
            ratio = f"{s['total'] / base_state:.2f}" if base_state else "-"
            print(
                f"| {engine} | {n} | {s['params'] / MiB:.0f} | {s['grads'] / MiB:.0f} | "
                f"{s['optimizer'] / MiB:.0f} | {s['total'] / MiB:.0f} | {ratio} | {plan / MiB:.0f} | "
                f"{s['total'] / plan:.2f} | {peak / MiB:.0f} | {args.batch_size * n / step_s:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
