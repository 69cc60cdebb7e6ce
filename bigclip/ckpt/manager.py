"""Checkpoint manager: asynchronous save and its commit. Rank 0's commit (manifest, aliases, retention) is its
publisher's (ckpt/publish.py); finding and loading what to resume is its catalog's (ckpt/catalog.py), which the
manager's latest() / resume() / load() hand on to.

A checkpoint `<tag>` (epoch_3, step_1200, epoch_latest) is a directory — locally `<logs>/<name>/checkpoints/
<tag>/`, remotely `<remote-sync>/<name>/checkpoints/<tag>/` — holding its participants by name
(ckpt/participants.py): the engine's state and the sharded participants (the moving average) in the engine's
layout ("dcp" or "deepspeed"), one file per rank with the rank participants (RNG, data position),
train_state.json with the record participants (train state, resolved config) and, written last, manifest.json
naming every file with size and CRC-32.

One save, on every rank:
  main thread   stage the engine state into reused host buffers, capture the rank and record participants'
                state_dict()                                                                  (blocked)
  save thread   write files into <tag>.partial/; each finished file is hashed and uploaded at once
                (FileSink); gather every rank's file list on the checkpoint's own gloo group; rank 0
                publishes: manifest.json (remote: last object; local: then renames .partial -> <tag>),
                aliases, retention.
A new save first waits for the previous one; the run's end waits for the last (`wait()` logs it). A save
that fails for good (access denied, missing bucket) stops the run at the next save or wait with one line; a
save that ran out of retries is reported and training goes on (the next save tries again).

(Longer than most modules: one save's life across the main thread and the save thread — stage, write, agree,
commit, report — is one state machine; its steps are kept in one class to show which thread owns which.)
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from bigclip.ckpt.catalog import TAG, CheckpointCatalog
from bigclip.ckpt.config import ASYNC_MODES, DEFAULT_WRITER
from bigclip.ckpt.manifest import CONSOLIDATED, MANIFEST, TRAIN_STATE, Manifest, rank_file
from bigclip.ckpt.participants import PER_RANK, RECORD, SHARDED, check, of_kind, rank_file_bytes, record_bytes
from bigclip.ckpt.publish import Publisher, partial_dir
from bigclip.ckpt.storage import (
    Storage,
    StorageError,
    StorageUnavailable,
    write_durably,
)
from bigclip.ckpt.upload import FileSink, lower_priority
from bigclip.dist import World, raise_together
from bigclip.errors import UserError, first_line

logger = logging.getLogger("bigclip")

# Set once a save has been given up unfinished: its threads may hang in a store's socket for good, so the
# process entry point exits without joining them (bigclip/cli.py, exit_process).
ABANDONED = threading.Event()
UPLOAD_THREADS = 4


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@dataclass
class SaveResult:
    tag: str
    step: int
    location: str | None = None  # where it was committed (remote URL when there is one)
    error: str | None = None
    permanent: bool = False  # an error retrying cannot fix: the run stops
    files: int = 0
    bytes: int = 0
    blocked_s: float = 0.0  # time the training loop was blocked by this save
    commit_s: float = 0.0  # from the save call to the manifest being written
    aliases: list[str] = field(default_factory=list)


class CheckpointManager:
    def __init__(
        self,
        directory: str,
        engine,
        world: World,
        delete_previous: bool = False,
        *,
        participants: Mapping[str, Stateful] | None = None,
        remote: str | None = None,
        storage_options: dict | None = None,
        keep_last_k: int = 0,
        async_mode: str = "auto",
        keep_local: bool = True,
        storage_timeout: float = 60.0,
        upload_timeout: float | None = None,
        consolidated_names: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ):
        """directory: local checkpoints folder. participants: name -> what each checkpoint saves and a resume
        restores besides the engine's model and optimizer, each where its `checkpoint_kind` says
        (ckpt/participants.py). remote: URL of the remote checkpoints folder (or None).
        keep_local=False keeps no local copies (the local folder is only a staging area).
        storage_timeout (--storage-timeout): how long the store may go unanswered when it is first reached
        (the write check, listing and reading checkpoints to resume). upload_timeout
        (--checkpoint-upload-timeout): how long each step of a save retries before the save is given up.
        consolidated_names (--fsdp-checkpoint full): rank 0 adds the whole model's weights, renamed by it, to
        every checkpoint as one more file (CONSOLIDATED), read back from what every rank wrote, before the
        commit."""
        if async_mode not in ASYNC_MODES:
            raise UserError(f"--checkpoint-async {async_mode!r}: choose one of {', '.join(ASYNC_MODES)}")
        self.directory = os.path.abspath(directory)
        self.participants = check(participants or {})
        self._per_rank = of_kind(self.participants, PER_RANK)
        self._record = of_kind(self.participants, RECORD)
        self.consolidated_names = consolidated_names
        self.engine = engine
        self.world = world
        self.storage_options = dict(storage_options or {})
        self.storage_timeout = storage_timeout
        self.remote = Storage(remote, self.storage_options, upload_timeout) if remote else None
        # The same store for first contact: every attempt abandoned at the --storage-timeout deadline.
        self._probe = Storage(remote, self.storage_options, storage_timeout, bounded=True) if remote else None
        # Checkpoint collectives get their own gloo group: running them from the save thread on the
        # training group interleaves with the loop's collectives and corrupts both.
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        # busy() is asked from the main thread while the save thread may be in a collective on self.group.
        self._control_group = dist.new_group(backend="gloo") if self.group is not None else None
        # The engine names its checkpoint layout; the writer defaults to a thread for every layout (DEFAULT_WRITER,
        # chosen by bench/checkpoint_stall.py: DCP's file writes, hashing and uploads release the GIL; a process
        # costs a shared-memory copy of the state and a second interpreter). The layout also writes the sharded
        # participants. "off" stages through the thread writer's path and waits for it.
        writer = {"auto": DEFAULT_WRITER, "off": "thread"}.get(async_mode, async_mode)
        self.layout = engine.checkpoint_layout(self.group, writer, of_kind(self.participants, SHARDED))
        self.mode = "off" if async_mode == "off" else self.layout.mode
        self._save_thread = ThreadPoolExecutor(1, thread_name_prefix="bigclip-ckpt", initializer=lower_priority)
        self._io = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="bigclip-upload", initializer=lower_priority)
        self._pending: Future | None = None
        self.pending_tag: str | None = None  # the tag of the save in flight
        self.abandoned = False  # a save was given up unfinished (wait's timeout): no further saves
        self._staging: Future | None = None  # the state copy of the save in flight
        self._staging_wait = 0.0  # time the loop waited for it (wait_staged)
        self.results: list[SaveResult] = []
        self.last_saved_step: int | None = None
        self.catalog = CheckpointCatalog(
            self.directory,
            self.layout,
            world,
            self._io,
            self.participants,
            remote=self.remote,
            probe=self._probe,
            storage_options=self.storage_options,
            storage_timeout=storage_timeout,
        )
        self.publisher = Publisher(
            self.directory,
            self.remote,
            self.catalog,
            keep_local=keep_local,
            delete_previous=delete_previous,
            keep_last_k=keep_last_k,
        )
        self._check_remote()

    # ------------------------------------------------------------------------------------------ saving
    def busy(self) -> bool:
        """The previous save is still being written or uploaded on some rank. Collective (every rank then takes
        the same decision about the next save); free when no save was started since the last wait."""
        if self._pending is None:
            return False  # the same on every rank: saves start and are waited for at the same calls
        busy = not self._pending.done()
        return busy if self.group is None else self._any(busy)

    def _any(self, flag: bool) -> bool:
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control_group)
        return bool(t.item())

    def save(
        self,
        tag: str,
        step: int,
        epoch: int,
        blocking: bool = False,
        aliases: tuple[str, ...] | list[str] = (),
    ) -> str:
        """Start checkpoint `tag` of every participant (collective: every rank calls). Returns where it will be
        committed. step, epoch: where the run is, for the manifest (and the consolidated weights).

        aliases: further tags (e.g. epoch_latest) committed as copies of this one once it is durable —
        hard links locally, server-side copies remotely — instead of a second save of the same state.
        """
        if not TAG.fullmatch(tag):
            raise ValueError(f"checkpoint tag {tag!r}: use letters, digits, _ and -")
        self._finish_previous()
        start = time.perf_counter()
        handle = (
            self.layout.stage(self._partial(tag)) if not self.layout.writes_while_staging else self._stage_in_place(tag)
        )
        self._staging = handle if isinstance(handle, Future) else None
        self._staging_wait = 0.0
        # Captured now, in the loop's thread (the RNG and the data position move with the next batch).
        own = {name: p.state_dict() for name, p in self._per_rank.items()}
        rank_bytes = rank_file_bytes(own) if own else None
        record = None
        if self.world.is_main:
            record = record_bytes({name: p.state_dict() for name, p in self._record.items()})
        blocked = time.perf_counter() - start
        job = (tag, list(aliases), handle, rank_bytes, record, int(step), int(epoch), start, blocked)
        self.last_saved_step = int(step)
        if self.mode == "off" or blocking:
            self._staging = None
            self._report(self._write_and_commit(*job), raise_permanent=True)
        else:
            logger.info(f"checkpoint {tag}: saving in the background (the loop paused {blocked:.3f} s)")
            self._pending = self._save_thread.submit(self._write_and_commit, *job)
            self.pending_tag = tag
        return self.location(tag)

    def wait_staged(self) -> None:
        """Call before anything changes parameters or optimizer state (the optimizer step): returns once the
        save in flight has its own copy of them. Usually immediate: the copy ran during forward/backward."""
        if self._staging is None:
            return
        start = time.perf_counter()
        try:
            self._staging.result()
        except Exception:  # noqa: BLE001 — the save reports its own failure
            pass
        self._staging_wait += time.perf_counter() - start
        self._staging = None

    def location(self, tag: str) -> str:
        return self.remote.url(tag) if self.remote is not None else os.path.join(self.directory, tag)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last save has committed (or failed); the log says which. With a timeout (the final
        and the preemption save: --checkpoint-upload-timeout), a save still unfinished by then is given up:
        it never commits, the last committed checkpoint stays latest, and the run can end."""
        if self._pending is not None and not self._pending.done():
            bound = f" (at most {timeout:.0f} s)" if timeout is not None else ""
            logger.info(f"waiting for checkpoint {self.pending_tag} to be written and committed{bound} ...")
            try:
                self._pending.result(timeout=timeout)
            except FutureTimeout:
                self._give_up(timeout)
                return
            except Exception:  # noqa: BLE001 — reported by _finish_previous
                pass
        self._finish_previous()

    def abandon(self) -> None:
        """Stop waiting for the save in flight (it never commits) and let the process exit without its threads."""
        self._pending = None
        self.abandoned = True
        ABANDONED.set()

    def _give_up(self, timeout: float) -> None:
        tag = self.pending_tag
        self.abandon()
        error = f"checkpoint {tag}: unfinished after {timeout:.0f} s"
        self.results.append(SaveResult(tag or "?", self.last_saved_step or 0, error=error))
        if self.world.is_main:
            logger.warning(
                f"checkpoint {tag} was NOT committed: the store did not finish it within {timeout:.0f} s "
                f"(--checkpoint-upload-timeout); it is given up and the last committed checkpoint stays latest"
            )

    def close(self) -> None:
        if self.abandoned:  # its threads are stuck in a store's socket: leave them (the process exits without them)
            self._save_thread.shutdown(wait=False, cancel_futures=True)
            self._io.shutdown(wait=False, cancel_futures=True)
            return
        self.wait()
        self._save_thread.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.layout.close()

    def _finish_previous(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        result = pending.result()
        self.wait_staged()
        result.blocked_s += self._staging_wait
        self._staging_wait = 0.0
        self._report(result, raise_permanent=True)

    def _report(self, result: SaveResult, raise_permanent: bool) -> None:
        self.results.append(result)
        if result.error is None:
            return
        if result.permanent and raise_permanent:
            raise UserError(result.error)
        if self.world.is_main:
            logger.warning(
                f"checkpoint {result.tag} was NOT committed: {result.error}; training continues "
                f"and the next save tries again"
            )

    def _partial(self, tag: str) -> str:
        return partial_dir(self.directory, tag)

    def _write_consolidated(self, tag: str, step: int, epoch: int) -> dict[str, dict]:
        """Rank 0, save thread, once every rank's files are written: the whole model's weights, read back from
        them in this one process (as `bigclip export` reads a checkpoint), saved in OpenCLIP's checkpoint form
        ({"state_dict", "epoch", "step"}) as one more file of the checkpoint, hashed and uploaded like the rest.
        Training goes on meanwhile; the host holds the model once in float32 until the file is written."""
        partial = self._partial(tag)
        state = self.consolidated_names(self.layout.read_model_state(partial))
        path = os.path.join(partial, CONSOLIDATED)
        torch.save({"state_dict": {k: v.contiguous() for k, v in state.items()}, "epoch": epoch, "step": step}, path)
        del state
        sink = FileSink(partial, self.remote.child(tag) if self.remote is not None else None, self._io)
        sink.submit(path)
        return sink.wait()

    def _stage_in_place(self, tag: str):
        # Layouts that write files while staging (DeepSpeed) need the clean .partial directory first.
        raise_together(self.world, lambda: self._prepare_or_explain(tag))
        return self.layout.stage(self._partial(tag))

    def _prepare_or_explain(self, tag: str) -> None:
        try:
            self._prepare(tag)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 — a full disk, a read-only folder: every rank stops with it
            raise UserError(f"checkpoint {tag}: cannot prepare {self._partial(tag)} ({first_line(e)})") from None

    def _prepare(self, tag: str) -> None:
        """Rank 0, before any rank writes: a clean .partial directory, and an existing checkpoint of the
        same name (epoch_latest) uncommitted first, so it is never half old, half new behind a manifest."""
        partial = self._partial(tag)
        shutil.rmtree(partial, ignore_errors=True)  # left over by a crash during an earlier save
        os.makedirs(partial)
        if self.remote is not None and self.remote.exists(f"{tag}/{MANIFEST}"):
            self.remote.rm(f"{tag}/{MANIFEST}")

    def _agree(self, ok: bool) -> bool:
        """All ranks' verdicts, on the checkpoint group (safe from the save thread)."""
        if self.group is None:
            return ok
        flags: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(flags, ok, group=self.group)
        return all(flags)

    def _write_and_commit(self, tag, aliases, handle, rank_bytes, record, step, epoch, start, blocked) -> SaveResult:
        """Save thread (or inline): write, upload, gather, commit. Every rank runs the same collectives."""
        result = SaveResult(tag, step, blocked_s=blocked)
        partial = self._partial(tag)
        sink = FileSink(partial, self.remote.child(tag) if self.remote is not None else None, self._io)
        error: BaseException | None = None
        try:
            if self.world.is_main and not self.layout.writes_while_staging:
                self._prepare(tag)
        except BaseException as e:  # noqa: BLE001
            error = e
        if self._agree(error is None):
            try:
                self.layout.write(handle, partial, sink)
                if rank_bytes is not None:
                    write_durably(os.path.join(partial, rank_file(self.world.rank)), rank_bytes)
                    sink.submit(os.path.join(partial, rank_file(self.world.rank)))
                if record is not None:
                    write_durably(os.path.join(partial, TRAIN_STATE), record)
                    sink.submit(os.path.join(partial, TRAIN_STATE))
                files: dict[str, dict] | BaseException = sink.wait()
            except BaseException as e:  # noqa: BLE001
                files = e
        else:
            files = error or RuntimeError("another rank could not prepare the checkpoint directory")

        gathered: list[Any] = [files]
        if self.group is not None:
            gathered = [None] * self.world.world_size if self.world.is_main else None
            dist.gather_object(_picklable(files), gathered, dst=0, group=self.group)

        outcome: dict[str, Any] = {}
        if self.world.is_main:
            outcome = self._commit(tag, aliases, step, epoch, gathered, start)
        if self.group is not None:
            box = [outcome]
            dist.broadcast_object_list(box, src=0, group=self.group)
            outcome = box[0]
        result.__dict__.update(outcome)
        return result

    def _commit(self, tag, aliases, step, epoch, gathered, start) -> dict[str, Any]:
        errors = [g for g in gathered if isinstance(g, BaseException)]
        if errors:
            err = errors[0]
            permanent = isinstance(err, (StorageError, UserError))
            kind = "" if isinstance(err, (StorageError, StorageUnavailable, UserError)) else f"{type(err).__name__}: "
            return {
                "error": f"checkpoint {tag}: {kind}{str(err).splitlines()[0] if str(err) else ''}",
                "permanent": permanent,
            }
        files: dict[str, dict] = {}
        for part in gathered:
            files.update(part)
        try:
            if self.consolidated_names is not None:
                files.update(self._write_consolidated(tag, step, epoch))
            manifest = Manifest(
                tag=tag,
                step=step,
                epoch=epoch,
                engine=self.engine.name,
                layout=self.layout.name,
                world_size=self.world.world_size,
                files=files,
                extra=self.layout.describe(),
            )
            location = self.publisher.publish(tag, manifest)
            for alias in aliases:
                self.publisher.alias(tag, alias, manifest)
            self.publisher.retention(tag)
        except (StorageError, UserError) as e:
            return {"error": str(e), "permanent": True}
        except StorageUnavailable as e:
            return {"error": str(e), "permanent": False}
        except Exception as e:  # noqa: BLE001 — e.g. a full local disk: reported on every rank, never a hang
            return {"error": f"checkpoint {tag}: {type(e).__name__}: {e}", "permanent": isinstance(e, OSError)}
        seconds = time.perf_counter() - start
        logger.info(
            f"checkpoint {tag} committed: {location} ({len(files)} files, {_gb(manifest.total_bytes)}, "
            f"{seconds:.1f} s after the save started)" + (f"; also as {', '.join(aliases)}" if aliases else "")
        )
        return {
            "location": location,
            "files": len(files),
            "bytes": manifest.total_bytes,
            "commit_s": seconds,
            "aliases": list(aliases),
        }

    def _check_remote(self) -> None:
        if self._probe is not None:
            raise_together(self.world, self._probe.check_writable)

    # ------------------------------------------------------------------- finding and loading (ckpt/catalog.py)
    def latest(self) -> str | None:
        """The committed checkpoint with the highest step, local or remote. Collective."""
        return self.catalog.latest()

    def resume(self, spec: str | None) -> tuple[str, Manifest] | None:
        """Load `spec` ('latest', a local path or a URL) into the engine and every participant; returns
        (location, its manifest) or None."""
        return self.catalog.resume(spec)

    def load(self, location: str) -> Manifest:
        """Verify `location` against its manifest, restore the engine and every participant; the manifest."""
        return self.catalog.load(location)


def _picklable(value: Any) -> Any:
    if isinstance(value, BaseException):
        try:
            pickle.dumps(value)
            return value
        except Exception:  # noqa: BLE001
            return RuntimeError(f"{type(value).__name__}: {value}")
    return value
