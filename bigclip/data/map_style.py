"""Map-style datasets whose unreadable samples are replaced, not dropped.

Dropping a bad sample would shrink its batch, and the distributed contrastive loss needs equal
per-rank batches (and a sharded engine would wait forever on the rank with fewer samples). So a bad
sample i is counted once (by reason) and replaced by the next readable sample i+1, i+2, ...
(wrapping around). The replacement depends only on the dataset, never on timing or worker layout,
so a run is reproducible. The price is that a neighbour may appear twice in an epoch -- negligible
next to a skipped step or a hang.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from bigclip.data.skips import SkipCounter
from bigclip.errors import UserError


class SampleSkipped(Exception):
    """Raised by `load` for a sample that cannot be used."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ReplacingDataset(Dataset):
    """Subclasses implement `load(index)` (raising SampleSkipped) and `__len__`; `source` names the data."""

    source = "data"

    def __init__(self, skips: SkipCounter):
        self.skips = skips
        self._known_bad: set[int] = set()  # per process; saves re-reading bad neighbours

    def load(self, index: int):
        raise NotImplementedError

    def __getitem__(self, index: int):
        try:
            return self.load(index)
        except SampleSkipped as skip:
            self._known_bad.add(index)
            self.skips.count(skip.reason, skip.detail)
        size = len(self)
        for step in range(1, size):
            candidate = (index + step) % size
            if candidate in self._known_bad:
                continue
            try:
                return self.load(candidate)
            except SampleSkipped:
                # Counted when the sampler reaches `candidate` itself, not here, so each bad sample
                # counts once per visit however many neighbours fall through it.
                self._known_bad.add(candidate)
        raise UserError(f"{self.source}: none of its {size} samples could be read; check the image paths and captions")
