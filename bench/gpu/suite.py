"""The GPU acceptance kit: every part of what bigclip claims on a GPU, each under its own time budget, into one
Markdown report and one JSON of every figure.

    bash bench/gpu/run.sh OUTDIR                 # on the GPU machine (installs the carried wheels first)
    bash bench/gpu/run.sh --smoke OUTDIR         # here, on CPU, at toy sizes: the same parts and report
    bash bench/gpu/run.sh --parts losses,int8 OUTDIR   # a subset (a rerun of what failed)

Each part is its own process (bench/gpu/part_<name>.py) that writes its JSON after every figure; a part that
fails or runs past its budget is killed with its whole process group, reported with the end of its log and
what it measured until then, and the next part runs. OUTDIR gets report.md, results.json and parts.log.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# name -> (seconds on a GPU, seconds in the smoke run, what it measures). Order: cheap and most wanted first.
PARTS = {
    "env": (45, 60, "machine and versions"),
    "losses": (240, 120, "fused / naive / chunked CLIP and SigLIP losses beside Inf-CL and siglip-kernel"),
    "int8": (240, 90, "SwitchBack int8, fp8 and torchao int8 linears vs bf16 nn.Linear; ViT-H-14 tower with each"),
    "train": (130, 150, "training throughput, bigclip vs open_clip_train, ViT-B-32, batch 256, amp"),
    "engines": (90, 180, "DDP, FSDP2, ZeRO-2, ZeRO-3 on one GPU (NCCL), ViT-L-14: losses and peak memory vs plan"),
    "ckpt": (
        150,
        150,
        "checkpoint stall per writer x 3 repetitions, ViT-L-14 + AdamW and bigG's leanest state: blocked time, "
        "step time during an async save, commit time",
    ),
    "giant": (
        210,
        150,
        "the largest of ViT-bigG-14 / ViT-H-14 that trains: amp_bf16 AdamW, and the leanest setup; EVA02-E-14 leanest",
    ),
    "decode": (
        120,
        120,
        "input pipeline on 512- and 1024-px photos at 2, 4, 8 workers: --image-decode device / reduced, auto's pick",
    ),
}
# Folders a part makes in /dev/shm are named RAM_PREFIX + its pid + "-" (part_ckpt.py): removed after the part
RAM_PREFIX = "bigclip-kit-"
TOTAL_GPU_S = 480  # the bound for the whole kit on one H100: 8 minutes


def run_part(name: str, budget: float, smoke: bool, work: str, log_path: str) -> dict:
    out = os.path.join(work, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, f"part_{name}.py"), "--out", out, "--work", work]
    cmd += ["--smoke"] if smoke else []
    path = os.pathsep.join(p for p in (REPO, os.path.join(REPO, "bench"), HERE, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    t = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=budget) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"out of time ({budget:.0f} s)"
            _kill_group(proc)
    for leftover in glob.glob(os.path.join("/dev/shm", f"{RAM_PREFIX}{proc.pid}-*")):  # a killed part's, in RAM
        shutil.rmtree(leftover, ignore_errors=True)
    result = {"status": status, "wall_s": round(time.monotonic() - t, 1), "budget_s": round(budget)}
    try:
        with open(out) as f:
            result.update(json.load(f))
    except (OSError, json.JSONDecodeError):
        result.update(tables={}, notes=[])
    if status != "ok":
        with open(log_path, errors="replace") as f:
            result["log_tail"] = f.read().splitlines()[-25:]
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    """The part and everything it started (trainers, loader workers, checkpoint writers)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def markdown_table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in columns) + " |")
    return lines


def report(results: dict[str, dict], smoke: bool) -> str:
    env = (results.get("env", {}).get("tables", {}).get("machine") or [{}])[0]
    title = "GPU kit report" + (" (smoke run: CPU, toy sizes; the figures check that the kit runs)" if smoke else "")
    lines = [f"# {title}", ""]
    if env:
        lines += [", ".join(f"{k} {v}" for k, v in env.items() if k != "smoke"), ""]
    lines += ["| part | status | wall s | budget s |", "|---|---|---:|---:|"]
    lines += [f"| {n} | {r['status']} | {r['wall_s']} | {r['budget_s']} |" for n, r in results.items()]
    for name, r in results.items():
        if name == "env":
            continue
        lines += ["", f"## {name}: {PARTS[name][2]}", ""]
        for table, rows in r.get("tables", {}).items():
            lines += [f"{table}:", "", *markdown_table(rows), ""]
        lines += [f"- {n}" for n in r.get("notes", [])]
        if r.get("log_tail"):
            lines += ["", f"{r['status']}; the end of its log:", "", "```", *r["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, toy sizes (what CI runs)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--total-s", type=float, default=TOTAL_GPU_S, help="the whole kit's time on a GPU (seconds)")
    p.add_argument(
        "--part-s",
        action="append",
        default=[],
        metavar="PART=S",
        help="a part's own time budget in seconds on a GPU (repeatable), e.g. --part-s ckpt=150",
    )
    p.add_argument("outdir")
    args = p.parse_args()
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"run.sh --parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    own_budgets = {n: PARTS[n][1 if args.smoke else 0] for n in PARTS}
    for item in args.part_s:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            print(f"run.sh --part-s {item}: expected PART=SECONDS with PART one of {', '.join(PARTS)}", file=sys.stderr)
            return 2
        own_budgets[part] = float(seconds)
    os.makedirs(args.outdir, exist_ok=True)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU tensors
    deadline = time.monotonic() + (10**9 if args.smoke else args.total_s)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bigclip-gpu-kit-") as work:
        for name in names:
            budget = min(own_budgets[name], deadline - time.monotonic())
            if budget < 5:
                status = "not run: under 5 s left for it (its --part-s or the kit's --total-s)"
                results[name] = {"status": status, "wall_s": 0, "budget_s": 0}
                continue
            log_path = os.path.join(work, f"{name}.log")
            print(f"[gpu kit] {name}: up to {budget:.0f} s", flush=True)
            results[name] = run_part(name, budget, args.smoke, work, log_path)
            print(f"[gpu kit] {name}: {results[name]['status']} in {results[name]['wall_s']} s", flush=True)
            with open(os.path.join(args.outdir, "parts.log"), "a") as all_logs, open(log_path, errors="replace") as f:
                all_logs.write(f"===== {name}: {results[name]['status']}\n{f.read()}\n")
            _write(args.outdir, results, args.smoke)  # after every part: a killed kit still leaves a report
    _write(args.outdir, results, args.smoke)
    print(os.path.join(args.outdir, "report.md"))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def _write(outdir: str, results: dict, smoke: bool) -> None:
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump({"smoke": smoke, "parts": results}, f, indent=1, default=str)
    with open(os.path.join(outdir, "report.md"), "w") as f:
        f.write(report(results, smoke))


if __name__ == "__main__":
    sys.exit(main())
