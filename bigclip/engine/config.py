"""EngineConfig: the slice of the flags engines read, and what an engine's memory model is given.

Engines own how the model is wrapped, sharded, optimised and saved; these are the flags that decide it: the ones
every engine honours (locks, precision, checkpointing, compile, EMA), the run's values an engine must agree with
(batch sizes, clipping, the optimizer), and each engine's own flags, which the engine declares itself (its
`Flags` dataclass, next to its code) and which reach it as `engine_flags`.
`resolved` holds what the chosen engine's check_config returned at validation (DeepSpeed: its JSON config with
every "auto" the flags decide filled), so the file is read once and validation changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from bigclip.flag_fields import (
    DIST,
    MODEL,
    PREC,
    TRAIN,
    Applies,
    flag,
    non_negative_int,
    non_negative_number,
    optional,
    positive_int,
    unsupported,
)
from bigclip.optim import OptimizerConfig
from bigclip.precision import PRECISIONS
from bigclip.registry import Registry


def open_unit_interval(v) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1
    return None if ok else "must be between 0 and 1 (e.g. 0.9998)"


# Flags that refine another flag act only beside it (flag_fields.Applies): refused alone, not ignored.
WITH_LOCK_IMAGE = Applies(lambda c: c.lock_image, "with --lock-image")
WITH_LOCK_TEXT = Applies(lambda c: c.lock_text, "with --lock-text")
WITH_COMPILE = Applies(lambda c: c.torchcompile, "with --torchcompile")
# torch.compile hands a mode to inductor only; another backend gets it as an argument it ignores
WITH_INDUCTOR = Applies(
    lambda c: c.torchcompile_backend in (None, "inductor"),
    "with torch.compile's inductor backend (the default; other backends ignore the mode)",
    "drop --torchcompile-backend or this flag",
)

DEFAULT_ENGINE = "ddp"  # OpenCLIP's own parallelism
SHARDED_INIT_MODES = ("auto", "always", "never")
# --engine NAME -> the Engine class (engine/base.py). Created here, with the flag that names it; the engines are
# registered in engine/__init__.py.
ENGINES: Registry = Registry("--engine")


@dataclass(frozen=True)
class EngineConfig:
    lock_image: bool = flag(False, "Freeze the image tower.", MODEL)
    lock_image_unlocked_groups: int = flag(
        0, "Leave the last N image layer groups trainable.", MODEL, check=non_negative_int, applies=WITH_LOCK_IMAGE
    )
    lock_image_freeze_bn_stats: bool = flag(
        False,
        "Freeze BatchNorm statistics of locked layers (image towers with BatchNorm: ResNets, some timm trunks).",
        MODEL,
        applies=WITH_LOCK_IMAGE,
    )
    lock_text: bool = flag(False, "Freeze the text tower.", MODEL)
    lock_text_unlocked_layers: int = flag(
        0, "Leave the last N text layers trainable.", MODEL, check=non_negative_int, applies=WITH_LOCK_TEXT
    )
    lock_text_freeze_layer_norm: bool = flag(
        False, "Freeze LayerNorm of locked text layers.", MODEL, applies=WITH_LOCK_TEXT
    )
    grad_clip_norm: float | None = flag(
        None, "Clip the global gradient norm to this value.", TRAIN, check=optional(non_negative_number)
    )
    optimizer_in_backward: bool = flag(
        False,
        "Step each parameter's optimizer inside the backward as soon as its gradient is synchronised, then free "
        "the gradient: the full set of gradients never exists (ddp, fsdp; not with --accum-freq > 1 or "
        "--grad-clip-norm; new in bigclip).",
        TRAIN,
    )
    torchcompile: bool = flag(False, "torch.compile each transformer block.", TRAIN)
    torchcompile_backend: str | None = flag(
        None,
        "With --torchcompile: torch.compile's backend (e.g. inductor, aot_eager; default inductor).",
        TRAIN,
        applies=WITH_COMPILE,
    )
    torchcompile_mode: str | None = flag(
        None,
        "With --torchcompile and the inductor backend: torch.compile's mode (default, reduce-overhead, "
        "max-autotune, ...).",
        TRAIN,
        applies=(WITH_COMPILE, WITH_INDUCTOR),
    )
    torchcompile_strategy: str | None = unsupported(
        None,
        "OpenCLIP main: compile the model, the task or the step.",
        TRAIN,
        "bigclip compiles each transformer block (--torchcompile)",
    )
    precision: str = flag("amp", "Numeric precision.", PREC, choices=PRECISIONS)
    grad_checkpointing: bool = flag(False, "Recompute every transformer block in backward.", PREC)
    grad_checkpointing_every: int = flag(
        1,
        "With --grad-checkpointing, recompute every k-th block only.",
        PREC,
        check=positive_int,
        applies=Applies(lambda c: c.grad_checkpointing, "with --grad-checkpointing"),
    )
    engine: str = flag(
        DEFAULT_ENGINE,
        "Parallelism (new in bigclip); --ds_config FILE or --deepspeed selects deepspeed, --fsdp fsdp. Each "
        "engine's own flags are listed with it and refused under the others.",
        DIST,
        choices=ENGINES,
    )
    sharded_init: str = flag(
        "auto",
        "auto, always or never: build the model on the meta device and initialise it "
        "shard by shard (fsdp, deepspeed ZeRO-3); auto does so from 500M parameters.",
        DIST,
        choices=SHARDED_INIT_MODES,
    )
    ema_decay: float | None = flag(
        None,
        "Keep an exponential moving average of the weights with this decay (e.g. 0.9998), updated after every "
        "step where the weights are (FSDP: each rank's shards), saved in checkpoints; --eval-ema evaluates it, "
        "`bigclip export --ema` exports it (new in bigclip; OpenCLIP main has the API only).",
        TRAIN,
        check=optional(open_unit_interval),
    )
    ema_warmup: bool = flag(
        False,
        "With --ema-decay: timm ModelEmaV3's warm-up, decay_t = min(decay, 1 - (1 + t)^(-2/3)).",
        TRAIN,
        applies=Applies(lambda c: c.ema_decay is not None, "with --ema-decay"),
    )
    # read here, owned by another slice (its flag is declared there)
    device: str = "cuda"
    batch_size: int = 64
    accum_freq: int = 1
    seed: int = 0
    checkpoint_async: str = "auto"  # where checkpoints are written: an engine may write its own way only
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    resolved: Any = None  # the chosen engine's check_config result (DeepSpeed: the resolved JSON)
    # Every engine's own flags as given (engine name -> its Engine.Flags instance): the chosen engine reads its own
    # (engine_flags); the others' are there so one rule can refuse any of them that was set (check_config).
    given_engine_flags: Mapping[str, Any] = field(default_factory=dict)

    @property
    def engine_flags(self) -> Any:
        """The chosen engine's own flags (its Engine.Flags); their defaults when the config was built by hand."""
        given = self.given_engine_flags.get(self.engine)
        return given if given is not None else ENGINES.get(self.engine).Flags()

    def device_type(self) -> str:
        """The device type the run will use, known at flag validation (before the world is set up)."""
        return "cuda" if self.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
