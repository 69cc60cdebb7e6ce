"""What the multi-rank benchmarks share: a torchrun launch on CPU that returns each rank's results, gathered into
one JSON file by rank 0 (write_from_rank0), and a free port for the rendezvous."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile


def resident_bytes() -> int:
    """This process's resident memory now (Linux's VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def reset_resident_peak() -> None:
    """Start Linux's high-water mark of resident memory (VmHWM) again from the resident memory now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_from_rank0(result: dict, path: str, world_size: int, rank: int) -> None:
    """Every rank's `result`, in rank order, into `path` (a collective: every rank calls it)."""
    import torch.distributed as dist

    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()


def launch(
    script: str, nproc: int, worker_args: list[str], timeout: float, mmap_threshold: int = 1 << 20
) -> list | str:
    """`torchrun --nproc_per_node nproc script --worker ... --out FILE` on CPU (gloo, one thread per rank), and
    what write_from_rank0 put in FILE; or 'failed (exit N): <the last error line, a rank's first>' ('signal 9':
    killed, as by the kernel when memory ran out). Glibc returns freed allocations of `mmap_threshold` bytes and
    more to the system, so a rank's resident memory follows its live tensors."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        rendezvous = [f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, os.path.abspath(script), "--worker"]
        cmd += [*worker_args, "--out", out]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": repo,
            "MALLOC_MMAP_THRESHOLD_": str(mmap_threshold),
            # Every launch compiles its kernels (torchao's 8-bit updates) afresh: a compile leaves ~30 MiB more
            # resident than loading a cached one, and two launches compared must not differ in what the machine
            # happened to have compiled before (measured 1.05 both cold, 1.10 with only test-tiny cached).
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode != 0:
            lines = [x for x in proc.stderr.splitlines() if "Error" in x or "error" in x]
            lines = [x for x in lines if x.startswith("[rank")] or lines
            lines = lines or [f"signal {-proc.returncode}" if proc.returncode < 0 else "?"]
            return f"failed (exit {proc.returncode}): {lines[-1][:200]}"
        with open(out) as f:
            return json.load(f)
