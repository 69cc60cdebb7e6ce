"""Process-group setup from whichever launcher started us, and rank helpers.

Launchers announce ranks differently:
  torchrun / torch.distributed.run   RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (GROUP_RANK: node)
  deepspeed launcher                 the same variables, plus a --local_rank=N argument (CROSS_RANK: node)
  SLURM srun (one task per GPU)      SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST (SLURM_NODEID)
Anything else is a single process.

How long a missing node can hold the others up: under srun and the DeepSpeed launcher (no rendezvous of
their own) the process group's TCP store waits --dist-timeout seconds for every rank, then every waiting
rank stops with one line saying what it waited for. torchrun's agents meet before any rank starts: their
rendezvous timeout bounds the wait there (--rdzv_conf join_timeout=S for c10d, timeout=S for a static
--master_addr rendezvous), and torchrun reports it.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bigclip.errors import UserError, first_line
from bigclip.flag_fields import DIST, Applies, flag, positive_seconds


@dataclass(frozen=True)
class DistConfig:
    """The distributed flags (OpenCLIP's names): where to run and how to join the process group."""

    dist_url: str | None = flag(None, "Rendezvous URL (default: env:// from the launcher).", DIST)
    dist_backend: str | None = flag(None, "nccl on GPU, gloo on CPU (default: picked by device).", DIST)
    dist_timeout: float = flag(
        1800.0,
        "Seconds a collective may wait, and how long startup waits for every rank to join the process group "
        "(a node that never arrives stops the others after this long).",
        DIST,
        check=positive_seconds,
    )
    no_set_device_rank: bool = flag(
        False,
        "Do not pin each process to the GPU of its local rank.",
        DIST,
        applies=Applies(lambda c: run_device_type(c.device) == "cuda", "on CUDA GPUs (this run is on the CPU)"),
    )
    device: str = flag("cuda", "cuda or cpu (cuda falls back to cpu when no GPU is present).", DIST)


def check_dist(cfg: DistConfig) -> None:
    if cfg.device not in ("cuda", "cpu") and not cfg.device.startswith("cuda:"):
        raise UserError(f"--device {cfg.device!r}: choose cuda or cpu")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    source: str  # "torchrun", "slurm" or "single"
    master_addr: str | None = None
    master_port: str | None = None


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    source: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", self.world_size)))


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003' (what `scontrol show
    hostnames | head -1` prints), without needing scontrol on the compute node."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read a host name from it; set MASTER_ADDR")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launcher_name(env: dict[str, str] | None = None) -> str:
    """Which launcher started this process, for the logs."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "CROSS_RANK" in env or "LOCAL_SIZE" in env:
        return "deepspeed launcher"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "RANK/WORLD_SIZE environment"
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "srun"
    return "single process"


def node_id(env: dict[str, str] | None = None) -> str:
    """This process's node: the host name, plus the launcher's node rank where it gives one (two "nodes" can
    share a host in tests, or a host can run two jobs' nodes)."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    for key in ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID"):
        if key in env:
            return f"{host} (node {env[key]})"
    return host


def where(env: dict[str, str] | None = None) -> str:
    """'rank R on HOST' for error lines of a multi-process run; '' for a single process."""
    env = os.environ if env is None else env
    rank = env.get("RANK", env.get("SLURM_PROCID") if int(env.get("SLURM_NTASKS", "1")) > 1 else None)
    return f"rank {rank} on {node_id(env)}" if rank is not None else ""


def detect_launch(env: dict[str, str] | None = None, local_rank_arg: int | None = None) -> LaunchEnv:
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
        return LaunchEnv(
            int(env["RANK"]),
            local_rank,
            int(env["WORLD_SIZE"]),
            "torchrun",
            env.get("MASTER_ADDR"),
            env.get("MASTER_PORT"),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
        # A port derived from the job id lets several jobs share a node without colliding.
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return LaunchEnv(
            int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), int(env["SLURM_NTASKS"]), "slurm", addr, port
        )
    return LaunchEnv(0, local_rank_arg or 0, 1, "single")


def run_device_type(requested: str) -> str:
    """The kind of device --device REQUESTED gives this run: cuda where asked for and present, else cpu."""
    return "cuda" if requested.startswith("cuda") and torch.cuda.is_available() else "cpu"


def pick_device(requested: str, local_rank: int, pin_to_local_rank: bool = True) -> torch.device:
    if run_device_type(requested) == "cuda":
        if ":" in requested:
            return torch.device(requested)
        index = local_rank % torch.cuda.device_count() if pin_to_local_rank else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(
    device: str = "cuda",
    backend: str | None = None,
    dist_url: str | None = None,
    local_rank_arg: int | None = None,
    pin_to_local_rank: bool = True,
    timeout_s: float = 1800.0,
) -> World:
    launch = detect_launch(local_rank_arg=local_rank_arg)
    dev = pick_device(device, launch.local_rank, pin_to_local_rank)
    world = World(launch.rank, launch.local_rank, launch.world_size, dev, None, launch.source)
    if launch.world_size == 1:
        return world
    if launch.source == "slurm":
        # env:// rendezvous reads these; torchrun sets them itself.
        os.environ.setdefault("MASTER_ADDR", launch.master_addr or "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", launch.master_port or "29500")
        os.environ.setdefault("RANK", str(launch.rank))
        os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
        os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    world.backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                backend=world.backend,
                init_method=dist_url or "env://",
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=dev if dev.type == "cuda" else None,
            )
        except (RuntimeError, TimeoutError, ConnectionError) as e:  # DistStoreError, DistNetworkError, gloo's
            rendezvous = dist_url or f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise UserError(
                f"{where() or f'rank {launch.rank}'}: the process group of {launch.world_size} ranks did not form "
                f"within --dist-timeout {timeout_s:g} s at {rendezvous} ({first_line(e)}); check that every node "
                f"started with the same MASTER_ADDR/MASTER_PORT and world size, or raise --dist-timeout"
            ) from e
    return world


def join_world(cfg: DistConfig, local_rank: int | None = None) -> World:
    """init_distributed with the run's flags (--device, --dist-backend, --dist-url, --dist-timeout)."""
    return init_distributed(
        cfg.device, cfg.dist_backend, cfg.dist_url, local_rank, not cfg.no_set_device_rank, cfg.dist_timeout
    )


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'"""
    ranks, parts = sorted(ranks), []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def describe_world(world: World) -> list[str]:
    """One line per node (host, its ranks, local world size, devices), then the world: for rank 0 to log at
    start. Collective: every rank sends its own facts."""
    mine = (node_id(), world.rank, str(world.device))
    everyone = [mine]
    if world.distributed:
        everyone = [None] * world.world_size
        dist.all_gather_object(everyone, mine)
    nodes: dict[str, list[tuple[int, str]]] = {}
    for node, rank, device in everyone:
        nodes.setdefault(node, []).append((rank, device))
    lines = []
    for node, members in nodes.items():
        devices = sorted({d for _, d in members})
        lines.append(
            f"node {node}: ranks {_ranges([r for r, _ in members])} (local world size {len(members)}), "
            f"device{'s' if len(devices) > 1 else ''} {', '.join(devices)}"
        )
    lines.append(
        f"world: {world.world_size} rank(s) on {len(nodes)} node(s), backend {world.backend or 'none'}, "
        f"launched by {launcher_name()}"
    )
    return lines


def shutdown() -> None:
    if dist.is_initialized():
        # A DDP wrapper held in a reference cycle and freed only at interpreter exit, after its process
        # group is gone, aborts the process now and then on gloo ("terminate called without an active
        # exception"): free such objects while the group still exists.
        gc.collect()
        dist.destroy_process_group()


def broadcast_object(obj, world: World, src: int = 0):
    if not world.distributed:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_reduce_min(value: float, world: World) -> float:
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device if world.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    if not world.distributed:
        return values
    t = values.to(world.device if world.backend == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.to(values.device)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


T = TypeVar("T")


def raise_together(world: World, check: Callable[[], T], runs_here: bool | None = None) -> T | None:
    """Run `check` on the ranks where `runs_here` (default: rank 0 alone); when it raises a UserError on any
    of them, every rank raises that error, here. Returns check's result where it ran (None elsewhere).

    For what must stop all ranks at the same point (a run folder that exists, a store that cannot be
    written, a checkpoint that does not verify): a rank that went on alone would wait forever in the next
    collective. Collective on the default group."""
    runs_here = world.is_main if runs_here is None else runs_here
    result, problem = None, None
    if runs_here:
        try:
            result = check()
        except UserError as e:
            problem = e
    if world.distributed:
        problems: list[UserError | None] = [None] * world.world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise problem
    return result


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (in-place updates of it are updates of the DTensor,
    no redistribution needed), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
