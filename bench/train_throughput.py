"""Training throughput of `test-tiny`: one process vs 2-rank DDP on this machine, side by side.

    python bench/train_throughput.py [--batch-size 32] [--samples 2048] [--threads-per-rank 1]

Both runs use the same per-process batch and the same number of threads per process, so the ratio
shows what a second rank buys (and what gradient all-reduce over gloo costs). Samples/s is read from
the runs' own metrics.jsonl (the same numbers the progress lines print), skipping the first steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from harness import REPO, bigclip_records, trainer_env, trainer_flags
from ranks import free_port

SCRIPT = os.path.join(REPO, "launch", "train.py")


def measure(nproc: int, args, logs: str) -> dict:
    name = f"ranks{nproc}"
    flags = trainer_flags("test-tiny", args.batch_size, args.samples, logs, name)
    if nproc == 1:
        cmd = [sys.executable, SCRIPT, *flags]
    else:
        # "--": see README (torchrun vs --logs)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", SCRIPT, "--", *flags]  # fmt: skip
    env = trainer_env(OMP_NUM_THREADS=str(args.threads_per_rank))
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    records = bigclip_records(logs, name)
    steady = records[args.skip_steps :] or records
    return {
        "ranks": nproc,
        "steps": len(records),
        "global_batch": args.batch_size * nproc,
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "per_rank": statistics.median(r["samples_per_s_per_gpu"] for r in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--skip-steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        rows = [measure(1, args, logs), measure(2, args, logs)]
    base = rows[0]["samples_per_s"]
    print(
        f"test-tiny, fp32, CPU, batch {args.batch_size} per process, {args.threads_per_rank} thread(s) per "
        f"process, median over steps after the first {args.skip_steps}"
    )
    print()
    print("| setup | global batch | samples/s | samples/s per rank | vs 1 process |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        label = "1 process" if r["ranks"] == 1 else f"DDP, {r['ranks']} ranks (gloo)"
        print(
            f"| {label} | {r['global_batch']} | {r['samples_per_s']:.0f} | {r['per_rank']:.0f} | "
            f"{r['samples_per_s'] / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
