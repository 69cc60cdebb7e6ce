"""DataInfo: one loader plus what the training loop needs to know about it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bigclip.data.skips import SKIP_REASONS, SkipCounter
from bigclip.data.wds_stream import leftover_items, worker_states
from bigclip.data.workers import shut_down_workers

logger = logging.getLogger(__name__)


class EpochPositioned(Protocol):
    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None: ...


@dataclass
class DataInfo:
    """`dataloader` yields (images FloatTensor[B,3,H,W], tokens LongTensor[B,L]), or (images, labels)
    for zero-shot sets. `num_samples` is the data set's size (training: per epoch, over all ranks);
    `num_batches` is per rank and per whole epoch.

    Two ways to resume inside an epoch. A loader with a saved position (`resumable`: torchdata's
    StatefulDataLoader over a stream that saves its workers' state) continues exactly where `position()` was
    taken, after `restore()`. The others are pure functions of (seed, epoch): after set_epoch(e,
    skip_batches=k) they yield num_batches - k batches, the rest of epoch e.

    `ends_early`: a rank's loader may yield fewer than num_batches batches (WebDataset without resampling
    reads each shard once), so the ranks must agree on every step whether all of them have a batch."""

    checkpoint_kind = "rank"  # a checkpoint keeps each rank's position in the rank's own file (not a field)

    dataloader: Iterable[Any]
    num_samples: int
    num_batches: int
    sampler: EpochPositioned | None = None
    skips: SkipCounter | None = None
    resumable: bool = False
    ends_early: bool = False
    _pending: dict[str, Any] | None = field(default=None, repr=False)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Order of epoch `epoch` (a function of seed and epoch only), less its first `skip_batches`."""
        if self.resumable:
            self._set_resumable_epoch(epoch, skip_batches)
        elif self.sampler is not None:
            self.sampler.set_epoch(epoch, skip_batches)
        elif skip_batches:
            raise ValueError("this loader has no order to skip into")

    def _set_resumable_epoch(self, epoch: int, skip_batches: int) -> None:
        pending, self._pending = self._pending, None
        self.sampler.set_epoch(epoch)
        if pending is None:
            resumed = False
        elif "ranks" in pending:  # saved by another number of ranks: deal out what all of them had left
            resumed = self._continue_leftover(epoch, pending["ranks"], pending["world_size"], this_rank_only=False)
        elif len(worker_states(pending["loader"])) != self.sampler.workers:  # this rank, other worker count
            rank, world_size = self.sampler.rank, self.sampler.world_size
            resumed = self._continue_leftover(epoch, {rank: pending}, world_size, this_rank_only=True)
        elif pending["epoch"] == epoch:
            self.dataloader.load_state_dict(pending["loader"])
            resumed = True
        else:
            resumed = False
        if not resumed and skip_batches:
            logger.warning(
                f"resuming epoch {epoch} after {skip_batches} batches without a saved data position (a checkpoint "
                f"of another world size or an older bigclip): the epoch's data starts again from its beginning"
            )

    def _continue_leftover(self, epoch: int, positions: dict, world_size: int, this_rank_only: bool) -> bool:
        positions = {int(rank): position for rank, position in positions.items()}
        if not this_rank_only and sorted(positions) != list(range(world_size)):
            return False  # a rank's file is missing: the epoch's data starts again (warned by the caller)
        items = leftover_items(self.sampler.plan, epoch, positions, world_size)
        if items is None:
            return False
        self.sampler.continue_leftover(epoch, items, this_rank_only)
        logger.info(f"data: epoch {epoch} continues with what the saved run's readers had left ({len(items)} parts)")
        return True

    def position(self) -> dict[str, Any]:
        """Where the loader is, after the last batch taken from it (a resumable loader; else {})."""
        if not self.resumable:
            return {}
        return {"epoch": self.sampler.epoch, "loader": self.dataloader.state_dict()}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from `position` at the next set_epoch of the same epoch."""
        if self.resumable and position:
            self._pending = position

    # torch.distributed.checkpoint's Stateful protocol: how the checkpoint manager saves and restores the position
    def state_dict(self) -> dict[str, Any]:
        return self.position()

    def load_state_dict(self, position: dict[str, Any]) -> None:
        self.restore(position)

    def load_state_dicts(self, positions: dict[int, dict[str, Any]], saved_world_size: int) -> None:
        """A checkpoint saved by another number of ranks: every saved rank's position (rank -> position), each
        only its own share of the epoch, so that what all of them had left is dealt out to this run's ranks."""
        self.restore({"world_size": saved_world_size, "ranks": positions})

    def count_dropped(self, samples: int) -> None:
        if self.skips is not None and samples:
            self.skips.count("dropped", f"{samples} samples: another rank ran out of data first", n=samples)

    def close(self) -> None:
        """Stop the loader's worker processes now (persistent workers otherwise live as long as the loader)."""
        shut_down_workers(self.dataloader)

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far by reason, summed over worker processes and epochs."""
        if self.skips is None:
            return dict.fromkeys(SKIP_REASONS, 0)
        return self.skips.snapshot()
