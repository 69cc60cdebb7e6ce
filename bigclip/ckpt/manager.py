"""Checkpoint manager: when to save, how a checkpoint becomes visible, which one to resume.

A checkpoint is a directory `checkpoints/<tag>/` holding the engine state, one RNG file per rank, a
train-state record (step, epoch, samples seen, data position, config) and, written last, `manifest.json`
naming every file with its size and sha256. Files are written into `<tag>.partial/` and the directory is
renamed only after the manifest is in place, so a crash mid-save never leaves something that looks like a
checkpoint. Nothing without a valid manifest is ever loaded.

This local, synchronous writer sits behind the interface the loop uses (save / wait / latest / load),
so sharded, asynchronous, object-storage checkpoints can replace it without touching the loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

from ..dist import World, barrier, broadcast_object
from ..errors import UserError

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
ENGINE_STATE = "engine_state.pt"
FORMAT = "bigclip-checkpoint-1"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_manifest(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verify(path: str) -> dict[str, Any]:
    """The manifest of a complete, uncorrupted checkpoint, or a UserError saying what is wrong."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: no valid {MANIFEST} (incomplete or not a bigclip checkpoint); "
                        f"pick a committed checkpoint")
    for rel, meta in manifest["files"].items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise UserError(f"checkpoint {path}: {rel} is missing; pick another checkpoint")
        if os.path.getsize(file) != meta["size"] or _sha256(file) != meta["sha256"]:
            raise UserError(f"checkpoint {path}: {rel} does not match its checksum (corrupt); "
                            f"pick another checkpoint")
    return manifest


class CheckpointManager:
    def __init__(self, directory: str, engine, world: World, delete_previous: bool = False):
        self.directory = directory
        self.engine = engine
        self.world = world
        self.delete_previous = delete_previous
        self._previous: str | None = None

    # -- saving
    def save(self, tag: str, train_state: dict[str, Any], blocking: bool = True) -> str:
        """Write checkpoint `tag` (e.g. epoch_3, epoch_latest) and commit it. Collective: every rank calls."""
        final = os.path.join(self.directory, tag)
        partial = final + ".partial"
        if self.world.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left over by a crash during an earlier save
            os.makedirs(partial)
        barrier(self.world)

        torch.save(rng_state(), os.path.join(partial, f"rng_rank{self.world.rank}.pt"))
        # DDP replicas are identical, so one copy of model and optimizer state is enough.
        if self.world.is_main:
            torch.save(self.engine.state_dict(), os.path.join(partial, ENGINE_STATE))
            with open(os.path.join(partial, TRAIN_STATE), "w") as f:
                json.dump(train_state, f, indent=1, default=str)
        barrier(self.world)

        if self.world.is_main:
            self._commit(partial, final, train_state)
            if self.delete_previous and self._previous and self._previous != final:
                shutil.rmtree(self._previous, ignore_errors=True)
            if not tag.endswith("latest"):
                self._previous = final
        barrier(self.world)
        return final

    def _commit(self, partial: str, final: str, train_state: dict[str, Any]) -> None:
        files = {}
        for name in sorted(os.listdir(partial)):
            p = os.path.join(partial, name)
            files[name] = {"size": os.path.getsize(p), "sha256": _sha256(p)}
        manifest = {"format": FORMAT, "step": train_state["step"], "epoch": train_state["epoch"],
                    "engine": self.engine.name, "world_size": self.world.world_size, "files": files}
        tmp = os.path.join(partial, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(partial, MANIFEST))
        if os.path.exists(final):  # replacing epoch_latest: move the old one aside, then drop it
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)

    def wait(self) -> None:
        """Block until every save has committed. Saves are synchronous here, so nothing is pending."""

    # -- finding and loading
    def latest(self) -> str | None:
        """The committed checkpoint with the highest step (ties: the numbered one). Collective."""
        best = None
        if self.world.is_main and os.path.isdir(self.directory):
            candidates = []
            for name in os.listdir(self.directory):
                path = os.path.join(self.directory, name)
                if not os.path.isdir(path) or not re.fullmatch(r"[\w\-]+", name):
                    continue  # skips *.partial and *.old
                manifest = read_manifest(path)
                if manifest is None:
                    continue
                candidates.append((manifest["step"], name != "epoch_latest", path))
            if candidates:
                best = max(candidates)[2]
        return broadcast_object(best, self.world)

    def load(self, path: str) -> dict[str, Any]:
        """Restore engine state and this rank's RNG from `path`; return the train-state record."""
        manifest = verify(path) if self.world.is_main else None
        manifest = broadcast_object(manifest, self.world)
        try:
            state = torch.load(os.path.join(path, ENGINE_STATE), map_location="cpu", weights_only=False)
            self.engine.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise UserError(f"--resume {path}: does not fit this model/optimizer ({str(e).splitlines()[0]}); "
                            f"resume with the flags the run was started with") from None
        rng_file = os.path.join(path, f"rng_rank{self.world.rank}.pt")
        if os.path.exists(rng_file):  # a different world size has no RNG file for new ranks: fresh RNG
            set_rng_state(torch.load(rng_file, weights_only=False))
        with open(os.path.join(path, TRAIN_STATE)) as f:
            return json.load(f)
