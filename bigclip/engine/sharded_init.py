"""Giant towers that never materialise whole: build on meta, shard, then initialise shard by shard.

A ViT-bigG-14 is 2.5B parameters (10 GB in fp32). Building it on every rank before sharding costs each
rank the whole model in host memory, which is exactly what sharding engines exist to avoid. Instead:

    1. the factory builds the model on the meta device (no memory, well under a second);
    2. every parameter becomes a DTensor sharded along dim 0 (FSDP2 does this in fully_shard; the
       DeepSpeed engine does it here with `shard_meta_params`);
    3. `materialise` allocates only the local shards and runs the model's own `init_weights()`. DTensor
       sees global shapes, so fan-in based inits compute the same bounds as on the full tensor. A model
       built with --pretrained streams the file's rows for each local shard instead (model/weights.py).

Random init on a CPU mesh: DTensor's offset-based RNG only exists for CUDA-like devices. Elsewhere each
rank's random ops run on its local shard with the process generator, so with one seed every rank would
draw the same numbers and the shards of a weight would be copies of each other. `materialise` therefore
seeds each rank differently for the duration of the init (and restores the generator afterwards). On GPU
the tracker is used and the result does not depend on the world size.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from bigclip.engine.config import EngineConfig

# Models from this size up are built on meta under engines that shard parameters (--sharded-init auto).
# ViT-L-14 (428M) still builds comfortably on one host; ViT-H-14 (986M) and ViT-bigG-14 (2.5B) do not on
# 8-GPU nodes with one model copy per rank.
SHARDED_INIT_MIN_PARAMS = 500_000_000


def count_params(model: nn.Module) -> int:
    """Parameter count; works on meta models (numel needs no storage)."""
    return sum(p.numel() for p in model.parameters())


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def wants_sharded_init(cfg: EngineConfig, num_params: int) -> bool:
    mode = cfg.sharded_init
    if mode == "always":
        return True
    if mode == "never":
        return False
    return num_params >= SHARDED_INIT_MIN_PARAMS


def build_for_sharding(cfg: EngineConfig, factory, shards_params: bool) -> nn.Module:
    """The model as an engine that shards parameters wants it: on meta when sharded init applies.

    `factory(device=...)` is the bigclip model factory with the run's options bound.
    """
    if not shards_params:
        return factory()
    meta = factory(device="meta")
    return meta if wants_sharded_init(cfg, count_params(meta)) else factory()


def _has_dtensor_rng(model: nn.Module) -> bool:
    for p in model.parameters():
        if isinstance(p, DTensor):
            device_type = p.device_mesh.device_type
            handle = getattr(torch, device_type, None)
            return handle is not None and hasattr(handle, "set_rng_state")
    return True  # nothing sharded: plain tensors, the usual generator is right


@contextlib.contextmanager
def _rank_distinct_rng(seed: int, rank: int, needed: bool) -> Iterator[None]:
    if not needed:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        # Far from the training seeds (seed, seed + rank) so init noise is not reused as data noise.
        torch.manual_seed(seed + 1_000_003 * (rank + 1))
        yield


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device, seed: int, rank: int) -> None:
    """Allocate the local shards of a meta model on `device` and initialise them with the model's init.

    `rank` is the rank within the shard group: replicas of a shard (HSDP) must draw the same numbers.
    """
    model.to_empty(device=device)
    with _rank_distinct_rng(seed, rank, needed=not _has_dtensor_rng(model)), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights()
    # bigclip's own towers hold no buffers; a model that has some names those its init_weights() fills (a Hugging
    # Face text tower's position ids): refuse to leave any other garbage silently
    filled = set(getattr(model, "buffers_set_by_init", lambda: ())())
    for name, _b in model.named_buffers():
        if name not in filled:
            raise RuntimeError(f"buffer {name} is not initialised by init_weights() after a meta build")


def shard_meta_params(model: nn.Module, mesh) -> None:
    """Replace every meta parameter by an (unallocated, meta) DTensor sharded along dim 0 on `mesh`."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p.detach(), mesh, [Shard(0)])  # on meta: metadata only, no copy
            setattr(module, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def modules_children_first(model: nn.Module) -> list[nn.Module]:
    """Every module after all of its descendants (reversed pre-order)."""
    return list(model.modules())[::-1]
