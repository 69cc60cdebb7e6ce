"""`bigclip plan`'s peak-memory prediction against measurement, for every setup it describes.

    python bench/plan_check.py --model ViT-B-32 --batch-size 16
    python bench/plan_check.py --model ViT-L-14 --batch-size 2 --engines ddp fsdp
    python bench/plan_check.py --model local-dir:DIR --batch-size 8 --engines fsdp --grad-checkpointing
    python bench/plan_check.py --model ViT-B-32 --batch-size 16 --engines fsdp --replicas 2   # HSDP
    python bench/plan_check.py --model ViT-B-32 --batch-size 16 --ema --eval   # evaluation after the steps too

Setups: every memory setup bigclip's engines list whose state is on the GPU (bigclip.memory.memory_setups(): ddp,
fsdp, zero1-3, each selected by the flags it names) x every distinct precision and optimizer footprint
(bigclip.memory.recipes(): fp32, amp, bf16 weights x AdamW, 8-bit AdamW) x gradients kept or the optimizer stepped
in the backward. A setup bigclip refuses is listed with its one-line
refusal. Each other setup runs in a fresh 2-rank `torchrun` launch on this CPU (gloo): the real engine, loss and
loop step (build_model -> build_engine -> forward_backward -> optimizer_step) on random batches. Measured: the
rank's resident memory above its baseline, taken after imports and the process group and before the model is
built (Linux's VmHWM, reset at the baseline through /proc/self/clear_refs), the larger of the two ranks. Glibc
returns freed allocations of 64 KiB+ to the system (MMAP_THRESHOLD below), so resident memory follows live bytes.
Predicted: bigclip.memory.peak_parts for a CPU (the larger of the backward's and the optimizer step's peak, what
`bigclip plan` and `--dry-run` count) plus the runtime: the same setup measured the same way on test-tiny (almost
no state), what a training step costs on this machine besides the model (autograd, gloo, oneDNN, the compiler
behind torchao's updates), where a GPU's reserve stands in the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import harness
import ranks
from ranks import reset_resident_peak, resident_bytes, write_from_rank0

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
# Allocations from this size on are mmapped by glibc and unmapped when freed. At 1 MiB (the value until
# 2026-11-29) the leanest setup's ranks held 86-119 MiB of freed sub-MiB allocations (packed update windows'
# pieces, FSDP2's small all-gathers) in glibc's heaps between steps: malloc_trim(0) gave them back, and the
# resident memory at rest was then the live tensors (gc-counted, 303 MiB) plus test-tiny's runtime; measured at
# 64 KiB, nothing was left to trim and the peak fell from 1.13x to 1.03-1.06x of the plan's.
MMAP_THRESHOLD = 64 << 10
EVAL_BATCHES = 4  # --eval: validation batches per rank (retrieval over all ranks' samples)


def config(
    model: str,
    batch: int,
    setup: str,
    precision: str,
    opt: str,
    in_backward: bool,
    checkpointing=False,
    accum=1,
    locks: tuple[str, ...] = (),
    ema=False,
    replicas=1,
):
    """The resolved config of one measured setup (bench/harness.py: synthetic data, no workers); `locks`: the
    towers locked whole ("image": --lock-image, "text": --lock-text); `ema`: a moving average of the weights
    (--ema-decay); `replicas`: the state kept in that many replica groups (HSDP: the flag the setup names)."""
    from bigclip.errors import UserError
    from bigclip.memory import memory_setup

    replicated = {}
    if replicas > 1:
        flag = memory_setup(setup).replicas_flag
        if flag is None:
            raise UserError(f"--replicas {replicas}: {setup} cannot keep the state in replica groups")
        replicated = {flag: replicas}
    return harness.config(
        **replicated,
        **{f"lock_{tower}": True for tower in locks},
        **({"ema_decay": 0.999} if ema else {}),
        model=model,
        precision=precision,
        opt=opt,
        optimizer_in_backward=in_backward,
        batch_size=batch,
        accum_freq=accum,
        grad_checkpointing=checkpointing,
        **harness.setup_flags(setup),
    )


# ------------------------------------------------------------------------------------------- worker side
def evaluate(engine, batches: list, world) -> None:
    """What the loop's evaluation does with the model after an epoch (bigclip.evaluation's validation: forwards
    without gradients, the features gathered, retrieval), with the live weights and, with a moving average,
    again with the average swapped in (--eval-ema)."""
    from bigclip.evaluation.validate import validate

    engine.eval()
    validate(engine, batches, world, 4096, "fp32")
    if engine.ema is not None:
        with engine.ema.swapped_in():
            validate(engine, batches, world, 4096, "fp32")
    engine.train()


def worker(args) -> None:
    import torch.distributed as dist

    from bigclip.dist import init_distributed, shutdown
    from bigclip.engine.memory import peak_rss_bytes

    world = init_distributed("cpu")
    cfg = config(args.model, args.batch_size, args.engine, args.precision, args.opt, args.in_backward,
                 args.grad_checkpointing, args.accum_freq, args.lock, args.ema, args.replicas)  # fmt: skip
    dist.barrier()
    baseline = resident_bytes()
    reset_resident_peak()
    bench = harness.build(cfg, world)  # the model, engine and (tiny) loss as `bigclip train` builds them
    # Each step's micro-batches made for it, after the baseline: on a GPU the loop copies them to the device for
    # the step (the loader's are in host memory), and the plan counts them (input_bytes)
    evaluation = EVAL_BATCHES if args.eval else 0
    batches = harness.synthetic_batches(cfg, world, args.steps * args.accum_freq + evaluation)
    for _ in range(args.steps):
        bench.accumulated_step([next(batches) for _ in range(args.accum_freq)])
    if args.eval:  # the run's peak must stay the training step's: validation, then --eval-ema's
        evaluate(bench.engine, [next(batches) for _ in range(evaluation)], world)
    out = {"rank": world.rank, "above_baseline": peak_rss_bytes() - baseline, "baseline": baseline}
    write_from_rank0(out, args.out, world.world_size, world.rank)
    shutdown()


# ------------------------------------------------------------------------------------------- driver side
def launch(engine: str, precision: str, opt: str, in_backward: bool, args, model: str) -> list[dict] | str:
    worker_args = ["--engine", engine, "--precision", precision, "--opt", opt, "--model", model, "--batch-size",
                   str(args.batch_size), "--steps", str(args.steps)]  # fmt: skip
    worker_args += ["--in-backward"] if in_backward else []
    worker_args += ["--accum-freq", str(args.accum_freq)]
    worker_args += ["--lock", *args.lock] if args.lock else []
    worker_args += ["--grad-checkpointing"] if args.grad_checkpointing else []
    worker_args += ["--ema"] if args.ema else []
    worker_args += ["--eval"] if args.eval else []
    worker_args += ["--replicas", str(args.replicas)]
    return ranks.launch(__file__, WORLD, worker_args, args.timeout, mmap_threshold=MMAP_THRESHOLD)


def refusal(engine: str, precision: str, opt: str, in_backward: bool, args) -> str | None:
    from bigclip.errors import UserError

    try:
        config(args.model, args.batch_size, engine, precision, opt, in_backward, args.grad_checkpointing,
               args.accum_freq, args.lock, args.ema, args.replicas)  # fmt: skip
    except UserError as e:
        return str(e)
    return None


def render(
    rows: list[dict],
    model: str,
    batch: int,
    checkpointing: bool = False,
    accum: int = 1,
    locks: tuple = (),
    ema: bool = False,
    replicas: int = 1,
    evaluated: bool = False,
) -> list[str]:
    """The table: each measured row next to the plan's prediction for it (recomputed: the arithmetic may change)."""
    from bigclip.memory import Locks, StateRecipe, model_facts, peak_parts

    locked = Locks(0 if "image" in locks else None, 0 if "text" in locks else None) if locks else None
    facts = model_facts(model, None, locked)
    MiB = 2**20
    lines = [
        f"{model} ({facts.params / 1e6:.1f}M parameters), batch {batch} per rank, {WORLD} ranks, CPU + gloo"
        + (", --grad-checkpointing" if checkpointing else "")
        + (f", --accum-freq {accum}" if accum > 1 else "")
        + "".join(f", --lock-{tower}" for tower in locks)
        + (", --ema-decay" if ema else "")
        + (f", the state in {replicas} replica groups (HSDP)" if replicas > 1 else "")
        + (", then validation" + (" live and averaged (--eval-ema)" if ema else "") if evaluated else ""),
        "",
        "| engine | precision | optimizer | in backward | state MiB | activations MiB | working MiB | plan peak MiB "
        "| + runtime MiB | predicted MiB | measured MiB | measured/predicted | within 10% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['engine']} | {r['precision']} | {r['opt']} | {'yes' if r['in_backward'] else 'no'} |"
        if "result" in r:
            lines.append(f"{head} {r['result']} ||||||||")
            continue
        recipe = StateRecipe(r["precision"], r["opt"], r["in_backward"], ema=ema, accum_freq=accum)
        parts = peak_parts(
            r["engine"], facts, WORLD, recipe, batch, checkpointing, device_type="cpu", state_ranks=WORLD // replicas
        )
        predicted = parts["peak"] + r["runtime"]
        ratio = r["measured"] / predicted
        lines.append(
            f"{head} {parts['state'] / MiB:.0f} | {parts['activations'] / MiB:.0f} | {parts['working'] / MiB:.0f} | "
            f"{parts['peak'] / MiB:.0f} | {r['runtime'] / MiB:.0f} | {predicted / MiB:.0f} | "
            f"{r['measured'] / MiB:.0f} | {ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.1 else 'NO'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, REPO)
    import bigclip.engine  # noqa: F401  (the engines list their memory setups)
    from bigclip.memory import distinct_optimizers, distinct_precisions
    from bigclip.optim import OPTIMIZERS
    from bigclip.precision import PRECISIONS

    on_gpu = harness.measurable_setups()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--engines", nargs="+", default=on_gpu, choices=on_gpu, help="memory setups (bigclip plan's rows)")
    p.add_argument("--precisions", nargs="+", default=distinct_precisions(), choices=PRECISIONS.names())
    p.add_argument("--opts", nargs="+", default=distinct_optimizers(), choices=OPTIMIZERS.names())
    p.add_argument("--stepping", nargs="+", default=["kept", "in-backward"], choices=("kept", "in-backward"),
                   help="gradients kept until the step, or the optimizer stepped in the backward")  # fmt: skip
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute every block in backward")
    p.add_argument("--accum-freq", type=int, default=1, help="micro-batches per step (the loop's feature cache)")
    p.add_argument("--lock", nargs="+", default=[], choices=("image", "text"), help="towers locked whole (LiT)")
    p.add_argument("--ema", action="store_true", help="a float32 moving average of the weights (--ema-decay)")
    p.add_argument("--replicas", type=int, default=1, help="replica groups of the state (HSDP; setups that have it)")
    p.add_argument("--eval", action="store_true", help="then validate (with --ema: also the average), measured too")
    p.add_argument("--json", metavar="FILE", help="also write the measurements to FILE")
    p.add_argument("--from-json", metavar="FILE", help="only print the table of measurements written before")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--opt", help=argparse.SUPPRESS)
    p.add_argument("--in-backward", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        shape = (saved["model"], saved["batch"], saved.get("checkpointing", False), saved.get("accum_freq", 1),
                 tuple(saved.get("locks", ())), saved.get("ema", False), saved.get("replicas", 1),
                 saved.get("eval", False))  # fmt: skip
        print("\n".join(render(saved["rows"], *shape)))
        return 0

    rows = []
    shape = (args.model, args.batch_size, args.grad_checkpointing, args.accum_freq, tuple(args.lock), args.ema,
             args.replicas, args.eval)  # fmt: skip
    for engine in args.engines:
        for precision in args.precisions:
            for opt in args.opts:
                for in_backward in [mode == "in-backward" for mode in args.stepping]:
                    row = dict(engine=engine, precision=precision, opt=opt, in_backward=in_backward)
                    refused = refusal(engine, precision, opt, in_backward, args)
                    if refused:
                        rows.append({**row, "result": f"refused: {refused}"})
                        continue
                    result = launch(engine, precision, opt, in_backward, args, args.model)
                    # the same setup on a model of almost no state: what a training step costs besides the
                    # model on this machine (autograd, gloo, oneDNN, the compiler behind torchao's updates)
                    runtime = launch(engine, precision, opt, in_backward, args, "test-tiny")
                    failed = next((r for r in (result, runtime) if isinstance(r, str)), None)
                    if failed:
                        rows.append({**row, "result": failed})
                    else:
                        measured = max(r["above_baseline"] for r in result)
                        rows.append({**row, "measured": measured, "runtime": max(r["above_baseline"] for r in runtime)})
                    print(render(rows[-1:], *shape)[-1], flush=True)
                    if args.json:
                        saved = {"model": args.model, "batch": args.batch_size, "rows": rows,
                                 "checkpointing": args.grad_checkpointing, "accum_freq": args.accum_freq,
                                 "locks": list(args.lock), "ema": args.ema, "replicas": args.replicas,
                                 "eval": args.eval}  # fmt: skip
                        with open(args.json, "w") as f:
                            json.dump(saved, f, indent=1)
    print("\n".join(render(rows, *shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
