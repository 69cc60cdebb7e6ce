"""Engine state for DeepSpeed: DeepSpeed's own ZeRO checkpoint files, written and uploaded in the background.

`ds.save_checkpoint(dir, tag)` is DeepSpeed's save: collective on the training group, every rank producing
its optimizer partitions (and at ZeRO-3 its parameter partitions). It must run on the main thread, but its
file writes go through a checkpoint engine, and bigclip installs one that only collects each file's state
dict (deepspeed_staging.py). Their tensors are copied into reused host buffers on a staging thread while the
next forward/backward runs (the loop waits for it before the optimizer step), and torch.save of the copies,
hashing, fsync, upload and the commit run on the save thread like every other engine's (a thread:
torch.save's tensor writes release the GIL, and a process would need another copy).

Each rank submits exactly the files DeepSpeed handed its checkpoint engine (`zero_pp_rank_{r}_…` on rank r,
mp_rank_00_model_states.pt on rank 0), and rank 0 DeepSpeed's companion zero_to_fp32.py beside them.

Loading at another world size goes through DeepSpeed's universal checkpoint: the ZeRO files are converted
(deepspeed.checkpoint.ds_to_universal) and loaded with `load_universal`.

Each sharded checkpoint participant (ckpt/participants.py) is written by each rank as <name>/rank_{r}.pt, its
state_dict() copied on the staging thread with DeepSpeed's tensors; on load it gets every saved rank's state
({"ranks": [...]}), so it can reshard to any world size. The moving average (--ema-decay) is one: ema/rank_{r}.pt,
its fragments of the fp32 masters (ckpt/fragments.py).
"""

from __future__ import annotations

import os
import shutil
import socket
from argparse import Namespace
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from bigclip.ckpt.fragments import assemble, participant_file, read_saved
from bigclip.ckpt.layout import CheckpointLayout, FileSubmitter, buffers_copied_now
from bigclip.ckpt.participants import absent
from bigclip.dist import raise_together
from bigclip.errors import UserError, first_line

ENGINE_DIR = "engine_state"
_DS_TOP_LEVEL = ("latest", "zero_to_fp32.py")
# DeepSpeed reads its files with torch.load(weights_only=False), and so does its universal converter and
# zero_to_fp32. A checkpoint may come from a bucket others can write, so before any of them runs, every .pt
# file is scanned (torch's get_unsafe_globals_in_checkpoint reads the pickle without running it): beyond what
# weights_only=True allows, only these DeepSpeed bookkeeping classes may appear.
DEEPSPEED_GLOBALS = frozenset(
    (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    )
)


def refuse_unsafe_files(directory: str) -> None:
    """UserError when a .pt file under `directory` names a global outside weights_only's set and the
    DeepSpeed classes above (that is, when loading it could run code)."""
    for root, _, files in os.walk(directory):
        for name in sorted(f for f in files if f.endswith(".pt")):
            path = os.path.join(root, name)
            try:
                unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - DEEPSPEED_GLOBALS
            except Exception as e:  # noqa: BLE001 — not a torch zip file at all
                problem = f"{name} is not a torch file ({first_line(e)}); not loaded"
                raise UserError(f"checkpoint {directory}: {problem}") from None
            if unsafe:
                raise UserError(
                    f"checkpoint {directory}: {os.path.relpath(path, directory)} names {sorted(unsafe)[0]}, which a "
                    f"DeepSpeed checkpoint never holds (loading it could run code); not loaded"
                )


