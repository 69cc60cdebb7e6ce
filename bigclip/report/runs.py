"""A run folder (local or any fsspec URL) read for a report: its metrics.jsonl records, its config (params.yaml),
and what out.log says that no record holds (the world size, where it resumed, its checkpoints' pauses and
commits). Only files the run itself writes are read; a killed run's truncated last line is left out."""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import fsspec
import yaml

from bigclip.errors import UserError

_STAMP = "%Y-%m-%d,%H:%M:%S"
_RESUMED = re.compile(r"^(\S+) \| resumed from (\S+) at .*step (\d+)$")
_WORLD = re.compile(r"\| world: (\d+) rank")
_PAUSED = re.compile(r"^(\S+) \| checkpoint (\S+): saving in the background \(the loop paused ([\d.]+) s\)")
_COMMITTED = re.compile(r"^(\S+) \| checkpoint (\S+) committed: .* ([\d.]+) s after the save started\)")
_DEFERRED = re.compile(r"^(\S+) \| checkpoint (\S+) deferred:")


@dataclass
class CheckpointEvent:
    minutes: float  # since the run's first log line
    tag: str
    kind: str  # "paused" (the loop's blocked time), "committed" (seconds from the save to its commit), "deferred"
    seconds: float = 0.0


@dataclass
class Run:
    url: str
    name: str
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    world: int | None = None
    resumed_at_steps: list[int] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)

    def series(self, key: str, x: str = "samples_seen") -> tuple[list[float], list[float]]:
        """(x, y) of every record that has both, in the order written (a resumed run's replayed steps included:
        a plot shows them where they happened)."""
        points = [(r[x], r[key]) for r in self.records if x in r and isinstance(r.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    def has(self, key: str) -> bool:
        return any(isinstance(r.get(key), (int, float)) for r in self.records)

    def keys(self) -> set[str]:
        return {k for r in self.records for k in r}

    def samples_at_step(self, step: int) -> float | None:
        """Samples seen at `step` (the record of that step, or the last one before it)."""
        best = None
        for r in self.records:
            if "samples_seen" in r and r.get("step", 0) <= step:
                best = r["samples_seen"]
        return best


def _read_text(fs, path: str) -> str | None:
    try:
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _records(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a killed run's last line, cut mid-write
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _from_log(run: Run, text: str) -> None:
    first: datetime | None = None

    def minutes(stamp: str) -> float:
        nonlocal first
        when = datetime.strptime(stamp, _STAMP)
        first = first or when
        return (when - first).total_seconds() / 60

    for line in text.splitlines():
        stamp = line.split(" | ", 1)[0]
        try:
            when = minutes(stamp)
        except ValueError:
            continue  # the config dump's lines, tracebacks
        if run.world is None and (m := _WORLD.search(line)):
            run.world = int(m.group(1))
        elif m := _RESUMED.match(line):
            run.resumed_at_steps.append(int(m.group(3)))
        elif m := _PAUSED.match(line):
            run.checkpoints.append(CheckpointEvent(when, m.group(2), "paused", float(m.group(3))))
        elif m := _COMMITTED.match(line):
            run.checkpoints.append(CheckpointEvent(when, m.group(2), "committed", float(m.group(3))))
        elif m := _DEFERRED.match(line):
            run.checkpoints.append(CheckpointEvent(when, m.group(2), "deferred"))


def load_run(url: str, storage_options: dict | None = None) -> Run:
    """The run in folder `url` (logs/<name>, or the same folder under --remote-sync)."""
    url = url.rstrip("/")
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}) if "://" in url else {})
    try:
        metrics = _read_text(fs, posixpath.join(root, "metrics.jsonl"))
    except Exception as e:  # credentials, a missing bucket, no network: one line naming the URL
        raise UserError(f"{url}: cannot read the run's metrics.jsonl ({type(e).__name__}: {e})") from None
    if metrics is None:
        raise UserError(f"{url}: no metrics.jsonl there; name a run folder (logs/<name>)")
    run = Run(url=url, name=posixpath.basename(root), records=_records(metrics))
    params = _read_text(fs, posixpath.join(root, "params.yaml"))
    if params:
        run.config = yaml.safe_load(params) or {}
    log = _read_text(fs, posixpath.join(root, "out.log"))
    if log:
        _from_log(run, log)
    return run
