"""Every rank evaluates together: with sharded engines (FSDP, ZeRO-3) each forward is a collective, so a rank
whose share of a set is shorter keeps stepping (lockstep), and the rows each rank computed are gathered
(gather_rows)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bigclip.dist import World, all_reduce_sum


def lockstep(loader, world: World):
    """(batch, real) pairs, as many on every rank as the rank with the most batches has.

    Forward passes of sharded engines (FSDP, ZeRO-3) are collectives, and a rank's share of a validation
    set need not be as long as the others' (WebDataset shards split unevenly, or fewer shards than ranks).
    A rank that has run out keeps stepping with a stand-in batch (its first one, or zeros shaped like
    another rank's) whose outputs the caller drops, instead of leaving the others waiting forever."""
    if not world.distributed:
        for batch in loader:
            yield batch, True
        return
    batches, stand_in = iter(loader), None
    while True:
        batch = next(batches, None) if batches is not None else None
        if batch is None:
            batches = None  # exhausted: never asked again
        elif stand_in is None:
            stand_in = batch
        flags = torch.tensor([float(batch is not None), float(stand_in is not None)])
        have_batch, have_stand_in = all_reduce_sum(flags, world).tolist()
        if have_batch == 0:
            return
        if have_stand_in < world.world_size:  # collective: once, when some rank has never had a batch
            stand_in = _zeros_like_anyones(stand_in, world)
        yield (batch, True) if batch is not None else (stand_in, False)


def _zeros_like_anyones(batch, world: World):
    """This rank's batch if it has one, else a one-sample batch of zeros shaped like another rank's."""
    shapes = [None] * world.world_size
    mine = None if batch is None else [(tuple(t.shape[1:]), t.dtype) for t in batch]
    dist.all_gather_object(shapes, mine)
    if batch is not None:
        return batch
    template = next(s for s in shapes if s is not None)
    return tuple(torch.zeros((1, *shape), dtype=dtype) for shape, dtype in template)


def gather_rows(x: torch.Tensor, world: World) -> torch.Tensor:
    """Every rank's rows of `x` (their numbers may differ), concatenated in rank order, on the CPU."""
    if not world.distributed:
        return x
    dev = world.device if world.backend == "nccl" else torch.device("cpu")
    x = x.to(dev)
    sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(world.world_size)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=dev))
    biggest = int(max(s.item() for s in sizes))
    padded = torch.zeros((biggest, *x.shape[1:]), dtype=x.dtype, device=dev)
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(world.world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)]).cpu()
