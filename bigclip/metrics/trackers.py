"""Where metrics go besides metrics.jsonl: the trackers --report-to names (REPORT_TARGETS), each imported only
when asked for, and what they are told (ReportConfig)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bigclip.errors import UserError
from bigclip.flag_fields import LOG, Applies, flag
from bigclip.registry import Registry
from bigclip.run.folder import RunPaths


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


# --report-to NAME -> (config, run paths, the run's config as a dict, argv as trackers may record it) -> tracker.
# Each tracker is imported only when asked for: each takes seconds to import.
REPORT_TARGETS: Registry[Callable[[ReportConfig, RunPaths, dict, list[str] | None], Tracker]] = Registry(
    "--report-to", unknown=lambda names: f"use {', '.join(names)} or {','.join(names)}"
)


WITH_WANDB = Applies(lambda c: "wandb" in c.report_to.split(","), "with --report-to wandb")


@dataclass(frozen=True)
class ReportConfig:
    """Where metrics go besides metrics.jsonl (--report-to) and what the trackers are told."""

    report_to: str = flag(
        "", "Trackers besides metrics.jsonl, comma-separated (tensorboard,wandb).", LOG, shows=REPORT_TARGETS
    )
    wandb_project_name: str = flag("open-clip", "wandb project.", LOG, applies=WITH_WANDB)
    wandb_notes: str = flag("", "wandb notes.", LOG, applies=WITH_WANDB)
    no_run_report: bool = flag(
        False,
        "Do not draw logs/<name>/report.html and .png (the run's plots, see `bigclip report`) at each epoch's end "
        "and at the end.",
        LOG,
    )


def _scalar_name(key: str) -> str:
    return key if "/" in key else f"train/{key}"


class _TensorBoard:
    def __init__(self, cfg: ReportConfig, paths: RunPaths, config_dict: dict, argv: list[str] | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(paths.tensorboard)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(_scalar_name(k), v, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, cfg: ReportConfig, paths: RunPaths, config_dict: dict, argv: list[str] | None):
        import wandb

        real_argv = sys.argv
        sys.argv = [real_argv[0], *argv] if argv is not None else real_argv
        try:  # wandb records sys.argv in its run files: it must see the scrubbed one
            self.run = wandb.init(
                project=cfg.wandb_project_name,
                name=os.path.basename(paths.root),
                notes=cfg.wandb_notes,
                dir=paths.root,
                config=config_dict,
            )
        finally:
            sys.argv = real_argv

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({_scalar_name(k): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


REPORT_TARGETS.register("tensorboard", _TensorBoard, help="event files in <run>/tensorboard")
REPORT_TARGETS.register("wandb", _Wandb, help="a Weights & Biases run")


def report_targets(value: str) -> list[str]:
    """The tracker names of a --report-to value (comma-separated); an unknown one is a UserError."""
    names = [t for t in value.split(",") if t]
    for name in names:
        if name not in REPORT_TARGETS:
            raise UserError(f"--report-to {value!r}: {REPORT_TARGETS.advice()}")
    return names
