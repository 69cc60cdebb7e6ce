"""Finding and loading committed checkpoints: every checkpoint with a manifest, local and remote, ranked newest
first; `--resume latest` / a path / a URL verified against its manifest and restored into the engine's layout.

Nothing without a manifest is ever loaded, and a checkpoint whose files do not match it is reported and
skipped (`--resume latest`) or refused (an explicit path). The CheckpointManager (ckpt/manager.py) saves;
this catalog finds and loads, and retention asks it which checkpoints exist.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bigclip.ckpt.layout import CheckpointLayout
from bigclip.ckpt.manifest import MANIFEST, TRAIN_STATE, Manifest, check_sizes, rng_file
from bigclip.ckpt.rng import load_rank_state_file, read_data_position
from bigclip.ckpt.storage import Storage, StorageUnavailable, is_url, unreachable
from bigclip.ckpt.verify import CorruptCheckpoint, fetch_verified, read_local_manifest, verify_local
from bigclip.dist import World, barrier, broadcast_object, raise_together
from bigclip.errors import UserError

logger = logging.getLogger("bigclip")

TAG = re.compile(r"[\w\-]+")  # a checkpoint's name: epoch_3, step_1200, epoch_latest


def is_numbered(tag: str) -> bool:
    return not tag.endswith("latest")


@dataclass
class Candidate:
    step: int
    numbered: bool
    local: bool
    location: str
    manifest: Manifest


class CheckpointCatalog:
    def __init__(
        self,
        directory: str,
        layout: CheckpointLayout,
        world: World,
        io: ThreadPoolExecutor,
        *,
        remote: Storage | None = None,
        probe: Storage | None = None,
        storage_options: dict | None = None,
        storage_timeout: float = 60.0,
    ):
        """directory: the local checkpoints folder. remote: the store saves upload to (retries for the upload
        timeout); probe: the same store for first contact (every attempt bounded by storage_timeout)."""
        self.directory = directory
        self.layout = layout
        self.world = world
        self._io = io
        self.remote = remote
        self._probe = probe
        self.storage_options = dict(storage_options or {})
        self.storage_timeout = storage_timeout

    def candidates(self, local: bool = True, remote: bool = True, check: bool = True) -> list[Candidate]:
        out: list[Candidate] = []
        if local and os.path.isdir(self.directory):
            for name in sorted(os.listdir(self.directory)):
                path = os.path.join(self.directory, name)
                if not TAG.fullmatch(name) or not os.path.isdir(path):
                    continue  # skips *.partial, *.old and hidden download folders
                manifest = read_local_manifest(path)
                if manifest is None:
                    continue
                if check:
                    problem = check_sizes(_local_listing(path, manifest), manifest)
                    if problem:
                        logger.warning(f"checkpoint {path}: {problem}; skipped")
                        continue
                out.append(Candidate(manifest.step, is_numbered(name), True, path, manifest))
        if remote and self.remote is not None:
            # Retention lists through the upload store (a save rides out outages); a resume through the probe.
            store = self.remote if not check else self._probe
            try:
                listing = store.list_files()
                tags = sorted({rel.split("/", 1)[0] for rel in listing if rel.endswith("/" + MANIFEST)})
                raw = store.read_many([f"{t}/{MANIFEST}" for t in tags])
            except StorageUnavailable as e:
                if not check:
                    raise
                raise unreachable(e) from None
            for tag in tags:
                manifest = Manifest.from_bytes(raw.get(f"{tag}/{MANIFEST}"))
                if manifest is None or not TAG.fullmatch(tag):
                    continue
                files = {rel[len(tag) + 1 :]: size for rel, size in listing.items() if rel.startswith(tag + "/")}
                problem = check_sizes(files, manifest) if check else None
                if problem:
                    logger.warning(f"checkpoint {self.remote.url(tag)}: {problem}; skipped")
                    continue
                out.append(Candidate(manifest.step, is_numbered(tag), False, self.remote.url(tag), manifest))
        return out

    def latest(self) -> str | None:
        """The committed checkpoint with the highest step, local or remote (ties: numbered, then local).
        Collective."""
        ranked = self._ranked()
        return ranked[0] if ranked else None

    def _ranked(self) -> list[str]:
        """Every committed checkpoint, newest first (collective: rank 0 lists, and a store that cannot be
        reached stops every rank with its line, not rank 0 alone)."""

        def rank_candidates() -> list[str]:
            key = lambda c: (c.step, c.numbered, c.local)  # noqa: E731
            return [c.location for c in sorted(self.candidates(), reverse=True, key=key)]

        return broadcast_object(raise_together(self.world, rank_candidates) or [], self.world)

    def resume(self, spec: str | None) -> tuple[str, dict[str, Any]] | None:
        """Load `spec` ('latest', a local path or a URL); returns (location, train state) or None.

        With 'latest' a checkpoint that fails verification is reported and the next older one is tried."""
        if not spec:
            return None
        if spec != "latest":
            return spec, self.load(spec)
        ranked = self._ranked()
        for location in ranked:
            try:
                return location, self.load(location)
            except CorruptCheckpoint as e:
                logger.warning(f"--resume latest: {e}; trying an older checkpoint")
        return None

    # ------------------------------------------------------------------------------------------- loading
    def load(self, location: str) -> dict[str, Any]:
        """Verify `location` against its manifest, restore the engine and this rank's RNG, return the train
        state. Collective. A checkpoint that does not verify raises UserError (a CorruptCheckpoint)."""
        remote = is_url(location)
        directory = location
        if remote:
            directory = os.path.join(self.directory, f".download-{basename(location)}-{socket.gethostname()}")
        # Remote: every node downloads its own copy (local rank 0); local: rank 0 verifies. Any failure stops
        # every rank; everyone then has rank 0's manifest.
        downloader = self.world.local_rank == 0 if remote else self.world.is_main

        def fetch() -> Manifest:
            if remote:
                return fetch_verified(location, directory, self.storage_options, self._io, self.storage_timeout)
            return verify_local(directory)

        try:
            manifest = raise_together(self.world, fetch, runs_here=downloader)
        except UserError:
            if remote and downloader:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        manifest = broadcast_object(manifest, self.world)
        try:
            return self._restore(directory, manifest)
        finally:
            if remote:
                barrier(self.world)
                if downloader:
                    shutil.rmtree(directory, ignore_errors=True)

    def _restore(self, directory: str, manifest: Manifest) -> dict[str, Any]:
        if manifest.layout != self.layout.name:
            raise UserError(
                f"checkpoint {directory}: written by engine {manifest.engine} ({manifest.layout} "
                f"layout); resume it with --engine {manifest.engine}, or export it with "
                f"`bigclip export` and start from the weights with --pretrained"
            )
        self.layout.load(directory, manifest.world_size, manifest.extra or {})
        own_rng = os.path.join(directory, rng_file(self.world.rank))
        data_position = {}
        if os.path.exists(own_rng):
            data_position = load_rank_state_file(own_rng)
        if manifest.world_size != self.world.world_size:
            # Each rank's data position is only its own share of the epoch; at another world size every rank
            # needs all of them to deal out what was left.
            data_position = {"world_size": manifest.world_size, "ranks": read_data_positions(directory, manifest)}
            if self.world.is_main:
                fresh = self.world.world_size > manifest.world_size
                logger.info(
                    f"checkpoint {directory}: saved by {manifest.world_size} ranks, resumed on "
                    f"{self.world.world_size}: what the epoch had left is dealt out to the new ranks"
                    + (f"; ranks {manifest.world_size}+ start with fresh random state" if fresh else "")
                )
        with open(os.path.join(directory, TRAIN_STATE)) as f:
            record = json.load(f)
        record["data"] = data_position  # this rank's own, not rank 0's
        return record


def basename(location: str) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1]


def _local_listing(path: str, manifest: Manifest) -> dict[str, int]:
    out = {}
    for rel in manifest.files:
        p = os.path.join(path, rel)
        if os.path.isfile(p):
            out[rel] = os.path.getsize(p)
    return out


def verify(path: str) -> dict[str, Any]:
    """The manifest (as a dict) of a complete, uncorrupted local checkpoint, else a UserError."""
    return verify_local(path).__dict__


def read_data_positions(directory: str, manifest: Manifest) -> dict[int, dict[str, Any]]:
    """The data position of every rank that saved checkpoint `directory` (rank -> position)."""
    positions = {}
    for rank in range(manifest.world_size):
        path = os.path.join(directory, rng_file(rank))
        if os.path.exists(path):
            positions[rank] = read_data_position(path)
    return positions
