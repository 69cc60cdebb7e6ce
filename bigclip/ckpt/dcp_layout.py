"""Engine state for DDP and FSDP: torch.distributed.checkpoint (DCP), sharded by rank, reshardable on load.

What each rank writes:
  FSDP  its own DTensor shards (get_state_dict returns them; DCP writes local shards only).
  DDP   every rank holds the same state, so the leaves (parameters, Adam moments, …) are split between the
        ranks by size before staging: each rank copies and writes only its 1/N. DCP's planner would also
        de-duplicate, but only after every rank had copied everything — splitting first cuts the time the
        loop is blocked by N.
Either way the checkpoint holds each tensor once and `.metadata` says where, so it loads at any world size.

The save is split in two so the loop is blocked only by the first part:
  stage(): copy this rank's state into host buffers that are allocated on the first save and reused by every
           later one (DCP's DefaultStager caches them by storage; pinned on CUDA, shared memory when a writer
           process needs them).
  write(): in the background, DCP plans (collectives on the checkpoint's own gloo group, never the training
           group: async saves on the default group crash gloo; the plans are cached from one save to the next,
           _CachedPlanner) and writes files into a local directory. With
           the thread writer each file is handed to the FileSink the moment it is closed, so uploads overlap
           with writing; the process writer (a daemon process, DCP's executor) hands files over when done.
"""

from __future__ import annotations

import itertools
import os
import queue
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from bigclip.ckpt.dcp_safe_read import SafeFileSystemReader, SafeLoadPlanner, first_failure
from bigclip.ckpt.layout import CheckpointLayout, FileSubmitter, buffers_copied_now
from bigclip.ckpt.participants import absent
from bigclip.ckpt.upload import BACKGROUND_NICE
from bigclip.errors import UserError, first_line
from bigclip.staged_values import HostPool, staging_into

FILE_TARGET_BYTES = 128 * 2**20  # files per rank ~ bytes / this: small enough to pipeline uploads
MAX_FILES_PER_RANK = 16
METADATA = ".metadata"


@contextmanager
def _quiet_single_process():
    # DCP warns on every single-process save/load that it assumes one process; that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """FQN-keyed model and optimizer state (DTensor shards under FSDP) plus the grad scaler and the sharded
    checkpoint participants (`extra`: name -> Stateful, e.g. the EMA; ckpt/participants.py)."""
    # get_state_dict initialises an optimizer that has not stepped yet (a fresh one about to load) with a step of
    # zero gradients, so the state to fill has its entries, but only while no parameter holds a gradient: an
    # engine that keeps zeroed gradients (DDP's bucket views) would otherwise load no optimizer state at all.
    held = {p: p.grad for p in model.parameters() if p.grad is not None}
    for p in held:
        p.grad = None
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    finally:
        for p, grad in held.items():
            p.grad = grad
    # Optimizers that are several (one per parameter, stepped in the backward) save as the one they stand for.
    optim_sd = getattr(optimizer, "saved_state_dict", lambda sd: sd)(optim_sd)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    for name, participant in (extra or {}).items():
        state[name] = participant.state_dict()
    return state


def _leaves(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.extend(_leaves(value, prefix + (key,)))
        else:
            out.append((prefix + (key,), value))
    return out


def split_replicated(state: dict, rank: int, world_size: int) -> dict:
    """This rank's share of a replicated state tree: leaves dealt out largest-first to the lightest rank.

    Deterministic (same keys and sizes on every rank), so the shares are disjoint and cover everything.
    """
    if world_size == 1:
        return state
    leaves = _leaves(state)
    sizes = [v.numel() * v.element_size() if hasattr(v, "element_size") else 0 for _, v in leaves]  # placeholders too
    load = [0] * world_size
    owner = {}
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], str(leaves[i][0]))):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += max(sizes[i], 1)
    mine: dict = {}
    for i, (path, value) in enumerate(leaves):
        if owner[i] != rank:
            continue
        node = mine
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return mine


class _NotifyingFileSystem(FileSystem):
    """DCP's local filesystem, calling on_file(path) as soon as a file is complete (fsynced and closed)."""

    def __init__(self, on_file: Callable[[str], None]):
        self.on_file = on_file

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield stream
        if "w" in mode and not str(path).endswith(".tmp"):
            self.on_file(str(path))

    def rename(self, path, new_path) -> None:  # .metadata is written as .metadata.tmp, then renamed
        super().rename(path, new_path)
        self.on_file(str(new_path))


