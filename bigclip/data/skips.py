"""Counters of skipped samples, shared by a loader's main process and its worker processes.

A sample whose image cannot be read or whose caption is missing never stops training, but it must
not vanish silently either: every skip increments a counter by reason, and the training loop reads
`DataInfo.skipped()` to log them. DataLoader workers are separate processes, so the counters live in
shared memory created before the workers start (inherited on fork, pickled on spawn).
"""

from __future__ import annotations

import logging
import multiprocessing
import uuid
import weakref
import zlib

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

# A loader warns about its first few distinct skips with details, then only counts (the progress lines and the
# epoch's summary give the counts). Distinct over all its processes: a corrupt shard drawn again and again by
# every worker of a resampled stream is one line, not one per draw and worker.
_WARN_FIRST = 5


class SkipCounter:
    # By key, the counters of this process: a batch that is decoded in the training process (data/device_decode.py)
    # carries its loader's key from the worker, not the counter.
    _by_key: weakref.WeakValueDictionary[str, SkipCounter] = weakref.WeakValueDictionary()

    def __init__(self, name: str):
        self.name = name
        self.key = uuid.uuid4().hex
        SkipCounter._by_key[self.key] = self
        self._counts = multiprocessing.Array("q", len(SKIP_REASONS), lock=True)
        # [how many said, then the CRC-32 of each line said]: shared like the counts
        self._said = multiprocessing.Array("q", _WARN_FIRST + 1, lock=True)

    @classmethod
    def find(cls, key: str | None) -> SkipCounter | None:
        return cls._by_key.get(key) if key is not None else None

    def count(self, reason: str, detail: str = "", n: int = 1) -> None:
        slot = SKIP_REASONS.index(reason)
        with self._counts.get_lock():
            self._counts[slot] += n
        line = f"{self.name} data: skipped a sample ({reason}) {detail}".rstrip()
        if self._first_time(line):
            logger.warning(line)

    def _first_time(self, line: str) -> bool:
        """Whether `line` is one of the first _WARN_FIRST distinct lines of this loader (all its processes)."""
        key = zlib.crc32(line.encode()) + 1  # never 0, the value of an empty slot
        with self._said.get_lock():
            said = self._said[0]
            if said >= _WARN_FIRST or key in self._said[1 : 1 + said]:
                return False
            self._said[1 + said] = key
            self._said[0] = said + 1
            return True

    def snapshot(self) -> dict[str, int]:
        """Skips so far (cumulative over epochs), one entry per reason, zeros included."""
        with self._counts.get_lock():
            return dict(zip(SKIP_REASONS, self._counts[:]))
