"""Which sample indices each rank reads, batch by batch, for map-style datasets.

Training: every epoch is a permutation seeded by (seed + epoch), the same on all ranks, cut to a whole
number of global batches (batch_size x world_size; the remainder is dropped, like drop_last). Rank r
takes every world_size-th index, so ranks are disjoint and hold the same number of equal-size
batches -- the distributed contrastive loss gathers equal-size feature blocks from every rank.

Evaluation: no shuffle, nothing dropped, every sample on exactly one rank. With one rank the batches
are --batch-size with a smaller last one. With several ranks each rank cuts its share into the same
number of near-equal batches, so sharded engines (FSDP, ZeRO-3), whose every forward is a collective,
run the same number of forwards on every rank.

Resuming mid-epoch: set_epoch(epoch, skip_batches=k) drops the first k batches here, before any sample
is loaded.
"""

from __future__ import annotations

import math

import torch


class ShardedBatchSampler:
    def __init__(
        self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, train: bool = True
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.train = train
        self.epoch = 0
        self.skip_batches = 0

    @property
    def num_batches(self) -> int:
        """Batches this rank yields in a whole epoch."""
        if self.train:
            return self.num_samples // (self.batch_size * self.world_size)
        if self.world_size == 1:
            return math.ceil(self.num_samples / self.batch_size)
        largest_share = math.ceil(self.num_samples / self.world_size)
        return math.ceil(largest_share / self.batch_size)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        if not 0 <= skip_batches <= self.num_batches:
            raise ValueError(f"skip_batches={skip_batches} outside 0..{self.num_batches}")
        self.epoch = epoch
        self.skip_batches = skip_batches

    def batches(self) -> list[torch.Tensor]:
        """All of this rank's batches of the current epoch (skipped ones included)."""
        if self.train:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator)
            used = self.num_batches * self.batch_size * self.world_size
            mine = order[:used][self.rank :: self.world_size]
            return list(mine.split(self.batch_size))
        mine = torch.arange(self.num_samples)[self.rank :: self.world_size]
        if self.world_size == 1:
            return list(mine.split(self.batch_size))
        # Same count on every rank; a rank with fewer samples than batches (tiny sets) yields fewer.
        return [b for b in mine.tensor_split(self.num_batches) if len(b)]

    def __iter__(self):
        for batch in self.batches()[self.skip_batches :]:
            yield batch.tolist()

    def __len__(self) -> int:
        if self.train or self.world_size == 1:
            return self.num_batches - self.skip_batches
        share = len(range(self.rank, self.num_samples, self.world_size))
        return max(0, min(self.num_batches, share) - self.skip_batches)
