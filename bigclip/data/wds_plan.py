"""Which shards each (rank, worker) reads in an epoch: OpenCLIP's rules, made reproducible and resumable.

Slots. Rank r's worker w is slot `r + R * w` of R * W slots (R ranks, W workers; W = 1 without workers).
This is OpenCLIP's split_by_node followed by split_by_worker: shard i of the epoch's order goes to the slot
`i mod (R * W)`.

Without --dataset-resampled every shard is read exactly once per epoch: the shard list (all `::` sources
concatenated) is shuffled from (seed, epoch), and slot s reads order[s::R*W]. As in OpenCLIP, this needs at
least as many shards as slots.

With --dataset-resampled each slot draws shards with replacement, for ever, from its own generator seeded by
(seed, epoch, rank, worker), weighted by --train-data-upsampling-factors: every shard of source k weighs
factor k (OpenCLIP's per-shard weights), so a source's share of the samples is proportional to its factor
times its number of shards.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bigclip.errors import UserError


def parse_upsampling_factors(value: str | None, sources: list[list[str]], resampled: bool) -> list[float] | None:
    """One weight per `::` source (OpenCLIP's --train-data-upsampling-factors), or None for equal weights."""
    if value is None:
        return None
    if not resampled:
        raise UserError(
            "--train-data-upsampling-factors: only applies when sampling with replacement; add --dataset-resampled"
        )
    parts = value.split("::")
    if len(parts) != len(sources):
        raise UserError(
            f"--train-data-upsampling-factors {value}: {len(parts)} factors for {len(sources)} data sources; "
            f"give one per '::'-separated source of --train-data"
        )
    try:
        factors = [float(p) for p in parts]
    except ValueError:
        raise UserError(f"--train-data-upsampling-factors {value}: not numbers; write e.g. 1::0.5") from None
    if any(f < 0 for f in factors) or not any(f > 0 for f in factors):
        raise UserError(f"--train-data-upsampling-factors {value}: factors must be >= 0 and not all 0")
    return factors


def batches_per_worker(num_samples: int, batch_size: int, world_size: int, workers: int) -> int:
    """OpenCLIP's epoch arithmetic: whole global batches, rounded up so every worker does the same."""
    global_batches = math.ceil(num_samples / (batch_size * world_size))
    return math.ceil(global_batches / max(1, workers))


def slot_of(rank: int, world_size: int, worker: int) -> int:
    return rank + world_size * worker


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[str, ...]  # every shard of every source, sources in order
    weights: tuple[float, ...] | None  # per shard, only when resampled
    resampled: bool
    seed: int

    @classmethod
    def build(cls, sources: list[list[str]], factors: list[float] | None, resampled: bool, seed: int) -> ShardPlan:
        shards = tuple(url for source in sources for url in source)
        weights = None
        if resampled and factors is not None:
            weights = tuple(f for source, f in zip(sources, factors) for _ in source)
        return cls(shards, weights, resampled, seed)

    def check_slots(self, slots: int, flag: str) -> None:
        """Reading every shard once needs a shard for every (rank, worker)."""
        if not self.resampled and len(self.shards) < slots:
            raise UserError(
                f"{flag}: {len(self.shards)} shards for {slots} readers (ranks x workers); without "
                f"--dataset-resampled every reader needs its own shards: use at least {slots} shards, "
                f"fewer --workers, or --dataset-resampled"
            )

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"{self.seed}/{epoch}/order").shuffle(order)
        return order

    def slot_shards(self, epoch: int, slot: int, slots: int) -> list[int]:
        """The shards (indices into `shards`) slot `slot` reads in `epoch`, in order (not resampled)."""
        return self.epoch_order(epoch)[slot::slots]

    def sampler(self, epoch: int, rank: int, worker: int) -> random.Random:
        return random.Random(f"{self.seed}/{epoch}/{rank}/{worker}/resample")

    def draw(self, rng: random.Random) -> int:
        """The next shard a resampling slot reads."""
        if self.weights is None:
            return rng.randrange(len(self.shards))
        return rng.choices(range(len(self.shards)), weights=self.weights)[0]
