"""TrainState: where a run is, as one object that a checkpoint saves and a resume restores.

Everything the loop advances lives here, so "save" and "resume" mean the same set of values everywhere:
the checkpoint's train_state.json holds these fields (plus the resolved config, for the record).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped non-finite steps count: the schedule moved on)
    epoch: int = 0  # the epoch in progress, or the next to start once one has finished
    samples_seen: int = 0  # over all ranks
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed per rank; a resume skips them
    nonfinite_streak: int = 0  # consecutive steps skipped for a non-finite loss (the run stops at a limit)
    nonfinite_steps: int = 0  # steps skipped for a non-finite loss in the whole run
    # This rank's data position (its loader's workers: shard, offset, shuffle buffer), if the source has one.
    # Per rank, so it is saved in the rank's own checkpoint file, not in train_state.json.
    data: dict[str, Any] = field(default_factory=dict)

    def advance(self, samples: int, accum_freq: int) -> None:
        """One optimizer step (taken or skipped) of `samples` samples over all ranks."""
        self.step += 1
        self.samples_seen += samples
        self.batches_in_epoch += accum_freq

    def finish_epoch(self) -> None:
        self.epoch += 1
        self.batches_in_epoch = 0

    def to_record(self) -> dict[str, Any]:
        """The fields train_state.json holds: all but the per-rank data position."""
        record = dataclasses.asdict(self)
        del record["data"]
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TrainState:
        """The state of a train_state.json; fields a record does not have (an older checkpoint) keep their
        defaults, keys that are not fields (the config) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})
