"""Suite-wide set-up: runs draw no report of their own unless a test asks (BIGCLIP_RUN_REPORT=1: tests/test_report.py,
the demo), as drawing one costs seconds a run; after every test the process hands the memory it freed back to
the system; DeepSpeed's C++ ops are built in the machine's idle time.

Memory: a test process (-n 3: three of them) runs hundreds of tests, some of which hold two ViT-B models or train one
in-process (GBs). glibc keeps what they free in its heaps, so a worker's resident memory only grows (measured: 3.6
GB held after the OpenCLIP round-trip tests; two such workers beside multi-process runs reached 20 of 23 GB, and
a smaller CI machine killed a worker). malloc_trim(0) after each test returns the free pages (milliseconds); with
it, a whole `-n 3` run peaked at 10.5 GB in use on the machine (sampled every 20 s); 11.6 GB with each test process's
preloaded server (tests/preloaded.py, ~0.8 GB each).

In a fresh environment DeepSpeed JIT-builds two ops bigclip's runs use on first use: CPU Adam (cpu_adam, ~45 s,
ds_configs/zero3_offload.json) and async I/O with its pinned-memory helper (async_io + pin_memory, ~2 min,
ds_configs/zero3_nvme.json); its inference-only shared-memory collectives are never built (engine/deepspeed.py).
When the session runs a test of DeepSpeed's CPU Adam, its op is built from the start in a
process at a lower CPU priority (nice 5), so the compiler mostly uses cores the tests leave idle (single-process
runs, waits on timeouts and requeues) instead of running inside a test. Not the lowest priority: beside other
CPU-bound work at normal priority (a contributor's laptop) a nice-19 build got under 1% of a core and never
finished, and every DeepSpeed test waited on its lock. A test that needs an op before it is ready
waits on torch's build lock and then loads it, as with any concurrent build; built ops are cached in
torch's extensions directory and the process does nothing there.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

os.environ["BIGCLIP_RUN_REPORT"] = "0"  # in-process runs, and every subprocess the tests start (they copy os.environ)

_BUILD_OPS = """
import sys
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    builder = get_accelerator().create_op_builder(name)
    if builder.is_compatible():  # async_io needs libaio (.ci/run installs it)
        builder.load()
"""
# Which op a module's tests need, read from its text: a test that expects DeepSpeed's CPU Adam needs its op. Async
# I/O (~2 min of a core) is left to its one test, which builds it on first use. Both are in the extended tier
# (tests/test_zero_infinity.py): CI's tier builds no op.
_OPS_BY_TEXT = {"DeepSpeedCPUAdam": "CPUAdamBuilder"}
_WAIT_S = 900  # an unfinished build would leave torch's lock behind: let it finish


_LIBC = ctypes.CDLL("libc.so.6")


@pytest.fixture(autouse=True)
def _return_freed_memory():
    yield
    _LIBC.malloc_trim(0)


def pytest_configure(config) -> None:
    # Two test processes (-n 2) on a 2-core machine, each with torch's default of one intra-op thread per core, ask
    # for twice the cores, and OpenMP threads waiting at an op's end spin on a core the other process needs
    # (measured: the fast tier in 87 s instead of 103, 134 s of user time instead of 166, with one thread each;
    # with three processes on 2 cores, as CI runs the suite, each still gets one).
    # Each test process (xdist worker) takes its share of the cores before it imports torch, which reads the
    # variable; subprocesses inherit it; an OMP_NUM_THREADS set by the caller wins.
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        if "torch" in sys.modules:  # imported already (by a plugin): too late for the variable
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    # The extended tier is a part of the slow one: `-m "not slow"` (the fast tier) leaves it out too.
    for item in items:
        if item.get_closest_marker("extended"):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session) -> None:
    # DeepSpeed runs are whole trainings, all in the slow tier: the fast tier (no slow test) builds nothing, where it
    # would otherwise wait at its end for builds none of its tests used.
    if session.config.option.collectonly:  # --collect-only runs nothing (a build there took minutes of CPU)
        return
    modules = {item.path for item in session.items if item.get_closest_marker("slow")}
    texts = [path.read_text() for path in modules]
    ops = [op for key, op in _OPS_BY_TEXT.items() if any(key in text for text in texts)]
    if not ops:
        return
    session.config._deepspeed_op_build = subprocess.Popen(
        [sys.executable, "-c", _BUILD_OPS, *ops],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},  # the tests' accelerator, so the same builds
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(5),
    )


def pytest_sessionfinish(session) -> None:
    build = getattr(session.config, "_deepspeed_op_build", None)
    if build is not None:
        build.wait(timeout=_WAIT_S)
