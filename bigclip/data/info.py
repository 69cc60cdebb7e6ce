"""DataInfo: one loader plus what the training loop needs to know about it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from bigclip.data.skips import SKIP_REASONS, SkipCounter
from bigclip.data.workers import shut_down_workers


class EpochPositioned(Protocol):
    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None: ...


@dataclass
class DataInfo:
    """`dataloader` yields (images FloatTensor[B,3,H,W], tokens LongTensor[B,L]), or (images, labels)
    for zero-shot sets. `num_samples` is the data set's size (training: per epoch, over all ranks);
    `num_batches` is per rank and per whole epoch. After set_epoch(e, skip_batches=k) the loader yields
    num_batches - k batches: the rest of epoch e."""

    dataloader: Iterable[Any]
    num_samples: int
    num_batches: int
    sampler: EpochPositioned | None = None
    skips: SkipCounter | None = None

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Order of epoch `epoch` (a function of seed and epoch only), less its first `skip_batches`."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, skip_batches)
        elif skip_batches:
            raise ValueError("this loader has no order to skip into")

    def close(self) -> None:
        """Stop the loader's worker processes now (persistent workers otherwise live as long as the loader)."""
        shut_down_workers(self.dataloader)

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far by reason, summed over worker processes and epochs."""
        if self.skips is None:
            return dict.fromkeys(SKIP_REASONS, 0)
        return self.skips.snapshot()
