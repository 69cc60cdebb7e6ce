"""How long does a checkpoint stop training? OpenCLIP's way vs bigclip's, side by side, same state, same run.

    python bench/checkpoint_stall.py [--model ViT-B-32] [--modes thread,process,thread-local] [--steps 4]
                                     [--deepspeed]

One process (a 1-rank gloo group, so DCP's process writer can run), a real CLIP model with AdamW state of
>= 1 GB, and a local S3-protocol server (moto, started here as a separate process on 127.0.0.1). Measured:

  sync torch.save     the loop is blocked while rank 0 torch.saves the full state (OpenCLIP; its upload is a
                      separate `aws s3 sync` later, not counted)
  bigclip blocked     time inside CheckpointManager.save() plus the wait before the next optimizer step
                      (the state is copied into reused host buffers while forward/backward run; the first
                      save allocates them and is reported too)
  bigclip commit      from save() to manifest.json in the S3 server (DCP write, hash, upload, commit)
  upload floor        s3fs put of the same files (no DCP, no hashing, no manifest): the store's own speed
  step time           training steps while the save runs in the background vs steps with no save
  thread-local        the thread writer with no remote store: what bigclip's own background work (DCP
                      serialisation, CRC-32, fsync) costs a step, without the local S3 server's CPU
  --deepspeed         the same for a DeepSpeed ZeRO-2 engine: DeepSpeed's own save_checkpoint (its default
                      checkpoint engine torch.saves on the main thread) vs bigclip's staging engine

Targets (issue 5): blocked <= 5% of the sync save; commit <= 1.5x the upload floor; steps during a background
save within 10% of normal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from ranks import free_port


def start_s3() -> tuple[subprocess.Popen, str]:
    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    # The server stands in for a remote store, but here it shares the training host's CPU: its own work
    # (request parsing, MD5 ETags) slows training steps too. Not niced: a niced server starves whenever other
    # jobs load the machine, which makes the commit times meaningless.
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return proc, endpoint


def build(
    model_name: str, batch_size: int, zero_stage: int | None = None, device=None, precision: str = "fp32", **flags
):
    """(engine, world, step): a 1-rank engine for the model (bench/harness.py; DeepSpeed ZeRO-`zero_stage` if
    given; `flags`: more TrainConfig fields, e.g. opt, engine, grad_checkpointing), and step(before_update) ->
    seconds: one training step on a fixed batch, before_update waited for between the backward and the update."""
    import harness  # here, not at the top: main() sets the training threads before torch is imported
    import torch

    from bigclip.dist import World
    from bigclip.engine.single import ensure_process_group

    world = World(device=device or torch.device("cpu"))
    ensure_process_group(world)  # a 1-rank group: what the process writer needs, as in any torchrun job
    cfg = harness.config(model=model_name, precision=precision, batch_size=batch_size,
                         **(harness.zero(zero_stage) if zero_stage else {}), **flags)  # fmt: skip
    bench = harness.build(cfg, world)
    images, texts = next(harness.synthetic_batches(cfg, world, 1, seed=0))

    def step(before_update=None) -> float:
        # as the loop does: an asynchronous save finishes its copy before the update (timed: the loop waits)
        return bench.step(images, texts, wait=before_update)[1]

    return bench.engine, world, step


def state_bytes(engine) -> int:
    """What a checkpoint of this rank holds: its parameters and optimizer state, as the engine counts them."""
    b = engine.state_bytes()
    return b["params"] + b["optimizer"]


def sync_torch_save(engine, path: str) -> float:
    import torch

    t = time.perf_counter()
    torch.save({"state_dict": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()}, path)
    return time.perf_counter() - t


def deepspeed_sync_save(engine, path: str) -> float:
    """DeepSpeed's own save_checkpoint with its default checkpoint engine (torch.save on the main thread)."""
    t = time.perf_counter()
    engine.ds.save_checkpoint(path, tag="engine_state", save_latest=False)
    return time.perf_counter() - t


S3_SERVER_PID: int | None = None


