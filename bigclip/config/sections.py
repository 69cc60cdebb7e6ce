"""The typed slices of the flat flags that components take, built once per config and checked on the way.

Each component defines the dataclass of what it reads, next to its code (DataConfig in data/config.py,
EngineConfig in engine/config.py, ...), with fields named as the flags they come from; `slice_of` copies those
flags across, and each component's check runs on its own slice. What one component decides for another is
passed here and nowhere else: the loss family's starting logit scale and bias go to the model, the optimizer's
slice to the engine, the chosen engine's resolved settings (DeepSpeed's JSON) into the engine's slice.

Building the sections is flag validation: resolve() builds them once (TrainConfig.sections caches them), so
every rule runs before any work, and nothing is written back onto the flags. It has no side effects: an hf-hub:
model's config is read from the hub cache only; where the cache does not hold it yet, what needs it is checked and
decided where the model is built, once it is fetched (build.py's run_sections, with `recheck_model` here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from bigclip.ckpt.config import CheckpointConfig, check_checkpoint
from bigclip.data import DataConfig, check_data, check_source
from bigclip.dist import DistConfig, check_dist, run_device_type
from bigclip.engine import EngineConfig, engine_flag_classes
from bigclip.engine import check_config as check_engine_config
from bigclip.evaluation.config import EvalConfig, check_eval
from bigclip.flag_fields import idle_where_inapplicable, noting_idle_flags
from bigclip.loop import LoopConfig
from bigclip.loss import LossConfig, check_loss, loss_family
from bigclip.metrics.trackers import ReportConfig, report_targets
from bigclip.model.config import ModelConfig, captions, check_model
from bigclip.model.registry import config_at_hand
from bigclip.optim import OptimizerConfig, check_optimizer
from bigclip.schedule import ScheduleConfig, check_schedule

T = TypeVar("T")


@dataclass(frozen=True)
class Sections:
    model: ModelConfig
    data: DataConfig
    loss: LossConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    engine: EngineConfig
    checkpoint: CheckpointConfig
    report: ReportConfig
    eval: EvalConfig
    loop: LoopConfig
    dist: DistConfig
    # one line per OpenCLIP flag set where it does nothing (flag_fields.idle): the run says them at its start
    idle_notes: tuple[str, ...] = ()


def slice_of(flags: Any, cls: type[T], **decided: Any) -> T:
    """An instance of the slice dataclass `cls` with each field copied from the flag of the same name; fields
    given in `decided` are set by the run, not by a flag of that name."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in decided]
    return cls(**{name: getattr(flags, name) for name in names}, **decided)


def build_sections(flags: Any) -> Sections:
    """Every component's slice of `flags` (a TrainConfig), each checked by the component that owns it, in the
    order a user reads the flags: the model first, the data, the training, then where state goes. The flags set
    where they do nothing are refused or, OpenCLIP's, noted for the run to say (flag_fields.idle)."""
    with noting_idle_flags() as notes:
        idle_where_inapplicable(flags, set(flags.given))
        sections = _build_sections(flags)
    return dataclasses.replace(sections, idle_notes=tuple(notes))


def _build_sections(flags: Any) -> Sections:
    model_flags = slice_of(flags, ModelConfig, init={}, device_type=run_device_type(flags.device))
    check_model(model_flags)
    schedule = slice_of(flags, ScheduleConfig)
    check_schedule(schedule)
    data = slice_of(flags, DataConfig)
    check_source(data)
    optimizer = slice_of(flags, OptimizerConfig)
    check_optimizer(optimizer)
    report = slice_of(flags, ReportConfig)
    report_targets(report.report_to)
    dist = slice_of(flags, DistConfig)
    check_dist(dist)
    given_engine_flags = {name: slice_of(flags, own) for name, own in engine_flag_classes().items()}
    engine = check_engine_config(
        slice_of(flags, EngineConfig, optimizer=optimizer, resolved=None, given_engine_flags=given_engine_flags)
    )
    loss = slice_of(flags, LossConfig, captioning=_captioning(model_flags), device_type=model_flags.device_type)
    check_loss(loss)
    check_data(data)
    checkpoint = slice_of(flags, CheckpointConfig)
    check_checkpoint(checkpoint)
    evaluation = slice_of(flags, EvalConfig)
    check_eval(evaluation)
    return Sections(
        model=dataclasses.replace(model_flags, init=loss_family(loss).model_init),
        data=data,
        loss=loss,
        optimizer=optimizer,
        schedule=schedule,
        engine=engine,
        checkpoint=checkpoint,
        report=report,
        eval=evaluation,
        loop=slice_of(flags, LoopConfig),
        dist=dist,
    )


def _captioning(model: ModelConfig) -> bool | None:
    """Whether --model captions (CoCa), so the loss adds a caption term: from its config where it is at hand
    without fetching; None where it is not (an hf-hub: config the hub cache lacks decides it where the model is
    built, recheck_model)."""
    if not config_at_hand(model.model, model.cache_dir):
        return None
    return captions(model, local_files_only=True)


def recheck_model(sections: Sections) -> Sections:
    """`sections` once the hf-hub: configs of --model and --distill-model are in the hub cache (fetched where the
    model is built, build.py): the model flags' checks, and what the model decides for the loss (whether it
    captions), made again on configs validation may not have had, and the loss flags checked with that."""
    with noting_idle_flags() as notes:
        check_model(sections.model)
        loss = dataclasses.replace(sections.loss, captioning=_captioning(sections.model))
        check_loss(loss)
    return dataclasses.replace(sections, loss=loss, idle_notes=tuple(dict.fromkeys((*sections.idle_notes, *notes))))
