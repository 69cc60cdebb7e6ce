"""Object storage for checkpoints and run files: one class for local directories and fsspec URLs.

A `Storage` is a root (`/scratch/runs/x`, `s3://bucket/runs/x`, `gs://…`, `az://…`, `https://…` for
reading) plus the operations checkpoints need: put a finished local file, put small bytes, fetch, list,
delete. Every remote operation is retried with exponential backoff on transient failures (connection
refused or reset, timeouts, 5xx, throttling) until a deadline, and fails at once, with one sentence naming
the URL and what to do, on errors retrying cannot fix (access denied, bad credentials, missing bucket).

Credentials and endpoints come from the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, …) or from
--storage-options JSON, which is handed to fsspec and never logged: `redact_options` is what reaches
params.yaml and checkpoints.

(Longer than most modules: the error classification, the retry loop and the bounded first contact are one
policy over the same operations, and reading them apart would hide which failure is retried where.)

Why files are uploaded whole (`put_file`) rather than streamed through an fsspec file object: a local file
can be re-sent after a failure, a half-written stream cannot, and fsspec's buffered writers only push data
on flush/close (pytorch/pytorch#183878: DCP's FsspecWriter could drop data that way). After each upload the
remote size is checked against the local one, so "uploaded" means "the store has every byte".
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import fsspec

from bigclip.errors import UserError, first_line
from bigclip.storage_options import parse_storage_options, redact_urls_in  # noqa: F401  (parse_storage_options: re-exported)

logger = logging.getLogger("bigclip")
T = TypeVar("T")

# How long one operation keeps retrying transient failures. Long enough to ride out a restarting
# endpoint or a throttling burst; a permanently unreachable store still ends the save with an error.
RETRY_SECONDS = float(os.environ.get("BIGCLIP_STORAGE_RETRY_SECONDS", "600"))
S3_PART_SIZE = 32 * 2**20  # multipart part size; s3fs uploads up to 10 parts of a file concurrently


def is_url(path: str) -> bool:
    return "://" in str(path)


def join(root: str, *parts: str) -> str:
    """Join path parts with '/' for URLs and os.path for local paths."""
    parts = tuple(p.strip("/") for p in parts if p)
    if is_url(root):
        return "/".join([root.rstrip("/"), *parts])
    return os.path.join(root, *parts)


REDACTED = "<redacted>"


def redact_url(url: str | None) -> str | None:
    """A URL that can be logged: user:password@ and the query string (a presigned URL's signature, a SAS
    token) replaced (the same rule as for URLs inside any log or error line)."""
    if not url or not is_url(url):
        return url
    return redact_urls_in(url)


def redact_options(options: Any) -> Any:
    """--storage-options (JSON text or dict) for logs, params.yaml and checkpoints: the key names only, every
    value replaced, at every nesting level. Which values are secret cannot be told from the key (an
    Authorization header, a connection string, a SAS token under any name), so none is kept."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError:
            return REDACTED
    return _redact_tree(options)


def _redact_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _redact_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_tree(v) for v in value]
    return REDACTED


class StorageError(UserError):
    """A storage failure retrying cannot fix; the message is one line for the user."""


class StorageUnavailable(Exception):
    """Transient failures did not stop before the retry deadline."""


def _is_permanent(err: BaseException) -> bool:
    if isinstance(
        err,
        (
            PermissionError,
            FileNotFoundError,
            NotADirectoryError,
            IsADirectoryError,
            FileExistsError,
            UserError,
            ValueError,
            TypeError,
            AttributeError,
            KeyError,
        ),
    ):
        return True
    name = type(err).__name__
    # botocore: no usable credentials at all; retrying will not make some appear.
    return name in (
        "NoCredentialsError",
        "PartialCredentialsError",
        "NoRegionError",
        "InvalidConfigError",
        "ProfileNotFound",
    )


class Storage:
    """A root directory or URL. Picklable (the fsspec filesystem is rebuilt on first use)."""

    def __init__(
        self, root: str, options: dict[str, Any] | None = None, retry_seconds: float | None = None, bounded=False
    ):
        """retry_seconds: how long an operation retries transient failures. bounded: also abandon an attempt
        that has not answered by then — for the first contact with a store, where an endpoint that accepts
        connections but never answers must not hold every rank for the client's own timeouts and retries
        (botocore: 60 s per read, 5 tries). Not for uploads: a large file may rightly take longer."""
        self.bounded = bounded
        self.root = root.rstrip("/") if is_url(root) else os.path.abspath(root)
        self.options = dict(options or {})
        self.retry_seconds = RETRY_SECONDS if retry_seconds is None else retry_seconds
        self.remote = is_url(root) and not root.startswith("file://")
        if root.startswith("file://"):
            self.root = os.path.abspath(root[len("file://") :])
        self.protocol = urlsplit(self.root).scheme if self.remote else "file"
        self._fs = None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {
            "root": self.root,
            "options": self.options,
            "retry_seconds": self.retry_seconds,
            "bounded": self.bounded,
            "remote": self.remote,
            "protocol": self.protocol,
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fs = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Storage({redact_url(self.root)!r})"

    @property
    def display(self) -> str:
        return redact_url(self.root) or ""

    @property
    def fs(self):
        with self._lock:
            if self._fs is None:
                try:
                    # Own instance: fsspec's instance cache would hand back a filesystem whose credentials
                    # were resolved earlier (another run in the same process, a rotated key).
                    self._fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.options)
                except ImportError as e:
                    raise UserError(
                        f"{self.display}: the {self.protocol}:// filesystem needs a package "
                        f"({e.name or e}); pip install it (s3fs, gcsfs or adlfs)"
                    ) from None
                except TypeError as e:
                    raise UserError(
                        f"--storage-options: not accepted by the {self.protocol}:// filesystem "
                        f"({e}); check the option names"
                    ) from None
            return self._fs

    def url(self, rel: str = "") -> str:
        return join(self.root, rel) if rel else self.root

    def child(self, rel: str) -> Storage:
        """The same store rooted at rel (sharing the connection pool)."""
        sub = Storage(self.url(rel), self.options, self.retry_seconds, self.bounded)
        sub._fs = self._fs
        return sub

    # -- error handling
    def _explain(self, err: BaseException, what: str) -> str:
        where = self.display
        if isinstance(err, PermissionError) or type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return (
                f"{where}: access denied while trying to {what} ({first_line(err)}); check the credentials "
                f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or --storage-options) and "
                f"that they may write there"
            )
        if isinstance(err, FileNotFoundError) and self.remote:
            bucket = urlsplit(self.root).netloc
            return (
                f"{where}: not found while trying to {what} ({first_line(err)}); check that the bucket "
                f"'{bucket}' exists and the path is right"
            )
        return f"{where}: could not {what} ({first_line(err)})"

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient errors with exponential backoff (0.5 s doubling to 30 s, jittered)."""
        deadline = time.monotonic() + self.retry_seconds
        delay, attempt = 0.5, 0
        while True:
            try:
                result = _answer_within(fn, deadline - time.monotonic()) if self.bounded else fn()
                return result
            except Exception as err:  # noqa: BLE001 — classified below; the fsspec backends raise many types
                if _is_permanent(err):
                    if isinstance(err, UserError):
                        raise
                    raise StorageError(self._explain(err, what)) from None
                attempt += 1
                if time.monotonic() + delay > deadline:
                    raise StorageUnavailable(
                        f"{self.display}: {what} still failing after {attempt} attempts "
                        f"over {self.retry_seconds:.0f} s ({first_line(err)})"
                    ) from None
                if attempt == 1 or attempt % 5 == 0:
                    logger.warning(
                        f"storage: {what} failed ({first_line(err)}); retrying with backoff "
                        f"for up to {self.retry_seconds:.0f} s"
                    )
                time.sleep(delay * (0.75 + 0.5 * random.random()))
                delay = min(delay * 2, 30.0)
                if self.remote:
                    self._invalidate()

    def _invalidate(self) -> None:
        # A listing cached before the outage must not answer for the store after it.
        try:
            self.fs.invalidate_cache()
        except Exception:  # noqa: BLE001
            pass

    # -- operations (rel paths are '/'-separated, relative to the root)
    def put_file(self, local: str, rel: str) -> None:
        """Upload a finished local file; returns when the store holds every byte."""
        target = self.url(rel)
        size = os.path.getsize(local)
        if not self.remote:
            self.retry(f"write {rel}", lambda: _copy_durably(local, target))
            return

        kwargs: dict[str, Any] = {}
        if self.protocol in ("s3", "s3a"):
            kwargs["chunksize"] = S3_PART_SIZE

        def put() -> None:
            self.fs.put_file(local, target, **kwargs)
            remote_size = (
                self.fs.info(target, refresh=True)["size"] if self.protocol in ("s3", "s3a") else self.fs.size(target)
            )
            if remote_size != size:
                raise OSError(f"{rel}: stored {remote_size} bytes of {size}")

        self.retry(f"upload {rel}", put)

    def put_bytes(self, rel: str, data: bytes) -> None:
        target = self.url(rel)
        if not self.remote:
            self.retry(f"write {rel}", lambda: write_durably(target, data))
            return
        self.retry(f"upload {rel}", lambda: self.fs.pipe_file(target, data))

    def copy(self, src_rel: str, dst_rel: str) -> None:
        """Copy one stored file within the store: server-side in object storage (no bytes travel through
        this machine), an fsynced copy in a directory."""
        src, dst = self.url(src_rel), self.url(dst_rel)
        if not self.remote:
            self.retry(f"copy {src_rel} to {dst_rel}", lambda: _copy_durably(src, dst))
            return
        self.retry(f"copy {src_rel} to {dst_rel}", lambda: self.fs.copy(src, dst))

    def get_file(self, rel: str, local: str) -> None:
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        if not self.remote:
            self.retry(f"read {rel}", lambda: shutil.copyfile(self.url(rel), local))
            return
        self.retry(f"download {rel}", lambda: self.fs.get_file(self.url(rel), local))

    def read_bytes(self, rel: str) -> bytes:
        if not self.remote:

            def read() -> bytes:
                with open(self.url(rel), "rb") as f:
                    return f.read()

            return self.retry(f"read {rel}", read)
        return self.retry(f"read {rel}", lambda: self.fs.cat_file(self.url(rel)))

    def read_many(self, rels: list[str]) -> dict[str, bytes | None]:
        """Several small files at once (one round of parallel requests); None for a missing one."""
        out: dict[str, bytes | None] = {}
        if not rels:
            return out
        if not self.remote:
            for rel in rels:
                try:
                    with open(self.url(rel), "rb") as f:
                        out[rel] = f.read()
                except OSError:
                    out[rel] = None
            return out
        urls = {self.url(rel): rel for rel in rels}
        got = self.retry("read manifests", lambda: self.fs.cat(list(urls), on_error="return"))
        for url, rel in urls.items():
            value = got.get(url, got.get(self.fs._strip_protocol(url)))
            out[rel] = value if isinstance(value, bytes) else None
        return out

    def exists(self, rel: str) -> bool:
        if not self.remote:
            return os.path.exists(self.url(rel))
        return self.retry(f"check {rel}", lambda: self.fs.exists(self.url(rel)))

    def list_files(self, rel: str = "", maxdepth: int | None = None) -> dict[str, int]:
        """{path relative to rel: size} of every file under rel (empty when rel does not exist)."""
        base = self.url(rel)
        if not self.remote:
            out = {}
            if not os.path.isdir(base):
                return out
            for dirpath, _, files in os.walk(base):
                depth = os.path.relpath(dirpath, base).count(os.sep) + (dirpath != base)
                if maxdepth is not None and depth >= maxdepth:
                    continue
                for name in files:
                    p = os.path.join(dirpath, name)
                    out[os.path.relpath(p, base).replace(os.sep, "/")] = os.path.getsize(p)
            return out

        def find() -> dict[str, int]:
            self._invalidate()
            found = self.fs.find(base, maxdepth=maxdepth, detail=True)
            prefix = self.fs._strip_protocol(base).rstrip("/") + "/"
            return {
                path[len(prefix) :]: int(info.get("size") or 0)
                for path, info in found.items()
                if path.startswith(prefix) and info.get("type", "file") == "file"
            }

        try:
            return self.retry(f"list {rel or '/'}", find)
        except StorageError:
            raise
        except FileNotFoundError:
            return {}

    def rm(self, rel: str, recursive: bool = False) -> None:
        target = self.url(rel)
        if not self.remote:
            if os.path.isdir(target) and recursive:
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.exists(target):
                os.remove(target)
            return

        def remove() -> None:
            try:
                self.fs.rm(target, recursive=recursive)
            except FileNotFoundError:
                pass

        self.retry(f"delete {rel}", remove)

    def check_writable(self) -> None:
        """Fail now, with one line, when the store cannot be written (bad credentials, missing bucket, an
        endpoint that does not answer within the retry deadline)."""
        probe = f".bigclip-write-test-{os.getpid()}-{random.randrange(1 << 30)}"
        if not self.remote:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as e:
                raise StorageError(
                    f"{self.display}: cannot create the directory ({e.strerror}); pick a writable path"
                ) from None
        try:
            self.put_bytes(probe, b"ok")
            self.rm(probe)
        except StorageUnavailable as e:
            raise unreachable(e) from None


def unreachable(err: StorageUnavailable) -> StorageError:
    """The one line for a store that did not answer within --storage-timeout."""
    return StorageError(
        f"{err}; check the endpoint (AWS_ENDPOINT_URL / --storage-options) and the network, or give it longer "
        f"with --storage-timeout"
    )


def _answer_within(fn: Callable[[], T], seconds: float) -> T:
    """fn(), or TimeoutError (retried like any transient failure) when it has not returned within `seconds`.
    The call goes on in a daemon thread that is abandoned: a hung socket must not keep the process alive."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            box["error"] = e

    thread = threading.Thread(target=call, name="bigclip-storage-call", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.1))
    if thread.is_alive():
        raise TimeoutError(f"no answer within {max(seconds, 0.1):.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _hidden_temp(path: str) -> str:
    """Where `path` is written before it is renamed into place: beside it, hidden (--remote-sync and listings of
    the folder skip dotfiles), unique to this process."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp{os.getpid()}")


def write_durably(path: str, data: bytes) -> None:
    """`data` at `path` whole or not at all, on disk before this returns (written beside, synced, renamed)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = _hidden_temp(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_durably(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    tmp = _hidden_temp(dst)
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 22)
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(tmp, dst)


def fsync_dir(path: str) -> None:
    """Make a rename or new file inside `path` durable (POSIX needs the directory synced too)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