def _cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) used so far by process `pid` (0 when there is none)."""
    if pid is None:
        return 0.0
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def bigclip_save(engine, world, step, mode: str, local: str, remote: str | None, steps_during: int) -> dict:
    from bigclip.ckpt import CheckpointManager

    manager = CheckpointManager(local, engine, world, remote=remote, async_mode=mode)
    manager.save("warmup", 1, 0)  # first save: allocates the staging buffers (and the writer process)
    step(manager.wait_staged)
    manager.wait()
    first = manager.results[-1]
    # Idle commit: the same save with no training competing for the CPU (what the store and writer can do).
    manager.save("idle", 1, 0, blocking=False)
    manager.wait()
    idle = manager.results[-1]
    server = _cpu_seconds(S3_SERVER_PID)
    manager.save("measured", 1, 0)
    during = steps_while(lambda: not manager._pending.done(), lambda: step(manager.wait_staged), steps_during)
    manager.wait()
    result = manager.results[-1]  # blocked_s = time in save() + the wait before the next optimizer step
    server = _cpu_seconds(S3_SERVER_PID) - server
    assert result.error is None, result.error
    manager.close()
    return {
        "first_blocked": first.blocked_s,
        "blocked": result.blocked_s,
        "commit": result.commit_s,
        "server_cpu": server,
        "idle_commit": idle.commit_s,
        "bytes": result.bytes,
        "files": result.files,
        "during": during,
    }


def os_copy_control(step, src: str, dst: str, steps_during: int) -> list[float]:
    """Training steps while the OS itself copies the same files (cp + sync, no Python, no hashing): how much
    moving that many bytes costs a step on this machine, whatever does it."""
    proc = subprocess.Popen(["sh", "-c", f'cp -r "{src}" "{dst}" && sync'])
    during = steps_while(lambda: proc.poll() is None, step, steps_during)
    proc.wait()
    return during


def steps_while(busy, step, steps_during: int) -> list[float]:
    """Times of the steps that start while busy() (at least one, at most 6 x steps_during)."""
    during = [step()]
    while busy() and len(during) < 6 * steps_during:
        during.append(step())
    return during


def slowdown(during: list[float], baseline: float) -> str:
    median = statistics.median(during)
    return f"{median:.2f} s ({100 * (median / baseline - 1):+.0f}%)"


def upload_floor(local_ckpt: str, remote_dir: str) -> float:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    files = [os.path.join(d, f) for d, _, names in os.walk(local_ckpt) for f in names]
    targets = [remote_dir + "/" + os.path.relpath(f, local_ckpt) for f in files]
    t = time.perf_counter()
    fs.put(files, targets)  # s3fs: files concurrently, large ones as multipart
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="baseline steps (median)")
    p.add_argument("--modes", default="thread,process,thread-local")
    p.add_argument("--deepspeed", action="store_true", help="also measure a DeepSpeed ZeRO-2 engine")
    p.add_argument("--out", default="/tmp/ckpt_bench.md")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="training threads (default 1: one core trains, as a GPU job's loop thread does; the "
        "other core is what background work and the local S3 server share)",
    )
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    moto, endpoint = start_s3()
    global S3_SERVER_PID
    S3_SERVER_PID = moto.pid
    work = tempfile.mkdtemp(prefix="bigclip-ckpt-bench-")
    try:
        engine, world, step = build(args.model, args.batch_size)
        step()  # AdamW state exists from here on
        nbytes = state_bytes(engine)
        base = [step() for _ in range(args.steps)]
        baseline = statistics.median(base)
        print(f"{args.model}: state {nbytes / 1e9:.2f} GB (fp32 weights + AdamW), step {baseline:.2f} s")

        sync_s = statistics.median(sync_torch_save(engine, os.path.join(work, f"openclip_{i}.pt")) for i in range(2))
        print(f"sync torch.save (OpenCLIP): loop blocked {sync_s:.2f} s")
        for i in range(2):
            os.remove(os.path.join(work, f"openclip_{i}.pt"))

        rows = {}
        after = []
        for mode in args.modes.split(","):
            writer, _, where = mode.partition("-")
            remote = None if where == "local" else f"s3://bench/{mode}/checkpoints"
            r = bigclip_save(engine, world, step, writer, os.path.join(work, mode), remote, steps_during=args.steps)
            rows[mode] = r
            after += [step() for _ in range(args.steps)]  # no save in flight: more baseline samples
            print(
                f"bigclip {mode}: blocked {r['blocked']:.3f} s (first save {r['first_blocked']:.3f} s), "
                f"commit {r['commit']:.1f} s (idle {r['idle_commit']:.1f} s), {r['files']} files, steps during save "
                f"{statistics.median(r['during']):.2f} s"
            )
        control = None
        local_mode = next((m for m in rows if m.endswith("-local")), None)
        if local_mode:
            control = os_copy_control(
                step, os.path.join(work, local_mode, "measured"), os.path.join(work, "os_copy"), args.steps
            )
            after += [step() for _ in range(args.steps)]
            print(f"control, cp + sync of the same files: steps {statistics.median(control):.2f} s")
        baseline = statistics.median(base + after)  # steps without a save, before and between the modes
        print(f"step without a save (median of {len(base + after)}): {baseline:.2f} s")
        any_mode = next((m for m in rows if not m.endswith("-local")), next(iter(rows)))
        floor = upload_floor(os.path.join(work, any_mode, "measured"), "bench/floor/measured")
        print(f"upload floor (s3fs put of the same bytes): {floor:.1f} s")
        write_table(args, nbytes, baseline, sync_s, rows, floor, control)
        if args.deepspeed:
            del engine, step
            deepspeed_rows(args, world, work)
    finally:
        moto.terminate()
        shutil.rmtree(work, ignore_errors=True)


def deepspeed_rows(args, world, work) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine, world, step = build(args.model, args.batch_size, zero_stage=2)
    step()
    nbytes = state_bytes(engine)
    base = [step() for _ in range(args.steps)]
    sync_s = statistics.median(deepspeed_sync_save(engine, os.path.join(work, f"ds_sync_{i}")) for i in range(2))
    print(f"DeepSpeed ZeRO-2: state {nbytes / 1e9:.2f} GB; its own save_checkpoint blocks {sync_s:.2f} s")
    r = bigclip_save(
        engine, world, step, "thread", os.path.join(work, "ds"), "s3://bench/ds/checkpoints", steps_during=args.steps
    )
    base += [step() for _ in range(args.steps)]
    baseline = statistics.median(base)
    floor = upload_floor(os.path.join(work, "ds", "measured"), "bench/dsfloor/measured")
    lines = [
        "",
        f"DeepSpeed ZeRO-2 (`--deepspeed`, 1 rank, {nbytes / 1e9:.2f} GB of fp32 weights + fp32 partitions + AdamW "
        f"state; step without a save {baseline:.2f} s):",
        "",
        "| | DeepSpeed save_checkpoint (its torch.save engine) | bigclip (staging engine + save thread) |",
        "|---|---|---|",
        f"| loop blocked per save | {sync_s:.2f} s | {r['blocked']:.3f} s ({100 * r['blocked'] / sync_s:.1f}%) |",
        f"| first save (allocates staging buffers) | – | {r['first_blocked']:.3f} s |",
        f"| committed in S3 while training goes on | not uploaded | {r['commit']:.1f} s "
        f"({r['commit'] / floor:.2f}x floor {floor:.1f} s) |",
        f"| CPU time the S3 server used during the save | – | {r['server_cpu']:.1f} s |",
        f"| step time during the background save | – | {slowdown(r['during'], baseline)} |",
        "",
    ]
    text = "\n".join(lines)
    with open(args.out, "a") as f:
        f.write(text)
    print(text)


def _commit(r: dict, mode: str, key: str, floor: float) -> str:
    if mode.endswith("-local"):
        return f"{r[key]:.1f} s"
    return f"{r[key]:.1f} s ({r[key] / floor:.2f}x floor)"


def write_table(args, nbytes, baseline, sync_s, rows, floor, control=None) -> None:
    import platform

    import torch

    lines = [
        "## Checkpoint stall: OpenCLIP's synchronous save vs bigclip's asynchronous sharded save",
        "",
        f"`python bench/checkpoint_stall.py --model {args.model} --batch-size {args.batch_size} "
        f"--modes {args.modes}` — {args.model}, fp32 weights + AdamW state = **{nbytes / 1e9:.2f} GB**, one "
        f"process training on {args.threads} thread(s) of a {os.cpu_count()}-core CPU machine shared with other "
        f"jobs (no GPU; torch {torch.__version__.split('+')[0]}, "
        f"Python {platform.python_version()}), S3 = moto server on 127.0.0.1 (same CPU). Training step without a save: "
        f"{baseline:.2f} s.",
        "",
        "| | OpenCLIP: torch.save from rank 0 | "
        + " | ".join(
            f"bigclip, {m.split('-')[0]} writer" + (", local disk only" if m.endswith("-local") else "") for m in rows
        )
        + " |",
        "|---|---|" + "---|" * len(rows),
        f"| loop blocked per save | {sync_s:.2f} s | "
        + " | ".join(f"{r['blocked']:.3f} s ({100 * r['blocked'] / sync_s:.1f}%)" for r in rows.values())
        + " |",
        "| first save (allocates staging buffers) | – | "
        + " | ".join(f"{r['first_blocked']:.3f} s" for r in rows.values())
        + " |",
        "| committed (S3; local: renamed into place) while training goes on | not tracked (`aws s3 sync` every "
        "5 min) | " + " | ".join(_commit(r, m, "commit", floor) for m, r in rows.items()) + " |",
        "| committed, no training alongside | | "
        + " | ".join(_commit(r, m, "idle_commit", floor) for m, r in rows.items())
        + " |",
        "| raw upload of the same bytes (s3fs put), the floor | | "
        + " | ".join("–" if m.endswith("-local") else f"{floor:.1f} s" for m in rows)
        + " |",
        "| CPU time the S3 server used during the save | – | "
        + " | ".join("–" if m.endswith("-local") else f"{r['server_cpu']:.1f} s" for m, r in rows.items())
        + " |",
        "| step time during the background save | – | "
        + " | ".join(slowdown(r["during"], baseline) for r in rows.values())
        + " |",
        "",
        *(
            [
                f"Control: training steps while the OS copies the same files (`cp -r` + `sync`, no Python): "
                f"{slowdown(control, baseline)}."
            ]
            if control
            else []
        ),
        "",
        "Targets: blocked <= 5% of the synchronous save; commit <= 1.5x the upload floor; steps during a "
        "background save within 10% of normal.",
        "",
    ]
    text = "\n".join(lines)
    with open(args.out, "w") as f:
        f.write(text)
    print("\n" + text)


if __name__ == "__main__":  # the process writer re-imports __main__ in its daemon
    main()
