"""Tune the fused loss path on this GPU: tile sizes of its Triton kernels, rows per cuBLAS chunk per N range,
and the batch below which `--loss-impl auto` keeps the naive loss; writes them where the kernels read them.

    python bench/gpu/tune_losses.py                      # writes bigclip/loss/fused_tuning.json (~3 minutes)
    python bench/gpu/tune_losses.py --out tuned.json --budget-s 200
    python bench/gpu/tune_losses.py --smoke --out tuned.json   # CPU, Triton's interpreter, toy sizes (tests)

Per family (clip, siglip) and feature dtype (bf16 at --loss-precision exact, the default; fp32 at fast, TF32):
1. tiles: each candidate at N = 65536, d = 1024, 2048 rows a chunk; the fastest is kept;
2. chunk rows at N = 16384, 65536 and 262144 (the plans for N <= 32768, <= 131072 and above), the fastest whose
   peak memory stays within that range's cap (1, 2 and 6 GiB above the features: the issue's bounds);
3. naive vs fused at N = 2048 ... 16384: auto keeps the naive loss up to the largest N^2 where it was faster.
fp16 takes bf16's plans (same element size, not measured). Every measurement goes into the file's
`measurements`, with the device, date and commit in its `source`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import torch
from common import REPO, free_memory, is_oom, peak_mib, time_ms
from loss_reference import clip_reference, max_rel_err, siglip_reference
from part_losses import call, features

from bigclip.loss import ClipLoss, SigLipLoss, fused_tuning

TILES = [  # (bm, bn, warps), used for the gradient / SigLIP kernel and for the CLIP statistics kernel alike
    (32, 256, 8),
    (16, 512, 8),
    (64, 128, 4),
    (32, 128, 4),
    (8, 1024, 8),
]
CHUNKS = {16384: (1024, 2048, 4096, 8192), 65536: (1024, 2048, 4096, 8192), 262144: (512, 1024, 2048)}
RANGES = {16384: 32768, 65536: 131072, 262144: None}  # the N measured -> the plan's max_n
CAP_GIB = {16384: 1.0, 65536: 2.0, 262144: 6.0}
CASES = (("clip", torch.bfloat16, "exact"), ("siglip", torch.bfloat16, "exact"),
         ("clip", torch.float32, "fast"), ("siglip", torch.float32, "fast"))  # fmt: skip
MORE_CHECKS = (("clip", torch.float16, "exact"), ("siglip", torch.float32, "exact"))  # checked, not tuned
SCALE = {"clip": 30.0, "siglip": 10.0}


def plan_dict(tile, chunk: int, max_n) -> dict:
    bm, bn, warps = tile
    return dict(max_n=max_n, chunk_rows=chunk, bm=bm, bn=bn, warps=warps, stats_bm=bm, stats_bn=bn, stats_warps=warps)


def smoke_sizes() -> None:
    """Toy sizes for a CPU run under Triton's interpreter: the same steps, seconds instead of minutes."""
    global TILES, CHUNKS, RANGES, CAP_GIB, DIM, CHECK_N, TILE_N, TILE_CHUNK, NAIVE_NS, CASES, MORE_CHECKS
    CASES, MORE_CHECKS = (("clip", torch.bfloat16, "exact"), ("siglip", torch.float32, "fast")), ()
    TILES = [(16, 64, 4), (32, 32, 4)]
    CHUNKS = {64: (32, 64), 128: (64,), 256: (64, 128)}
    RANGES = {64: 32768, 128: 131072, 256: None}
    CAP_GIB = {64: 1.0, 128: 2.0, 256: 6.0}
    DIM, CHECK_N, TILE_N, TILE_CHUNK, NAIVE_NS = 32, 96, 128, 32, (64, 128)


DIM, CHECK_N, TILE_N, TILE_CHUNK, NAIVE_NS = 1024, 4096, 65536, 2048, (2048, 4096, 8192, 16384)


def run(family, dtype, precision, n, impl, repeats, dev) -> tuple[float, float]:
    """(ms, peak GiB) of forward + backward, (inf, inf) when out of memory."""
    image, text = features(n, DIM, dtype, dev)
    image.requires_grad_()
    text.requires_grad_()
    scale = torch.tensor(SCALE[family], device=dev)
    bias = torch.tensor(-10.0, device=dev) if family == "siglip" else None
    if impl == "naive":
        import open_clip

        loss_fn = open_clip.loss.ClipLoss() if family == "clip" else open_clip.loss.SigLipLoss()
    else:
        loss_fn = (ClipLoss if family == "clip" else SigLipLoss)(impl="fused", precision=precision)

    def step():
        image.grad = text.grad = None
        call(loss_fn, family, image, text, scale, bias).backward()

    try:
        ms = time_ms(step, dev, warmup=1, repeats=repeats, max_s=1.0)
        image.grad = text.grad = None  # the peak counts the gradients this call makes, from nothing
        mib = peak_mib(step, dev)
        gib = 0.0 if mib is None else mib / 1024
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        ms = gib = float("inf")
    image.grad = text.grad = None
    free_memory()
    return ms, gib


