"""WebDataset shards by URL: local paths, any fsspec filesystem (s3://, gs://, az://, https://) and `pipe:`.

Shards are read as streams, never copied whole to disk. A remote read that fails with a transient error
(connection reset, 5xx, throttling, the server gone for a moment) is reopened at the byte it had reached,
with backoff, so the shard completes; one that still fails is reported to the caller (`on_error`), who counts
and skips it. Tar members are parsed by webdataset's own iterators.
"""

from __future__ import annotations

import io
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

import fsspec
from webdataset.tariterators import group_by_keys, tar_file_iterator

from bigclip.data.config import sources
from bigclip.data.read_ahead import ShardPrefetcher
from bigclip.errors import UserError

RETRY_SECONDS = float(os.environ.get("BIGCLIP_DATA_RETRY_SECONDS", "120"))
_BLOCK = 8 << 20  # fsspec read-ahead per open shard
# Failures no retry can mend: a missing object, refused credentials, a bad option.
_PERMANENT = (FileNotFoundError, PermissionError, TypeError, ValueError)


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def expand_shard_urls(spec: str, flag: str, storage_options: dict | None = None) -> list[list[str]]:
    """The shards of each `::`-separated source: brace patterns expanded, prefixes (ending in /) and globs listed.
    Local shards must exist; remote brace lists are not checked one by one (a listing is)."""
    out = []
    for source, expanded in zip(spec.split("::"), sources(spec)):
        urls: list[str] = []
        for url in expanded:
            if url.startswith("pipe:"):
                urls.append(url)
            elif url.endswith("/") or any(c in url for c in "*?["):
                urls.extend(_listing(url, flag, storage_options or {}))
            elif not is_remote(url):
                path = url.removeprefix("file://")
                if not os.path.isfile(path):
                    raise UserError(f"{flag} {path}: shard not found; check the path and the brace pattern")
                urls.append(path)
            else:
                urls.append(url)
        if not urls:
            raise UserError(f"{flag} {source}: matches no shards; check the pattern")
        out.append(urls)
    return out


def _listing(url: str, flag: str, options: dict) -> list[str]:
    try:
        fs, path = fsspec.core.url_to_fs(url, **(options if is_remote(url) else {}))
        found = fs.glob(path) if any(c in path for c in "*?[") else fs.find(path)
    except Exception as e:  # credentials, a missing bucket, no network: one line naming the URL
        raise UserError(f"{flag} {url}: cannot list shards ({type(e).__name__}: {e})") from None
    names = sorted(p for p in found if p.endswith(".tar"))
    if not names:
        raise UserError(f"{flag} {url}: no .tar shards there; check the prefix or pattern")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return [n if protocol == "file" else f"{protocol}://{n}" for n in names]


class _RetryingReader(io.RawIOBase):
    """A remote file read front to back; a failed read reopens it at the same offset (a range request)."""

    def __init__(self, url: str, options: dict, budget: float):
        self.url, self.options, self.budget = url, options, budget
        self.offset = 0
        self.file = None

    def readable(self) -> bool:
        return True

    def _open(self):
        fs, path = fsspec.core.url_to_fs(self.url, **self.options)
        f = fs.open(path, "rb", block_size=_BLOCK)
        f.seek(self.offset)
        return f

    def readinto(self, buffer) -> int:
        deadline, delay = time.monotonic() + self.budget, 0.5
        while True:
            try:
                if self.file is None:
                    self.file = self._open()
                data = self.file.read(len(buffer))
                buffer[: len(data)] = data
                self.offset += len(data)
                return len(data)
            except _PERMANENT:
                raise
            except Exception:
                self._drop()
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _drop(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except Exception:  # noqa: BLE001 — a broken connection may fail to close; it is dropped anyway
                pass
        self.file = None

    def close(self) -> None:
        self._drop()
        super().close()


def open_shard(url: str, storage_options: dict | None = None, retry_seconds: float = RETRY_SECONDS):
    """A binary stream of the shard's bytes."""
    if url.startswith("pipe:"):
        process = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE)
        return process.stdout
    if not is_remote(url):
        return open(url.removeprefix("file://"), "rb")
    return io.BufferedReader(_RetryingReader(url, storage_options or {}, retry_seconds), buffer_size=1 << 20)


def iter_shard_samples(
    url: str,
    storage_options: dict | None = None,
    on_error: Callable[[str, str], None] | None = None,
    start: int = 0,
    opener: Callable[[str], BinaryIO] | None = None,
) -> Iterator[dict]:
    """The shard's samples (webdataset's grouping of tar members by key) from the `start`-th on, each with
    `__key__`, `__url__` and `__index__` (its ordinal in the shard). A shard that cannot be opened or read to
    the end reports to `on_error(kind, detail)` and ends; it never raises. `opener`: how to open the shard's
    bytes (default open_shard)."""
    report = on_error or (lambda kind, detail: None)
    try:
        stream = opener(url) if opener is not None else open_shard(url, storage_options)
    except Exception as e:  # noqa: BLE001 — any failure to open is this shard's, not the run's
        report("shard_failed", f"{url}: {type(e).__name__}: {e}")
        return
    index = -1
    try:
        members = ({**m, "__url__": url} for m in tar_file_iterator(stream))
        for index, sample in enumerate(group_by_keys(members)):
            if index >= start:
                sample["__index__"] = index
                yield sample
    except Exception as e:  # noqa: BLE001 — a truncated or corrupt tar ends the shard, counted
        # Nothing read at all: the shard itself failed (missing, refused, unreachable past the retries).
        report("shard_failed" if index < 0 else "read_error", f"{url}: {type(e).__name__}: {e}")
    finally:
        stream.close()


class ShardReader:
    """Reads shards' samples (iter_shard_samples). With `prefetch_bytes`, remote shards are read ahead by a
    thread, and the shard the caller names as `then` (the one it reads next) starts downloading as soon as the
    current one is opened (data/read_ahead.py): the same samples, in the same order, sooner."""

    def __init__(self, storage_options: dict | None = None, prefetch_bytes: int = 0):
        self.storage_options = storage_options or {}
        self.prefetch_bytes = prefetch_bytes
        self._prefetcher: ShardPrefetcher | None = None  # made where the shards are read (a loader worker)

    def __getstate__(self):
        return {**self.__dict__, "_prefetcher": None}

    def __call__(
        self, url: str, start: int = 0, on_error: Callable[[str, str], None] | None = None, then: str | None = None
    ) -> Iterator[dict]:
        if not (self.prefetch_bytes and is_remote(url)):
            return iter_shard_samples(url, self.storage_options, on_error, start)
        if self._prefetcher is None:
            self._prefetcher = ShardPrefetcher(lambda u: open_shard(u, self.storage_options), self.prefetch_bytes)
        prefetcher, following = self._prefetcher, then if then is not None and is_remote(then) else None
        return iter_shard_samples(url, on_error=on_error, start=start, opener=lambda u: prefetcher.open(u, following))

    def close(self) -> None:
        """Drop a shard prefetched for a read that will not come (the reader stopped early)."""
        if self._prefetcher is not None:
            self._prefetcher.discard()