class _ChunkedWriter(FileSystemWriter):
    """FileSystemWriter that splits a rank's data into several files (~FILE_TARGET_BYTES each) written one
    after another, so the first can be uploading while the next is written."""

    def write_data(self, plan, planner):
        try:
            from torch.distributed.checkpoint.filesystem import _item_size, _split_by_size_and_type
            from torch.distributed.checkpoint.planner import WriteItemType
        except ImportError:  # private helpers moved: fall back to DCP's own split
            return super().write_data(plan, planner)
        total = sum(_item_size(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
        files = max(1, min(MAX_FILES_PER_RANK, -(-total // FILE_TARGET_BYTES)))
        file_queue: queue.Queue = queue.Queue()
        for n, bucket in enumerate(_split_by_size_and_type(files, plan.items)):
            if not bucket:
                continue
            name = f"{plan.storage_data.prefix}{n}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, file_queue)


class _NotifyingWriter(_ChunkedWriter):
    def __init__(self, path: str, on_file: Callable[[str], None]):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.fs = _NotifyingFileSystem(on_file)


_plan_keys = itertools.count()


class _CachedPlanner(DefaultSavePlanner):
    """DCP's save planner with its plan caching on: from the second save of a layout, a rank whose plan is
    unchanged sends an empty one and the coordinator reuses the last global plan and metadata, so the planning
    collectives carry almost nothing (what they gather grows with ranks x tensors: the cost at scale).

    Two guards around DCP's cache. It is keyed here per layout (DCP keys it by the planner's class name, which
    every layout of a process would share). And a rank whose tensors changed dtype sends its plan again: DCP's
    plan comparison looks at names, offsets and sizes only, so it would reuse metadata naming the old dtypes;
    a plan sent makes the coordinator merge it and build the metadata afresh. (Only the rank's own plan is
    forgotten: the coordinator's global plan must stay for the ranks that send empty ones.)"""

    def __init__(self, key: str):
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        dtypes = {k: v.dtype for k, v in self.state_dict.items() if isinstance(v, torch.Tensor)}
        if _PLAN_DTYPES.get(self._cached_plans_key) != dtypes:
            SavePlanner._cached_save_plan.pop(self._cached_plans_key, None)
            _PLAN_DTYPES[self._cached_plans_key] = dtypes


_PLAN_DTYPES: dict[str, dict] = {}  # per layout key: the dtypes of the tensors its cached plan was made for
_PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)


def forget_plans(key: str) -> None:
    """Drop what DCP cached for one layout's saves (its cache is class-level: it outlives the layout)."""
    for name in _PLAN_CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)
    _PLAN_DTYPES.pop(key, None)


def _after_queued_work(staging_stream) -> None:
    """Make the stager's stream wait for the work queued on this thread's stream so far (the last optimizer
    step's kernels may still be running): DCP's DefaultStager copies on a stream of its own, created without
    implicit synchronisation with the training stream, and waits for nothing before it copies."""
    if staging_stream is None:
        return
    queued = torch.Event()
    queued.record()
    staging_stream.wait_event(queued)


class _AlreadyStaged:
    """An AsyncStager for dcp.async_save that passes through a dict stage() already copied."""

    should_synchronize_after_execute = False

    def stage(self, state_dict, **_):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class DCPLayout(CheckpointLayout):
    name = "dcp"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler,
        world,
        group,
        mode: str = "thread",
        replicated: bool = True,
        participants: dict[str, Any] | None = None,
    ):
        """replicated: every rank holds the whole state (DDP), so ranks split the writing; False: each rank
        holds its own shards (FSDP2's DTensors). participants: the sharded checkpoint participants, saved beside
        the model under their names (name -> Stateful; their tensors are the load's template, filled in place,
        and one a checkpoint lacks starts afresh: ckpt/participants.py)."""
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.extra = dict(participants or {})
        taken = set(self.extra) & {"model", "optimizer", "scaler"}
        if taken:
            raise ValueError(f"checkpoint participant {sorted(taken)[0]!r}: the name of the engine's own state")
        self.world = world
        self.group = group
        # The process writer needs a process group to hand to its daemon; a single process uses the thread.
        self.mode = "thread" if (mode == "process" and group is None) else mode
        self.replicated = replicated
        # Staging copies in a background thread (a side stream on CUDA): the loop goes on with the next
        # forward and backward, which do not change parameters or optimizer state, and waits for the copy
        # only before the next optimizer step (CheckpointManager.wait_staged).
        self._stager = self._new_stager()
        # Values made while they are staged (8-bit AdamW's float32 moments): their host buffers, kept between saves
        self._made_when_staged = HostPool(pinned=torch.cuda.is_available(), shared=self.mode == "process")
        self._reniced = False
        self._plan_key = f"bigclip-dcp-{next(_plan_keys)}"  # DCP's plan cache, this layout's entry

    def _new_stager(self) -> DefaultStager:
        cuda = torch.cuda.is_available()
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=self.mode == "process",
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )

    def _usable_stager(self) -> DefaultStager:
        """The stager, replaced when the torch release closed it after its last stage. Some releases (2.11 on the
        GPU kit's machine) close the inner StateDictStager after every stage, which empties its copy table (and
        its cached buffers): the next stage then fails on the first dict ("KeyError: <class 'type'>"), so every
        save after the first was lost. A fresh stager per save is what those releases allow."""
        inner = getattr(self._stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self._stager.close()
            self._stager = self._new_stager()
        return self._stager

    # -- saving
    def stage(self, directory: str) -> Future:
        """This rank's share of the state (collected here, in the loop's thread), copied into the reused host
        buffers in the background: a future of the staged dict."""
        with staging_into(self._made_when_staged):
            state = training_state(self.model, self.optimizer, self.scaler, self.extra)
        state["model"] = buffers_copied_now(state["model"], self.model)
        if self.replicated:
            state = split_replicated(state, self.world.rank, self.world.world_size)
        stager = self._usable_stager()
        _after_queued_work(getattr(stager, "_staging_stream", None))
        staged = stager.stage(state)
        if not isinstance(staged, Future):
            done: Future = Future()
            done.set_result(staged)
            staged = done
        return staged

    def write(self, staging: Future, directory: str, sink: FileSubmitter) -> None:
        """Background: write this rank's files into `directory`, handing each finished file to `sink`."""
        staged = staging.result()
        os.makedirs(directory, exist_ok=True)
        pg = self.group
        if self.mode == "process":
            response = dcp.async_save(
                staged,
                storage_writer=_ChunkedWriter(directory, thread_count=1),
                process_group=pg,
                planner=_CachedPlanner(self._plan_key),
                async_stager=_AlreadyStaged(),
                async_checkpointer_type=dcp.state_dict_saver.AsyncCheckpointerType.PROCESS,
            )
            future: Future = response.upload_completion if hasattr(response, "upload_completion") else response
            future.result()
            self._renice_writer_process()
            mine = f"__{self.world.rank}_"
            for name in sorted(os.listdir(directory)):
                if name.startswith(mine) or (name == METADATA and self.world.rank == 0):
                    sink.submit(os.path.join(directory, name))
            return
        with _quiet_single_process():
            dcp.save(
                staged,
                storage_writer=_NotifyingWriter(directory, sink.submit),
                planner=_CachedPlanner(self._plan_key),
                process_group=pg,
                no_dist=pg is None,
            )

    def _renice_writer_process(self) -> None:
        # DCP's daemon writer process: same reasoning as the checkpoint threads (upload.lower_priority).
        if self._reniced:
            return
        self._reniced = True
        try:
            from torch.distributed.checkpoint import _async_process_executor as executor

            os.setpriority(os.PRIO_PROCESS, executor._CHECKPOINT_PROCESS._save_process.pid, BACKGROUND_NICE)
        except (ImportError, AttributeError, OSError):
            pass

    # -- loading
    # describe(): nothing beyond the name; DCP state loads into DDP and FSDP alike, at any world size.

    def load(self, directory: str, saved_world_size: int = 0, saved_extra: dict | None = None) -> None:
        # The structure to fill (optimizer state is initialised for it); DCP reshards into it. A participant the
        # checkpoint does not hold (an EMA added on resume) starts afresh, after the weights are loaded.
        saved = SafeFileSystemReader(directory).read_metadata().state_dict_metadata if self.extra else {}
        held = {name: p for name, p in self.extra.items() if any(k.startswith(f"{name}.") for k in saved)}
        state = training_state(self.model, self.optimizer, self.scaler, held)
        try:
            with _quiet_single_process():
                dcp.load(
                    state,
                    storage_reader=SafeFileSystemReader(directory),
                    planner=SafeLoadPlanner(),
                    process_group=self.group,
                    no_dist=self.group is None,
                )
            optim_sd = getattr(self.optimizer, "loadable_state_dict", lambda sd: sd)(state["optimizer"])
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)
        except (Exception, CheckpointException) as wrapped:  # DCP wraps each rank's failure (a BaseException)
            e = first_failure(wrapped)
            if isinstance(e, UserError):
                raise UserError(f"checkpoint {directory}: {e}") from None
            raise UserError(
                f"checkpoint {directory}: does not fit this model/optimizer ({first_line(e)}); resume with the "
                f"flags (--model, --engine, optimizer) the run was started with"
            ) from None
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        for name, participant in self.extra.items():
            if name in held:
                participant.load_state_dict(state[name])
            else:
                absent(name, participant, directory, log=self.world.is_main)

    def close(self) -> None:
        self._stager.close()
        self._made_when_staged.close()
        forget_plans(self._plan_key)  # this process's; the process writer's daemon ends with its plans

    @staticmethod
    def read_model_state(directory: str, ema: bool = False) -> dict[str, torch.Tensor]:
        """The full model weights of a DCP checkpoint (with `ema`: their moving average, parameters and
        buffers), in one process, without the training world size."""
        reader = SafeFileSystemReader(directory)
        metadata = reader.read_metadata()
        prefixes = ("ema.params.", "ema.buffers.") if ema else ("model.",)
        flat = {
            key: torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith(prefixes) and isinstance(md, TensorStorageMetadata)
        }
        if not flat:
            what = "moving average of the weights (train with --ema-decay)" if ema else "model tensors"
            raise UserError(f"checkpoint {directory}: holds no {what}")
        try:
            with _quiet_single_process():
                dcp.load(flat, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as wrapped:
            raise UserError(f"checkpoint {directory}: {first_line(first_failure(wrapped))}") from None
        return {key[len(next(p for p in prefixes if key.startswith(p))) :]: value for key, value in flat.items()}
