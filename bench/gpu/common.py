"""What every part of the GPU kit shares: where results go, how time and memory are measured.

A part writes its JSON after every figure (Recorder), so a part that runs out of its time budget still reports
what it measured before. Time on CUDA is CUDA events around each call after warm-up (median of the repeats);
on CPU (the smoke run) wall-clock time. Peak memory on CUDA is torch.cuda.max_memory_allocated above what was
allocated before the call; on CPU it is not measured (None).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench")
for _path in (REPO, BENCH):  # bigclip itself, and the CPU benchmarks whose pieces the kit reuses
    if _path not in sys.path:
        sys.path.insert(0, _path)


def part_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="the part's JSON file")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU: checks that the part runs")
    p.add_argument("--work", default=None, help="a scratch folder (run folders, checkpoints)")
    return p.parse_args()


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def _process_started() -> float:
    import psutil  # on the GPU machine's image and a DeepSpeed dependency here

    return psutil.Process().create_time()


def seconds_since_start() -> float:
    """Seconds since this process started (imports included): stamped on every row, so that a run's JSON shows where
    a part's budget went (one row's cost is the difference to the row before it)."""
    return time.time() - _process_started()


class Recorder:
    """The part's results: tables of rows (dicts, each stamped `at_s`: seconds since the part's process started)
    and notes, rewritten to --out after every addition."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict = {"tables": {}, "notes": []}
        self.flush()

    def row(self, table: str, **fields) -> None:
        fields["at_s"] = round(seconds_since_start(), 1)
        self.data["tables"].setdefault(table, []).append(fields)
        self.flush()
        print(table, json.dumps(fields), flush=True)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.flush()
        print("note:", text, flush=True)

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_ms(
    fn: Callable[[], object], dev: torch.device, warmup: int = 2, repeats: int = 10, max_s: float = 3.0
) -> float:
    """Median milliseconds of fn() after warm-up (CUDA events on a GPU, wall clock on CPU): `repeats` calls, or
    fewer (at least 3) once they took max_s, so that one slow configuration cannot eat a part's budget."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times: list[float] = []
    while len(times) < repeats and (len(times) < 3 or sum(times) < 1000 * max_s):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def peak_mib(fn: Callable[[], object], dev: torch.device) -> float | None:
    """MiB allocated at the peak of one fn() call above what was allocated before it (None on CPU)."""
    if dev.type != "cuda":
        fn()
        return None
    sync(dev)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    sync(dev)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
