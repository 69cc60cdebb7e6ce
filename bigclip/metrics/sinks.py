"""MetricSinks: every record a run writes goes to metrics.jsonl (one JSON object a line) and to the trackers
--report-to names. Only active ranks (rank 0, or the first rank of every node with --log-local) write."""

from __future__ import annotations

import json
import time
from typing import Any

from bigclip.metrics.trackers import REPORT_TARGETS, ReportConfig, Tracker, report_targets
from bigclip.run.folder import RunPaths


class MetricSinks:
    """metrics.jsonl always; the trackers --report-to names (tensorboard, wandb). Only active ranks write."""

    def __init__(
        self,
        cfg: ReportConfig,
        paths: RunPaths,
        active: bool,
        config_dict: dict[str, Any],
        argv: list[str] | None = None,
    ):
        """`argv`: the command line as trackers may record it (secrets scrubbed); wandb stores sys.argv."""
        self.active = active
        self._jsonl = None
        self._trackers: list[Tracker] = []
        if not active:
            return
        self._jsonl = open(paths.metrics, "a", buffering=1)
        for name in report_targets(cfg.report_to):
            self._trackers.append(REPORT_TARGETS.get(name)(cfg, paths, config_dict, argv))

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        record = {"time": round(time.time(), 3), **record}
        self._jsonl.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        for tracker in self._trackers:
            tracker.log(scalars, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for tracker in self._trackers:
            tracker.close()
