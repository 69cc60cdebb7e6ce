"""One table row per run folder under a directory: final training loss, zero-shot accuracy, samples/s and peak
memory, read from each run's metrics.jsonl (what bigclip writes every log step and every evaluation).

    python launch/experiments/summarize_runs.py logs/int8-switchback
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def summarize(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    if not steps:
        return None
    zeroshot = next((r[k] for r in reversed(evals) for k in ("eval/zeroshot_top1", "eval/imagenet-zeroshot-val-top1")
                     if k in r), None)  # fmt: skip
    rates = [r["samples_per_s"] for r in steps[1:] if "samples_per_s" in r] or [steps[0].get("samples_per_s", 0)]
    return {
        "run": os.path.basename(run_dir.rstrip("/")),
        "steps": steps[-1]["step"],
        "final loss": steps[-1]["loss"],
        "zero-shot top-1": zeroshot,
        "samples/s": statistics.median(rates) if rates else None,
        "peak memory": max(r.get("peak_memory_bytes", 0) for r in steps),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| run | steps | final loss | zero-shot top-1 | samples/s (median) | peak memory (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        zs = f"{r['zero-shot top-1']:.3f}" if r["zero-shot top-1"] is not None else "-"
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['final loss']:.4f} | {zs} | {r['samples/s']:.0f} | "
            f"{r['peak memory'] / 2**20:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: summarize_runs.py DIR  (a folder of bigclip run folders)", file=sys.stderr)
        return 2
    root = argv[0]
    rows = [r for name in sorted(os.listdir(root)) if (r := summarize(os.path.join(root, name))) is not None]
    if not rows:
        print(f"summarize_runs.py: no run with metrics.jsonl under {root}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
