"""Constructing models on the meta device: torch.device("meta") alone (every constructor's initialisation math run
on meta tensors) beside bigclip's meta_construction() (that math skipped; model/meta_build.py), same architectures,
same process, interleaved.

    python bench/meta_build.py                     # a few giants, then every name `bigclip models` counts
    python bench/meta_build.py --names ViT-bigG-14 EVA02-E-14 --repeats 5

Per architecture: the median construction time of each way over --repeats and the ratio; then the whole listing
(`bigclip models`' parameter count of every architecture, its cache not used) each way. Both ways must give the
same parameter names and shapes: the script stops if they do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bigclip.model.factory as factory  # noqa: E402
from bigclip.commands import models  # noqa: E402
from bigclip.model import create_model  # noqa: E402
from bigclip.model.meta_build import meta_construction  # noqa: E402

GIANTS = ["ViT-B-32", "ViT-H-14", "ViT-bigG-14", "EVA02-E-14", "convnext_xxlarge", "ViT-gopt-16-SigLIP2-384"]
WAYS = {"torch.device('meta')": lambda: torch.device("meta"), "meta_construction()": meta_construction}


def timed_build(name: str, way) -> tuple[float, dict]:
    factory.meta_construction = way  # the factory's construction context, swapped for the comparison
    start = time.perf_counter()
    model = create_model(name, device="meta")
    seconds = time.perf_counter() - start
    return seconds, {n: tuple(p.shape) for n, p in model.named_parameters()}


def timed_listing(way) -> float:
    factory.meta_construction = way
    start = time.perf_counter()
    models.entries(use_cache=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", nargs="+", default=GIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-listing", action="store_true", help="only the named architectures")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    plain, skipped = WAYS.values()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'architecture':<28} {'plain s':>8} {'skipped s':>9} {'ratio':>6}")
    for name in args.names:
        times = {way: [] for way in WAYS}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both ways alike
            shapes = {}
            for label, way in WAYS.items():
                seconds, shapes[label] = timed_build(name, way)
                times[label].append(seconds)
            if len({tuple(s.items()) for s in shapes.values()}) != 1:
                raise SystemExit(f"{name}: the two ways built different parameters")
        a, b = (statistics.median(t) for t in times.values())
        print(f"{name:<28} {a:>8.2f} {b:>9.2f} {a / b:>5.1f}x")
    if not args.no_listing:
        a, b = timed_listing(plain), timed_listing(skipped)
        print(f"{'every architecture (listing)':<28} {a:>8.1f} {b:>9.1f} {a / b:>5.1f}x")


if __name__ == "__main__":
    main()
