"""Process-group setup from whichever launcher started us, and rank helpers.

Launchers announce ranks differently:
  torchrun / torch.distributed.run   RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  deepspeed launcher                 the same variables, plus a --local_rank=N argument
  SLURM srun (one task per GPU)      SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST
Anything else is a single process.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from bigclip.errors import UserError


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


def pick_device(requested: str, local_rank: int, pin_to_local_rank: bool = True) -> torch.device:
    if requested.startswith("cuda") and torch.cuda.is_available():
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
        dist.init_process_group(
            backend=world.backend,
            init_method=dist_url or "env://",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(minutes=int(os.environ.get("BIGCLIP_DIST_TIMEOUT_MIN", "30"))),
            device_id=dev if dev.type == "cuda" else None,
        )
    return world


def shutdown() -> None:
    if dist.is_initialized():
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
