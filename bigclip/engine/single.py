"""A one-process group for engines that need torch.distributed even without a launcher.

FSDP2 and DeepSpeed always talk to a process group; `--engine fsdp` (or deepspeed) in a plain
`python launch/train.py` run is world size 1, so the engine opens a group of one on a free local port.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from bigclip.dist import World


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(world: World) -> None:
    if dist.is_initialized():
        return
    if world.world_size != 1:
        raise RuntimeError("a multi-process run must have initialised torch.distributed before the engine")
    # No launcher variables are written to the environment: a later run in the same process (tests) or a
    # child process would take them for a launcher's.
    dist.init_process_group(
        "nccl" if world.device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )
