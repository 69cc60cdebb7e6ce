"""Checking a checkpoint against its manifest, locally or while downloading it from a URL."""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

from bigclip.ckpt.manifest import MANIFEST, Manifest, check_file, unsafe_path
from bigclip.ckpt.storage import Storage, StorageError, StorageUnavailable, unreachable
from bigclip.errors import UserError

logger = logging.getLogger("bigclip")


class CorruptCheckpoint(UserError):
    """A checkpoint that exists but does not verify: no manifest, or a missing or mismatching file."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def read_local_manifest(path: str) -> Manifest | None:
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return Manifest.from_bytes(f.read())
    except OSError:
        return None


def _refuse_unsafe_paths(manifest: Manifest, where: str) -> None:
    bad = next((rel for rel in manifest.files if unsafe_path(rel)), None)
    if bad is not None:
        raise CorruptCheckpoint(
            f"checkpoint {where}: {MANIFEST} names {bad!r}, a path outside the checkpoint; it will not be "
            f"loaded — pick another checkpoint"
        )


def verify_local(directory: str) -> Manifest:
    """The manifest of a complete local checkpoint whose every file matches its size and CRC-32."""
    manifest = read_local_manifest(directory)
    if manifest is None:
        if not os.path.isdir(directory):
            raise UserError(
                f"checkpoint {directory}: no such checkpoint directory; pass a checkpoint "
                f"directory (…/checkpoints/<tag>), a URL, or 'latest'"
            )
        raise CorruptCheckpoint(
            f"checkpoint {directory}: no valid {MANIFEST} (incomplete, or not a bigclip "
            f"checkpoint); pick a committed checkpoint"
        )
    _refuse_unsafe_paths(manifest, directory)
    for rel, meta in manifest.files.items():
        problem = check_file(os.path.join(directory, rel), meta)
        if problem:
            raise CorruptCheckpoint(
                f"checkpoint {directory}: {rel}: {problem}; it will not be loaded — pick another checkpoint"
            )
    return manifest


def fetch_verified(
    url: str,
    directory: str,
    options: dict | None = None,
    pool: ThreadPoolExecutor | None = None,
    timeout: float = 60.0,
) -> Manifest:
    """Download the checkpoint at `url` into `directory` (parallel, retried) and verify every file.

    timeout (--storage-timeout): how long the store may leave the manifest unanswered before this stops with
    one line. Once it has answered, each file is retried for the (longer) upload deadline: a store that
    answered is worth waiting for through a short outage."""
    store = Storage(url, options)
    try:
        manifest = Manifest.from_bytes(Storage(url, options, timeout, bounded=True).read_bytes(MANIFEST))
    except StorageUnavailable as e:
        raise unreachable(e) from None
    except StorageError as e:
        if "not found" in str(e):
            raise CorruptCheckpoint(
                f"checkpoint {store.display}: no {MANIFEST} (incomplete, or not a bigclip "
                f"checkpoint); pick a committed checkpoint"
            ) from None
        raise
    if manifest is None:
        raise CorruptCheckpoint(f"checkpoint {store.display}: {MANIFEST} is not a bigclip manifest")
    _refuse_unsafe_paths(manifest, store.display)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    logger.info(f"downloading checkpoint {store.display} ({len(manifest.files)} files, {_gb(manifest.total_bytes)})")

    def fetch(rel: str) -> str | None:
        local = os.path.join(directory, rel)
        try:
            store.get_file(rel, local)
        except (StorageError, StorageUnavailable) as e:
            return str(e)
        return check_file(local, manifest.files[rel])

    own = pool is None
    pool = pool or ThreadPoolExecutor(8)
    try:
        problems = list(pool.map(fetch, list(manifest.files)))
    finally:
        if own:
            pool.shutdown()
    for rel, problem in zip(manifest.files, problems):
        if problem:
            raise CorruptCheckpoint(
                f"checkpoint {store.display}: {rel}: {problem}; it will not be loaded — pick another checkpoint"
            )
    with open(os.path.join(directory, MANIFEST), "wb") as f:
        f.write(manifest.to_bytes())
    return manifest
