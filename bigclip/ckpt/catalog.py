"""Finding and loading committed checkpoints: every checkpoint with a manifest, local and remote, ranked newest
first; `--resume latest` / a path / a URL verified against its manifest and restored into the engine's layout
and every participant, by name (ckpt/participants.py).

"Newest" is a checkpoint's training position, (step, then epoch), read from its manifest, never the order in
which checkpoints were committed: an upload that was retried (or a request the network delivered late) can
commit after a newer checkpoint, and must still rank below it. `newest_first` is that one order; `--resume
latest`, `--keep-last-k` (ckpt/publish.py) and the listing all take it from here.

Nothing without a manifest is ever loaded, and a checkpoint whose files do not match it is reported and
skipped (`--resume latest`) or refused (an explicit path). The CheckpointManager (ckpt/manager.py) saves;
this catalog finds and loads, and retention asks it which checkpoints exist.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from bigclip.ckpt.layout import CheckpointLayout
from bigclip.ckpt.manifest import MANIFEST, TRAIN_STATE, Manifest, check_sizes, rank_file
from bigclip.ckpt.participants import PER_RANK, RECORD, absent, of_kind, read_rank_file, read_record
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

    @property
    def tag(self) -> str:
        return basename(self.location)


def rank_key(c: Candidate) -> tuple:
    """Larger is newer: the training position (step, then epoch: an epoch's checkpoint taken at the same step as a
    step save is the later state); at the same position a numbered checkpoint before an alias (epoch_latest is a
    copy of one), a local copy before a remote one (no download), then the name, so that every ranking of the same
    checkpoints is the same. Never the commit time."""
    return (c.manifest.step, c.manifest.epoch, c.numbered, c.local, c.tag)


def newest_first(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=rank_key, reverse=True)


class CheckpointCatalog:
    def __init__(
        self,
        directory: str,
        layout: CheckpointLayout,
        world: World,
        io: ThreadPoolExecutor,
        participants: Mapping[str, Stateful] | None = None,
        *,
        remote: Storage | None = None,
        probe: Storage | None = None,
        storage_options: dict | None = None,
        storage_timeout: float = 60.0,
    ):
        """directory: the local checkpoints folder. remote: the store saves upload to (retries for the upload
        timeout); probe: the same store for first contact (every attempt bounded by storage_timeout).
        participants: the manager's (the layout already holds the sharded ones)."""
        self.directory = directory
        self.layout = layout
        self._per_rank = of_kind(participants or {}, PER_RANK)
        self._record = of_kind(participants or {}, RECORD)
        self.world = world
        self._io = io
        self.remote = remote
        self._probe = probe
        self.storage_options = dict(storage_options or {})
        self.storage_timeout = storage_timeout

    def candidates(self, local: bool = True, remote: bool = True, check: bool = True) -> list[Candidate]:
        """Every committed checkpoint, newest first (newest_first)."""
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
        return newest_first(out)

    def latest(self) -> str | None:
        """The newest committed checkpoint by training position (rank_key), local or remote. Collective."""
        ranked = self._ranked()
        return ranked[0] if ranked else None

    def _ranked(self) -> list[str]:
        """Every committed checkpoint, newest first (collective: rank 0 lists, and a store that cannot be
        reached stops every rank with its line, not rank 0 alone)."""

        def rank_candidates() -> list[str]:
            return [c.location for c in self.candidates()]

        return broadcast_object(raise_together(self.world, rank_candidates) or [], self.world)

    def resume(self, spec: str | None) -> tuple[str, Manifest] | None:
        """Load `spec` ('latest', a local path or a URL); returns (location, its manifest) or None.

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
    def load(self, location: str) -> Manifest:
        """Verify `location` against its manifest, restore the engine and every participant, return the
        manifest. Collective. A checkpoint that does not verify raises UserError (a CorruptCheckpoint)."""
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

    def _restore(self, directory: str, manifest: Manifest) -> Manifest:
        if manifest.layout != self.layout.name:
            raise UserError(
                f"checkpoint {directory}: written by engine {manifest.engine} ({manifest.layout} "
                f"layout); resume it with --engine {manifest.engine}, or export it with "
                f"`bigclip export` and start from the weights with --pretrained"
            )
        self.layout.load(directory, manifest.world_size, manifest.extra or {})  # the sharded participants too
        self._restore_per_rank(directory, manifest)
        record = read_record(os.path.join(directory, TRAIN_STATE), manifest.format)
        for name, participant in self._record.items():
            if name in record:
                participant.load_state_dict(record[name])
            else:
                absent(name, participant, directory, log=self.world.is_main)
        return manifest

    def _restore_per_rank(self, directory: str, manifest: Manifest) -> None:
        """Each rank participant from this rank's file; at another world size, one that can deal out what every
        saved rank had (load_state_dicts: the data position) from all of them."""
        if not self._per_rank:
            return
        own_path = os.path.join(directory, rank_file(self.world.rank))
        own = read_rank_file(own_path, manifest.format) if os.path.exists(own_path) else {}
        resized = manifest.world_size != self.world.world_size
        every = read_rank_files(directory, manifest) if resized else {}
        dealt = []
        for name, participant in self._per_rank.items():
            if resized and hasattr(participant, "load_state_dicts"):
                by_rank = {rank: states[name] for rank, states in every.items() if name in states}
                if by_rank:
                    participant.load_state_dicts(by_rank, manifest.world_size)
                    dealt.append(name)
                    continue
            if name in own:
                participant.load_state_dict(own[name])
            else:
                absent(name, participant, directory, log=self.world.is_main and not resized)
        if resized and self.world.is_main:
            own_only = [name for name in self._per_rank if name not in dealt]
            fresh = self.world.world_size > manifest.world_size and own_only
            logger.info(
                f"checkpoint {directory}: saved by {manifest.world_size} ranks, resumed on "
                f"{self.world.world_size}"
                + (f": {', '.join(dealt)} dealt out from all {manifest.world_size} ranks' files" if dealt else "")
                + (f"; {', '.join(own_only)} from the same rank's file" if own_only else "")
                + (f" (ranks {manifest.world_size}+ start afresh)" if fresh else "")
            )


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


def read_rank_files(directory: str, manifest: Manifest) -> dict[int, dict[str, Any]]:
    """The rank participants' states of every rank that saved checkpoint `directory` (rank -> name -> state)."""
    states = {}
    for rank in range(manifest.world_size):
        path = os.path.join(directory, rank_file(rank))
        if os.path.exists(path):
            states[rank] = read_rank_file(path, manifest.format)
    return states