def check_correct(dev) -> None:
    """Tune nothing that computes wrong numbers: every case at N = 4096 (two chunks and more) against float64."""
    for family, dtype, precision in CASES + MORE_CHECKS:
        image, text = features(CHECK_N, DIM, dtype, dev)
        image.requires_grad_()
        text.requires_grad_()
        scale = torch.tensor(SCALE[family], device=dev)
        bias = torch.tensor(-10.0, device=dev) if family == "siglip" else None
        loss = call((ClipLoss if family == "clip" else SigLipLoss)(impl="fused", precision=precision), family,
                    image, text, scale, bias)  # fmt: skip
        loss.backward()
        ref = (
            clip_reference(image, text, SCALE[family])
            if family == "clip"
            else siglip_reference(image, text, SCALE[family], -10.0)
        )
        err = max_rel_err((loss.detach(), image.grad, text.grad), ref)
        # the features' own rounding of their gradients (bf16 2^-9, fp16 2^-12 relative), TF32's 2^-11 on x
        bound = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-5 if precision == "exact" else 2e-3}
        print(json.dumps(dict(check=family, dtype=str(dtype), precision=precision, max_rel_err=f"{err:.1e}")))
        if not err <= bound[dtype]:
            raise SystemExit(f"tune_losses.py: the fused {family} loss ({dtype}, {precision}) is off by {err:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=fused_tuning.TUNING_FILE)
    p.add_argument("--budget-s", type=float, default=290.0, help="stop sweeping (keeping the best so far) after this")
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), toy sizes: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        smoke_sizes()
    dev = torch.device("cpu" if args.smoke else "cuda")
    deadline = time.monotonic() + args.budget_s
    check_correct(dev)
    with open(fused_tuning.TUNING_FILE) as f:
        table = json.load(f)
    measurements = []

    def note(**row):
        measurements.append(row)
        print(json.dumps(row), flush=True)

    for family, dtype, precision in CASES:
        key = str(dtype).removeprefix("torch.")
        current = table["plans"][family][key]
        best_tile, best_ms = TILES[0], float("inf")
        for tile in TILES:  # 1. tiles
            if time.monotonic() > deadline:
                break
            chunk = TILE_CHUNK
            table["plans"][family][key] = [plan_dict(tile, chunk, None)]
            fused_tuning.use_table(table)
            ms, gib = run(family, dtype, precision, TILE_N, "fused", 5, dev)
            note(step="tile", family=family, dtype=key, n=TILE_N, tile=tile, chunk=chunk, ms=round(ms, 2),
                 gib=round(gib, 3))  # fmt: skip
            if ms < best_ms:
                best_tile, best_ms = tile, ms
        plans = []
        for n, chunks in CHUNKS.items():  # 2. chunk rows per N range
            best = None
            for chunk in chunks:
                if time.monotonic() > deadline:
                    break
                table["plans"][family][key] = [plan_dict(best_tile, chunk, None)]
                fused_tuning.use_table(table)
                ms, gib = run(family, dtype, precision, n, "fused", 2 if n == max(CHUNKS) else 5, dev)
                note(step="chunk", family=family, dtype=key, n=n, tile=best_tile, chunk=chunk, ms=round(ms, 2),
                     gib=round(gib, 3))  # fmt: skip
                if gib <= CAP_GIB[n] and (best is None or ms < best[0]):
                    best = (ms, chunk)
            old = next((q for q in current if q.get("max_n") == RANGES[n]), current[-1])
            plans.append(plan_dict(best_tile, best[1], RANGES[n]) if best else dict(old, max_n=RANGES[n]))
        table["plans"][family][key] = plans
        fused_tuning.use_table(table)
        largest = 0  # 3. where the naive loss is faster
        for n in NAIVE_NS:
            if time.monotonic() > deadline:
                break
            naive_ms, _ = run(family, dtype, precision, n, "naive", 10, dev)
            fused_ms, _ = run(family, dtype, precision, n, "fused", 10, dev)
            note(step="naive", family=family, dtype=key, n=n, naive_ms=round(naive_ms, 3), fused_ms=round(fused_ms, 3))
            if naive_ms >= fused_ms:
                break
            largest = n * n
        table.setdefault("naive_max_logits", {}).setdefault(family, {})[key] = largest
    for family in ("clip", "siglip"):  # fp16 as bf16 (same element size; not measured)
        table["plans"][family]["float16"] = table["plans"][family]["bfloat16"]
        naive = table.setdefault("naive_max_logits", {}).setdefault(family, {})
        naive["float16"] = naive.get("bfloat16", 0)
    fused_tuning.use_table(None)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    where = "CPU (smoke run: toy sizes)" if args.smoke else torch.cuda.get_device_name()
    table["source"] = (
        f"bench/gpu/tune_losses.py on {where}, {datetime.date.today()}, commit "
        f"{commit.stdout.strip() or 'unknown'}, torch {torch.__version__}"
    )
    table["measurements"] = measurements
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