class DeepSpeedLayout(CheckpointLayout):
    name = "deepspeed"
    writes_while_staging = True

    def __init__(self, ds, world, group, participants=None):
        """ds: the deepspeed.DeepSpeedEngine. Its checkpoint engine is replaced by one that stages instead of
        writing (DeepSpeed's own still reads); the files are then written by the save thread. participants: name
        -> the sharded checkpoint participants (the moving average of the partitions)."""
        from bigclip.ckpt.deepspeed_staging import StagingCheckpointEngine

        self.ds = ds
        self.participants = dict(participants or {})
        self.world = world
        self.group = group
        self.stager = StagingCheckpointEngine(ds.checkpoint_engine)
        ds.checkpoint_engine = self.stager
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="bigclip-stage")

    def stage(self, directory: str) -> Future:
        """Collective: DeepSpeed hands this rank's files for directory/engine_state/ to the stager (its small
        companions, `latest` and zero_to_fp32.py, are written right away); their tensors are copied on the
        staging thread. The returned future holds the copies; wait for it before the next optimizer step."""
        self.ds.save_checkpoint(directory, tag=ENGINE_DIR, save_latest=False)
        files, participants = self.stager.take(), self.participants
        files = [(path, buffers_copied_now(state, self.ds.module)) for path, state in files]

        def copy() -> list:
            copies = self.stager.copy(files)
            # (the EMA changes only at the next optimizer step, which waits for this copy)
            for name, participant in participants.items():
                path = participant_file(directory, name, self.world.rank)
                copies.append((path, _host_copy(participant.state_dict())))
            return copies

        return self._copier.submit(copy)

    def write(self, handle: Future, directory: str, sink: FileSubmitter) -> None:
        for path, state in handle.result():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, path)  # FileSink fsyncs it before it counts as durable
            sink.submit(path)
        # Never a directory listing: other ranks' files (RNG files included) are renamed into place while
        # this runs, and a listing once picked one up half-written.
        if self.world.is_main:  # DeepSpeed's own companions of the tag folder
            for name in _DS_TOP_LEVEL:
                if os.path.isfile(os.path.join(directory, name)):
                    sink.submit(os.path.join(directory, name))

    def describe(self) -> dict:
        """What a resuming run must match, recorded in the manifest."""
        return {"zero_stage": int(self.ds.zero_optimization_stage())}

    def load(self, directory: str, saved_world_size: int = 0, saved_extra: dict | None = None) -> None:
        refuse_unsafe_files(directory)
        stage, saved_stage = self.describe()["zero_stage"], (saved_extra or {}).get("zero_stage")
        if saved_stage is not None and saved_stage != stage:
            raise UserError(
                f"checkpoint {directory}: saved with DeepSpeed ZeRO stage {saved_stage}, this run uses "
                f"stage {stage}; resume with a --ds_config of stage {saved_stage}, or `bigclip export` "
                f"it and start from the weights with --pretrained"
            )
        try:
            if saved_world_size and saved_world_size != self.world.world_size:
                self._load_universal(directory, saved_world_size)
            else:
                self._load_same_world(directory)
            for name, participant in self.participants.items():
                self._load_participant(directory, name, participant)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 — DeepSpeed's loaders fail with bare asserts and KeyErrors
            raise UserError(
                f"checkpoint {directory}: DeepSpeed could not load it into this run "
                f"({first_line(e)}); resume "
                f"with the DeepSpeed config (ZeRO stage, precision) it was saved with"
            ) from None

    def _load_participant(self, directory: str, name: str, participant) -> None:
        saved = read_saved(directory, name)
        if saved:
            participant.load_state_dict({"ranks": saved})
        else:
            absent(name, participant, directory, log=self.world.is_main)

    def _load_same_world(self, directory: str) -> None:
        path, _ = self.ds.load_checkpoint(
            directory, tag=ENGINE_DIR, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise UserError(
                f"checkpoint {directory}: no DeepSpeed state '{ENGINE_DIR}' inside; resume with the engine and "
                f"DeepSpeed config the run was saved with"
            )

    def _load_universal(self, directory: str, saved_world_size: int) -> None:
        """ZeRO files are partitioned for the world size that wrote them: convert to DeepSpeed's universal
        format (rank 0, once), then load that at this world size."""
        universal = os.path.join(directory, ENGINE_DIR + "_universal")

        def convert() -> None:
            # One converter per node (a downloaded checkpoint is a per-node copy); on a shared file system the
            # nodes race, so each converts into its own temporary folder and the first rename wins.
            if os.path.isdir(universal):
                return
            scratch = f"{universal}.tmp-{socket.gethostname()}-{os.getpid()}"
            try:
                _convert_to_universal(os.path.join(directory, ENGINE_DIR), scratch)
                try:
                    os.rename(scratch, universal)
                except OSError:  # another node's conversion got there first
                    shutil.rmtree(scratch, ignore_errors=True)
            except Exception as e:  # noqa: BLE001 — DeepSpeed's converter raises assorted types
                shutil.rmtree(scratch, ignore_errors=True)
                raise UserError(
                    f"checkpoint {directory}: saved by {saved_world_size} DeepSpeed ranks, and converting it for "
                    f"{self.world.world_size} failed ({first_line(e)}); resume with {saved_world_size} "
                    f"processes"
                ) from None

        raise_together(self.world, convert, runs_here=self.world.local_rank == 0)
        ds = self.ds
        # Two repairs after DeepSpeed 0.19's ZeRO-3 universal load (found by the resharded-resume test):
        # it copies the first param group's hyperparameters onto every group, so the decay group would resume
        # with the no-decay group's weight_decay 0 (the resumed run's own groups, from its config, are put
        # back; the lr is set by bigclip's schedule every step anyway); and it hands every group the *same*
        # `step` tensor, which AdamW then increments once per group per step, skewing bias correction.
        groups = [{k: v for k, v in g.items() if k != "params"} for g in _base_optimizer(ds).param_groups]
        ds._config.load_universal_checkpoint = True
        try:
            path, _ = ds.load_checkpoint(
                directory, tag=ENGINE_DIR + "_universal", load_optimizer_states=True, load_lr_scheduler_states=False
            )
        finally:
            ds._config.load_universal_checkpoint = False
        optimizer = _base_optimizer(ds)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
        for state in optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        if path is None:
            raise UserError(f"checkpoint {directory}: DeepSpeed could not load the converted state")

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    @staticmethod
    def read_model_state(directory: str, ema: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 model weights of a DeepSpeed checkpoint, in one process (DeepSpeed's zero_to_fp32)."""
        refuse_unsafe_files(directory)
        if ema:
            saved = read_saved(directory)
            if not saved:
                raise UserError(
                    f"checkpoint {directory}: holds no moving average of the weights (train with --ema-decay)"
                )
            return assemble(saved)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(directory, tag=ENGINE_DIR))


def _host_copy(state):
    """A copy of a nested state whose tensors live in host memory and share nothing with the originals."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _host_copy(v) for k, v in state.items()}
    return state


def _base_optimizer(ds):
    """The torch optimizer under DeepSpeed's ZeRO wrapper."""
    return getattr(ds.optimizer, "optimizer", ds.optimizer)


def _convert_to_universal(src: str, dst: str) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    ds_to_universal(
        Namespace(
            input_folder=src,
            output_folder=dst,
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
    )
