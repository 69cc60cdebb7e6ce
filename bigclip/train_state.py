"""TrainState: where a run is, as one object that a checkpoint saves and a resume restores.

Everything the loop advances lives here, so "save" and "resume" mean the same set of values everywhere. It is a
checkpoint participant of the record kind (ckpt/participants.py): the checkpoint's train_state.json holds these
fields under "train_state" (beside the resolved config, for the record). What is per rank (the data position,
the RNG) is no field here: those are participants of their own, in each rank's file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    checkpoint_kind = "record"  # one for the run, in train_state.json (ckpt/participants.py); not a field

    step: int = 0  # optimizer steps taken (skipped non-finite steps count: the schedule moved on)
    epoch: int = 0  # the epoch in progress, or the next to start once one has finished
    samples_seen: int = 0  # over all ranks
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed per rank; a resume skips them
    nonfinite_streak: int = 0  # consecutive steps skipped for a non-finite loss (the run stops at a limit)
    nonfinite_steps: int = 0  # steps skipped for a non-finite loss in the whole run

    def advance(self, samples: int, accum_freq: int) -> None:
        """One optimizer step (taken or skipped) of `samples` samples over all ranks."""
        self.step += 1
        self.samples_seen += samples
        self.batches_in_epoch += accum_freq

    def finish_epoch(self) -> None:
        self.epoch += 1
        self.batches_in_epoch = 0

    # torch.distributed.checkpoint's Stateful protocol: how the checkpoint manager saves and restores it
    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, record: dict[str, Any]) -> None:
        restored = self.from_record(record)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(restored, f.name))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TrainState:
        """The state of a saved record; fields a record does not have (an older checkpoint) keep their
        defaults, keys that are not fields are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})
