"""Rank 0's side of a commit: the manifest that makes a checkpoint exist (locally: then the rename of
<tag>.partial to <tag>; remotely: the last object written), aliases committed as copies of it (epoch_latest:
hard links locally, server-side copies remotely) and retention (--delete-previous-checkpoint, --keep-last-k).
The CheckpointManager (ckpt/manager.py) calls it from the save thread once every rank's files are written."""

from __future__ import annotations

import logging
import os
import shutil
import time

from bigclip.ckpt.catalog import CheckpointCatalog, is_numbered
from bigclip.ckpt.manifest import MANIFEST, Manifest
from bigclip.ckpt.storage import Storage, fsync_dir, write_durably

logger = logging.getLogger("bigclip")


def partial_dir(directory: str, tag: str) -> str:
    """Where a checkpoint's files are written before its manifest commits it."""
    return os.path.join(directory, f"{tag}.partial")


class Publisher:
    def __init__(
        self,
        directory: str,
        remote: Storage | None,
        catalog: CheckpointCatalog,
        *,
        keep_local: bool = True,
        delete_previous: bool = False,
        keep_last_k: int = 0,
    ):
        self.directory = directory
        self.remote = remote
        self.catalog = catalog
        self.keep_local = keep_local
        self.delete_previous = delete_previous
        self.keep_last_k = keep_last_k
        self._previous_local: str | None = None

    def partial(self, tag: str) -> str:
        return partial_dir(self.directory, tag)

    def publish(self, tag: str, manifest: Manifest) -> str:
        """Write the manifest: after it, and only after it, the checkpoint exists."""
        partial, final = self.partial(tag), os.path.join(self.directory, tag)
        write_durably(os.path.join(partial, MANIFEST), manifest.to_bytes())
        if self.keep_local:
            _replace_dir(partial, final)
            fsync_dir(self.directory)
        if self.remote is not None:
            self.remote.put_bytes(f"{tag}/{MANIFEST}", manifest.to_bytes())
            self._drop_strays(tag, manifest)
        if not self.keep_local:
            shutil.rmtree(partial, ignore_errors=True)
        if self.keep_local and is_numbered(tag):
            if self.delete_previous and self._previous_local and self._previous_local != final:
                shutil.rmtree(self._previous_local, ignore_errors=True)  # local copies only; remote keeps all
            self._previous_local = final
        return self.remote.url(tag) if self.remote is not None else final

    def _drop_strays(self, tag: str, manifest: Manifest) -> None:
        # A tag written before (epoch_latest) may hold files the new manifest no longer names.
        listing = self.remote.list_files(tag)
        for rel in listing:
            if rel != MANIFEST and rel not in manifest.files:
                self.remote.rm(f"{tag}/{rel}")

    def alias(self, tag: str, alias: str, manifest: Manifest) -> None:
        copy = Manifest(**{**manifest.__dict__, "tag": alias, "created": time.time()})
        if self.keep_local:
            src, partial = os.path.join(self.directory, tag), self.partial(alias)
            shutil.rmtree(partial, ignore_errors=True)
            for rel in manifest.files:
                os.makedirs(os.path.dirname(os.path.join(partial, rel)), exist_ok=True)
                os.link(os.path.join(src, rel), os.path.join(partial, rel))  # same bytes, no copy
            write_durably(os.path.join(partial, MANIFEST), copy.to_bytes())
            _replace_dir(partial, os.path.join(self.directory, alias))
            fsync_dir(self.directory)
        if self.remote is not None:
            self.remote.rm(f"{alias}/{MANIFEST}")
            for rel in manifest.files:  # server-side copies: no bytes travel through this machine
                self.remote.copy(f"{tag}/{rel}", f"{alias}/{rel}")
            self.remote.put_bytes(f"{alias}/{MANIFEST}", copy.to_bytes())
            self._drop_strays(alias, copy)

    def retention(self, just_saved: str) -> None:
        """--keep-last-k: keep the k newest numbered checkpoints in the remote store (locally when there is
        no remote), newest by training position (the catalog's one order), whatever order they were committed
        in. epoch_latest-style aliases are never counted or deleted.

        The checkpoint just committed is never deleted by its own commit, and so neither is anything newer
        than it: one that commits late, behind k newer ones (a retried upload, a straggling writer), stays
        until a later commit's retention, and the checkpoints between them are not pruned for it."""
        if self.keep_last_k <= 0:
            return
        local = self.remote is None
        ranked = self.catalog.candidates(local=local, remote=not local, check=False)  # newest first
        numbered = [c for c in ranked if c.numbered]
        keep = self.keep_last_k
        late = next((i for i, c in enumerate(numbered) if c.tag == just_saved and i >= keep), None)
        if late is not None:
            keep = late + 1
            newer = ", ".join(c.tag for c in numbered[:late])
            logger.warning(
                f"checkpoint {just_saved} committed after {late} newer ones ({newer}); "
                f"--keep-last-k {self.keep_last_k} keeps it until the next checkpoint commits and deletes only "
                f"older ones now"
            )
        for old in numbered[keep:]:
            logger.info(f"--keep-last-k {self.keep_last_k}: deleting checkpoint {old.location}")
            if local:
                os.remove(os.path.join(old.location, MANIFEST))  # uncommit first, then remove
                shutil.rmtree(old.location, ignore_errors=True)
            else:
                self.remote.rm(f"{old.tag}/{MANIFEST}")
                self.remote.rm(old.tag, recursive=True)


def _replace_dir(src: str, dst: str) -> None:
    if os.path.exists(dst):  # replacing epoch_latest: move the old one aside, then drop it
        old = dst + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
