"""The Checkpointer: what the training loop asks of checkpoints, by name.

    checkpointer.resume(state)             before training: restore the engine and every participant, if asked
    checkpointer.wait_for_staging()        right before each optimizer step: a save in flight has its copy
    checkpointer.after_step(state) -> stop after each step: save when due; True when the run must stop (SIGTERM)
    checkpointer.after_epoch(state)        at each epoch's end: the epoch checkpoint, when due
    checkpointer.finish()                  wait for the last save to commit, copy the logs a last time

Built from its slice of the config (CheckpointConfig): where checkpoints go (local <logs>/<name>/checkpoints,
and with --remote-sync also <remote>/<name>/checkpoints), the cadence (--save-frequency epochs,
--save-every-n-steps, --save-every-minutes), SIGTERM handling, retention (--delete-previous-checkpoint,
--keep-last-k) and the periodic copy of logs (--remote-sync-frequency).

Participants besides the engine's model and optimizer are handed to it at construction, by name, as torchtitan
hands `Stateful` objects to its checkpointer (the run's: train.py's `_participants`): each says by its
`checkpoint_kind` whether it is sharded with the engine's state, one per rank or one record for the run, and
the manager saves and restores each by name without knowing what it is (ckpt/participants.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch.distributed.checkpoint.stateful import Stateful

from bigclip.ckpt.cadence import SaveCadence
from bigclip.ckpt.config import CheckpointConfig
from bigclip.ckpt.manager import CheckpointManager
from bigclip.ckpt.remote_sync import RemoteSync
from bigclip.ckpt.storage import Storage, is_url, join, redact_url
from bigclip.preemption import NOTICE, StoppedAfterTraining
from bigclip.train_state import TrainState

logger = logging.getLogger("bigclip")


def remote_run_root(cfg: CheckpointConfig, name: str) -> str | None:
    """Where the run's checkpoints and the copy of its logs go besides the local run folder: <--remote-sync>/<name>,
    or <--logs>/<name> when --logs is a URL; None for a run kept on local disk only."""
    if cfg.remote_sync:
        return join(cfg.remote_sync, name)
    return join(cfg.logs, name) if is_url(cfg.logs) else None


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointConfig,
        paths,
        name: str,
        engine,
        world,
        participants: Mapping[str, Stateful],
        consolidated_names=None,
    ):
        """participants: name -> Stateful with a checkpoint_kind (ckpt/participants.py), saved and restored
        beside the engine's model and optimizer. consolidated_names: parameter name -> OpenCLIP's name, for the
        consolidated weights that --fsdp-checkpoint full adds to each checkpoint."""
        self.cfg = cfg
        self.world = world
        self.remote_root = remote_run_root(cfg, name)
        options = cfg.options()
        self.manager = CheckpointManager(
            paths.checkpoints,
            engine,
            world,
            cfg.delete_previous_checkpoint,
            participants=participants,
            remote=join(self.remote_root, "checkpoints") if self.remote_root else None,
            storage_options=options,
            keep_last_k=cfg.keep_last_k,
            async_mode=cfg.checkpoint_async,
            storage_timeout=cfg.storage_timeout,
            upload_timeout=cfg.checkpoint_upload_timeout,
            consolidated_names=consolidated_names if cfg.fsdp_checkpoint == "full" else None,
        )
        self.cadence = SaveCadence(cfg, world)
        self.preemption = NOTICE
        self.preemption.install()
        self.sync = None
        self._stopped_at: int | None = None  # the step after which SIGTERM stopped the run
        self._owed = False  # a save fell due while the previous one was in flight: take it when that finishes
        self.skipped = 0  # due saves not taken at their step (ckpt/skipped in metrics.jsonl)
        if self.remote_root and world.is_main:
            self.sync = RemoteSync(
                paths.root, Storage(self.remote_root, options, cfg.checkpoint_upload_timeout), cfg.remote_sync_frequency
            )
            self.sync.sync_once()  # params.yaml and the log so far, before any training
            self.sync.start()
        self._where = paths.checkpoints + (f" and {redact_url(self.manager.remote.root)}" if self.remote_root else "")

    # -- resume
    def resume(self, state: TrainState) -> None:
        """--resume: restore the engine and every participant from the checkpoint it names; `state` (the train
        state, one of them) then says where the run is."""
        spec = self.cfg.resume
        found = self.manager.resume(spec)
        if spec == "latest" and found is None:
            logger.info(f"--resume latest: no committed checkpoint in {self._where}; starting fresh")
        if found is None:
            return
        location, _ = found
        where = f"epoch {state.epoch}" + (f" (+{state.batches_in_epoch} batches)" if state.batches_in_epoch else "")
        logger.info(f"resumed from {redact_url(location)} at {where}, step {state.step}")

    # -- saving
    def wait_for_staging(self) -> None:
        """Right before anything changes the state (the optimizer step, --eval-ema's swap): a save in flight must
        hold its own copy of it first."""
        self.manager.wait_staged()

    def after_step(self, state: TrainState, end_of_epoch: bool) -> bool:
        """After every optimizer step (collective): save a step/minute/SIGTERM checkpoint when one is due.
        Returns True when the run must stop now (SIGTERM on any rank); its final checkpoint is then on its
        way, and finish() waits for it."""
        save, stop = self.cadence.after_step(state.step, self.preemption.requested)
        if save and not stop and end_of_epoch and self.cadence.epoch_due(state.epoch + 1):
            save = False  # the epoch-end checkpoint, a moment later, covers this step
        due = save and self.manager.last_saved_step != state.step
        if stop:
            if due:
                self._save_final(f"step_{state.step}", state, self._aliases())
            self._stopped_at = state.step
        elif due or self._owed:
            self._save_unless_busy(state, due, f"step_{state.step}")
        return stop

    def after_epoch(self, state: TrainState) -> None:
        """After an epoch has finished (state.epoch is the number of completed epochs)."""
        tags = [f"epoch_{state.epoch}"] if self.cadence.epoch_due(state.epoch) else []
        if self.cfg.save_most_recent:
            tags.append("epoch_latest")
        final = state.epoch >= self.cfg.epochs
        if final and not tags and self._owed:
            tags = [f"step_{state.step}"]  # the run's end: a save deferred during the last epoch is taken now
        if not tags:
            return
        if final:
            self.preemption.training_over()  # a notice from now on ends the waits for the last save at once
            self._save_final(tags[0], state, tags[1:])
        else:
            self._save_unless_busy(state, True, tags[0], tags[1:])

    def _save_unless_busy(self, state: TrainState, due: bool, tag: str, aliases: list[str] | None = None) -> None:
        """Training never waits on storage: a save that falls due while the previous one is still being written
        or uploaded (on any rank) is deferred to the first step after that one has finished — several due
        meanwhile become one — and counted (ckpt/skipped). Collective."""
        if self.manager.busy():
            if due:
                self.skipped += 1
                if not self._owed and self.world.is_main:
                    logger.warning(
                        f"checkpoint {tag} deferred: checkpoint {self.manager.pending_tag} is still being written or "
                        f"uploaded; training goes on and the checkpoint is taken at the first step after it finishes"
                    )
                self._owed = True
            return
        if self._owed:
            tag = f"step_{state.step}"  # named by the state it holds, whatever fell due meanwhile
            if self.world.is_main:
                logger.info(f"checkpoint {tag}: the deferred save, now that the previous one has finished")
        self._owed = False
        self._save(tag, state, aliases if aliases is not None else self._aliases())

    def _save_final(self, tag: str, state: TrainState, aliases: list[str]) -> None:
        """The final and the preemption save: these may wait for the save before them, for at most
        --checkpoint-upload-timeout (then that one is given up, and this one is not tried: the store is not
        answering)."""
        self._wait_for_last_save()
        if self.manager.abandoned:
            logger.warning(f"checkpoint {tag} not attempted: the store did not finish the previous checkpoint")
            return
        self._save(tag, state, aliases)

    def _aliases(self) -> list[str]:
        return ["epoch_latest"] if self.cfg.save_most_recent else []

    def _save(self, tag: str, state: TrainState, aliases: list[str]) -> None:
        self.manager.save(tag, state.step, state.epoch, aliases=aliases)
        self.cadence.saved()

    def metrics(self) -> dict[str, int]:
        """What the step records report about checkpoints (once there is something to report)."""
        return {"ckpt/skipped": self.skipped} if self.skipped else {}

    # -- the end
    def finish(self, before_last_copy: Callable[[], None] | None = None) -> None:
        """Wait for the last checkpoint to commit, call `before_last_copy` (files written then are in the last
        copy of the logs), copy the logs one last time, restore SIGTERM."""
        self.preemption.training_over()  # (unless a notice stopped training) a notice now ends the waits below
        try:
            self._wait_for_last_save()
            if before_last_copy is not None:
                before_last_copy()
            last = self.manager.results[-1] if self.manager.results else None
            if self._stopped_at is not None:
                committed = (
                    f"checkpoint {last.tag} committed"
                    if last and last.error is None
                    else "no checkpoint could be committed"
                )
                notice = self.preemption.signal_name or "a preemption notice"
                logger.info(
                    f"stopped by {notice} at step {self._stopped_at}: {committed}; continue with "
                    f"--resume latest --name <this run>"
                )
            if self.sync is not None:
                with self.preemption.cuts_short():
                    self.sync.stop(self.cfg.checkpoint_upload_timeout)
                self.sync = None
        except StoppedAfterTraining:
            self.manager.abandon()  # close() then skips the waits too
            raise
        finally:
            self.preemption.restore()

    def _wait_for_last_save(self) -> None:
        """At most --checkpoint-upload-timeout; after the last step a preemption notice ends it at once (the
        save then never commits)."""
        try:
            with self.preemption.cuts_short():
                self.manager.wait(timeout=self.cfg.checkpoint_upload_timeout)
        except StoppedAfterTraining:
            self.manager.abandon()
            raise

    def close(self) -> None:
        """Release threads and buffers. After finish() there is nothing left to wait for; on the error path
        a pending save is still waited for (it may commit), but its failure must not hide the real error."""
        self.preemption.restore()
        try:
            if self.sync is not None:  # after an abandoned save the store is not answering: no last pass
                self.sync.stop(0.1 if self.manager.abandoned else self.cfg.checkpoint_upload_timeout)
                self.sync = None
            self.manager.close()
        except Exception as e:  # noqa: BLE001
            logger.warning(f"checkpoint shutdown: {e}")
