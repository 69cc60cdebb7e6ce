"""Counters of skipped samples, shared by a loader's main process and its worker processes.

A sample whose image cannot be read or whose caption is missing never stops training, but it must
not vanish silently either: every skip increments a counter by reason, and the training loop reads
`DataInfo.skipped()` to log them. DataLoader workers are separate processes, so the counters live in
shared memory created before the workers start (inherited on fork, pickled on spawn).
"""

from __future__ import annotations

import logging
import multiprocessing

logger = logging.getLogger(__name__)

# Why a sample was skipped. Fixed order: it is the layout of the shared array.
SKIP_REASONS = (
    "missing_image",  # no image file (CSV path does not exist) or no image entry (webdataset sample)
    "bad_image",  # image bytes that cannot be decoded or transformed
    "missing_caption",  # empty or absent caption
    "read_error",  # unreadable shard or tar member
    "dropped",  # read, but not trained on: a last partial batch, or left over so that ranks take equal steps
    "too_large",  # an image whose header says more pixels than --max-image-pixels: never decoded
)

# Each process warns about the first few skips of a loader with details, then only counts.
_WARN_FIRST = 5


class SkipCounter:
    def __init__(self, name: str):
        self.name = name
        self._counts = multiprocessing.Array("q", len(SKIP_REASONS), lock=True)
        self._warned = 0  # per process: every worker has its own copy

    def count(self, reason: str, detail: str = "", n: int = 1) -> None:
        slot = SKIP_REASONS.index(reason)
        with self._counts.get_lock():
            self._counts[slot] += n
        if self._warned < _WARN_FIRST:
            self._warned += 1
            logger.warning(f"{self.name} data: skipped a sample ({reason}) {detail}".rstrip())

    def snapshot(self) -> dict[str, int]:
        """Skips so far (cumulative over epochs), one entry per reason, zeros included."""
        with self._counts.get_lock():
            return dict(zip(SKIP_REASONS, self._counts[:]))
