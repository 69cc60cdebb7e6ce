"""FileSink: where one rank's finished checkpoint files go, as soon as each one is closed.

Each file is checksummed (for the manifest) and, when the checkpoint also lives in object storage, uploaded —
several files in parallel, each large one in parallel multipart chunks (s3fs), each retried with backoff
(storage.py). A save's commit waits for `wait()`, which returns every file's size and checksum.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from bigclip.ckpt.manifest import FileEntry, checksum_file
from bigclip.ckpt.storage import Storage

BACKGROUND_NICE = int(os.environ.get("BIGCLIP_CKPT_NICE", "10"))


def lower_priority() -> None:
    """Thread initializer: checkpoint threads yield the CPU to the training loop (Linux sets nice per thread).

    On a GPU node the CPU is mostly idle and this changes nothing; on a busy host it keeps hashing, writing
    and uploading from slowing the steps down, at the price of a later commit."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class FileSink:
    def __init__(self, local_dir: str, remote: Storage | None, pool: ThreadPoolExecutor):
        self.local_dir = local_dir
        self.remote = remote
        self._pool = pool
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    def rel(self, path: str) -> str:
        return os.path.relpath(os.fspath(path), self.local_dir).replace(os.sep, "/")

    def submit(self, path: str) -> None:
        """Called when `path` (inside local_dir) is complete and closed; returns immediately."""
        rel = self.rel(path)
        with self._lock:
            if rel not in self._futures:
                self._futures[rel] = self._pool.submit(self._ship, os.fspath(path), rel)

    def _ship(self, path: str, rel: str) -> FileEntry:
        entry = checksum_file(path)
        _fsync(path)  # DCP fsyncs its files already; DeepSpeed's torch.save does not
        if self.remote is not None:
            self.remote.put_file(path, rel)
        return entry

    def wait(self) -> dict[str, dict]:
        """Every submitted file's {size, crc32}, once all are durable; raises the first failure."""
        with self._lock:
            futures = dict(self._futures)
        out, first_error = {}, None
        for rel, fut in futures.items():
            try:
                entry = fut.result()
                out[rel] = {"size": entry.size, "crc32": entry.crc32}
            except BaseException as e:  # noqa: BLE001 — wait for the others before reporting
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return out


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
