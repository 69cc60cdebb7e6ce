"""Shard bytes read ahead by a thread, so that object-storage reads overlap decoding (--shard-prefetch-mb).

A `ReadAhead` stream is a shard opened in a background thread and read into a bounded queue of chunks; the
tar parser reads the same bytes, in the same order, from the queue. `ShardPrefetcher` starts the next shard's
read-ahead when the current shard is opened, so the next shard's first bytes (its latency, then up to the
bound) are there when the current one ends. Per reader at most two streams are open: the current shard's and
the next one's, each holding at most the bound in memory.

Only the bytes' arrival changes: the samples, their order and every error are those of reading the shard
directly (an error is raised at the byte where the direct read would have raised it).
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from typing import BinaryIO

_CHUNK = 1 << 20
_END = object()


class ReadAhead(io.RawIOBase):
    """The bytes of `open_stream()`, read by a thread at most `limit_bytes` ahead of the reader."""

    def __init__(self, open_stream: Callable[[], BinaryIO], limit_bytes: int):
        # At least four chunks fit in the bound, so reading and decoding overlap even with a small bound.
        self.chunk = max(1, min(_CHUNK, limit_bytes // 4))
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, limit_bytes // self.chunk))
        self.stopping = threading.Event()
        self.pending = memoryview(b"")
        self.ended = False
        self.thread = threading.Thread(target=self._fill, args=(open_stream,), daemon=True, name="shard-read-ahead")
        self.thread.start()

    def _put(self, item) -> bool:
        """Queue one item, waiting for room; False once the reader has closed this stream."""
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, open_stream) -> None:
        try:
            stream = open_stream()
        except BaseException as e:  # noqa: BLE001 — handed to the reader, raised where it reads
            self._put(e)
            return
        try:
            while not self.stopping.is_set():
                data = stream.read(self.chunk)
                if not data:
                    self._put(_END)
                    return
                if not self._put(data):
                    return
        except BaseException as e:  # noqa: BLE001 — as above
            self._put(e)
        finally:
            stream.close()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self.pending:
            if self.ended:
                return 0
            item = self.queue.get()
            if item is _END:
                self.ended = True
                return 0
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            self.pending = memoryview(item)
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def buffered_bytes(self) -> int:
        """Bytes read from the source and not yet taken by the reader: at most the bound plus one chunk (the
        thread holds one more while it waits for room)."""
        items = list(self.queue.queue)
        return len(self.pending) + sum(len(i) for i in items if isinstance(i, bytes))

    def close(self) -> None:
        # Not joined: the thread may be inside a slow read; it ends after it and closes its source.
        self.stopping.set()
        super().close()


class ShardPrefetcher:
    """Opens shards through read-ahead streams, the next one started as the current one is opened."""

    def __init__(self, open_stream: Callable[[str], BinaryIO], limit_bytes: int):
        self.open_stream = open_stream
        self.limit_bytes = limit_bytes
        self.next: tuple[str, ReadAhead] | None = None

    def _start(self, url: str) -> ReadAhead:
        return ReadAhead(lambda: self.open_stream(url), self.limit_bytes)

    def open(self, url: str, then: str | None = None) -> BinaryIO:
        """`url`'s bytes (the prefetched stream when it is the one prefetched); starts `then`'s read-ahead."""
        if self.next is not None and self.next[0] == url:
            stream = self.next[1]
            self.next = None
        else:
            stream = self._start(url)
        self.discard()
        if then is not None:
            self.next = (then, self._start(then))
        return io.BufferedReader(stream, buffer_size=_CHUNK)

    def discard(self) -> None:
        """Stop and drop a prefetched shard nobody opened."""
        if self.next is not None:
            self.next[1].close()
            self.next = None
