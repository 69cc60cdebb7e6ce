"""TrainConfig: every flag in one flat, frozen dataclass: the user interface (command line, --config YAML,
params.yaml). Names are OpenCLIP's argument names (``--batch-size`` -> ``batch_size``) with OpenCLIP's defaults,
so a user's launch line carries over unchanged.

Each flag is declared once, by the config slice of the component that owns it (bigclip/flag_fields.py says
how: help, --help group, choices, value check): DataConfig in data/config.py, EngineConfig in engine/config.py,
and so on, with RunFlags below for the run's own flags. TrainConfig is their union, in --help's group order;
``cli_args.py`` builds the parser from it. Components never see it: they take their slice from ``cfg.sections``
(config/sections.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bigclip.ckpt.config import CheckpointConfig
from bigclip.config.sections import build_sections
from bigclip.data import DataConfig
from bigclip.dist import DistConfig
from bigclip.engine import EngineConfig, engine_flag_classes
from bigclip.evaluation.config import EvalConfig
from bigclip.flag_fields import DIST, GROUPS, LOG, MISC, TRAIN, flag, internal, is_flag, unsupported
from bigclip.loop import LoopConfig
from bigclip.loss import LossConfig
from bigclip.metrics.trackers import ReportConfig
from bigclip.model.config import ModelConfig
from bigclip.optim import OptimizerConfig
from bigclip.schedule import ScheduleConfig


@dataclass(frozen=True)
class RunFlags:
    """The run's own flags (no component reads them), and OpenCLIP's flags bigclip refuses by name."""

    torchscript: bool = unsupported(False, "TorchScript the model.", TRAIN, "use --torchcompile")
    trace: bool = unsupported(False, "Trace the model (inference).", TRAIN, "use --torchcompile")
    name: str | None = flag(None, "Run name (default: date, model, lr, batch size, precision).", LOG)
    debug: bool = flag(False, "Debug logging; an error also prints its traceback above its one line.", LOG)
    log_local: bool = flag(False, "Log from the first process of every node, not only rank 0.", LOG)
    copy_codebase: bool = flag(False, "Copy the bigclip package into the run directory.", LOG)
    horovod: bool = unsupported(False, "Horovod.", DIST, "use torchrun, deepspeed or srun")
    dry_run: bool = flag(
        False,
        "Join the process group, print the world (one line per node), the engine plan and the memory plan, "
        "and exit without building the model or training.",
        DIST,
    )
    config: str | None = flag(None, "YAML file of option values (flags given on the command line win).", MISC)

    # Set by resolution, not by users.
    demo: bool = internal(False)
    # the flags the user set (YAML or command line), by field name: only those can be idle (flag_fields.idle)
    given: tuple[str, ...] = internal(())


# OpenCLIP main's flag families for models bigclip does not train, refused by name in one line (argparse alone
# would only say "unrecognized arguments"). A name ending in "-" is a prefix.
REFUSED_FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("--use-naflex", "--force-naflex-vision", "--naflex-", "--length-bucketing", "--bucket-")
        + ("--text-pad-multiple",),
        "NaFlex (variable image resolution and text length) is not supported: bigclip trains fixed-size towers "
        "(--force-image-size sets the image size); drop the flag",
    ),
    (
        ("--audio-", "--pretrained-audio"),
        "audio towers (CLAP) are not supported: bigclip trains image-text models; drop the flag",
    ),
)


def refused_family(flag: str) -> str | None:
    """Why `flag` (--name, as typed) is refused, if it belongs to a family bigclip does not train."""
    name = flag.split("=", 1)[0]
    for names, why in REFUSED_FAMILIES:
        if any(name == n or (n.endswith("-") and name.startswith(n)) for n in names):
            return f"{name}: {why}"
    return None


# Every slice that owns flags. Each flag has exactly one owner (tests/test_contracts.py).
OWNERS = (
    DataConfig,
    ModelConfig,
    LoopConfig,
    ScheduleConfig,
    OptimizerConfig,
    EngineConfig,
    *engine_flag_classes().values(),  # each engine's own flags (engine/ddp.py, fsdp.py, deepspeed.py)
    LossConfig,
    CheckpointConfig,
    ReportConfig,
    EvalConfig,
    DistConfig,
    RunFlags,
)


def _owned_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) of every flag its owner declares, in --help's group order, then the internal ones."""
    owned = [f for owner in OWNERS for f in dataclasses.fields(owner) if is_flag(f) or f.metadata.get("internal")]
    owned.sort(key=lambda f: GROUPS.index(f.metadata["group"]) if is_flag(f) else len(GROUPS))
    out = []
    for f in owned:
        default = {"default": f.default} if f.default_factory is dataclasses.MISSING else {}
        factory = {} if default else {"default_factory": f.default_factory}
        out.append((f.name, f.type, dataclasses.field(**default, **factory, metadata=f.metadata)))
    return out


def _sections(cfg):
    """The typed slices of these flags that components take (config/sections.py), built and checked once."""
    return build_sections(cfg)


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    _owned_fields(),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "Every flag, flat: the union of the slices' own flags (see this module's docstring).",
        "sections": cached_property(_sections),
    },
)


# The embedded demo: what `python launch/train.py` with no data flags runs. These replace defaults only;
# anything the user sets (YAML or flags) still wins. Tuned so a 2-core CPU finishes in well under 3 minutes.
DEMO_PRESET: dict[str, Any] = {
    "model": "test-tiny",
    "batch_size": 64,
    "epochs": 24,
    "lr": 3e-3,
    "warmup": 100,
    "wd": 0.1,
    "precision": "fp32",
    "log_every_n_steps": 20,
    "zeroshot_frequency": 6,
    "val_frequency": 6,
    "save_frequency": 6,
}


def config_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("internal")]
