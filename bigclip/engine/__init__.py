"""Engines and the order in which parallelism is applied to a finished model.

    1. freeze locked towers         (--lock-image / --lock-text: requires_grad off before any wrapping)
    2. activation checkpointing     (per transformer block, inside the towers' block loop)
    3. compile per block            (--torchcompile: each block compiled in place, names unchanged)
    4. wrap / shard by the engine   (DDP; FSDP2: fully_shard per block, then the root; DeepSpeed ZeRO 0-3)
    5. materialise and initialise   (engines that build on the meta device)

Step 0 comes before all of these: `build_model` asks the engine where the model is built. DDP and ZeRO-0/1/2
take a real, initialised model; FSDP2 and ZeRO-3 take a meta model when it is large (--sharded-init auto:
500M+ parameters) and initialise it shard by shard in step 5 (engine/sharded_init.py), so no rank ever
holds the whole of a ViT-bigG-14.

Each step is a small function; the model code itself never mentions an engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from bigclip.dist import World
from bigclip.engine import in_backward
from bigclip.engine.base import NO_BATCHNORM, Engine, has_batchnorm
from bigclip.engine.config import DEFAULT_ENGINE, ENGINES, SHARDED_INIT_MODES, EngineConfig
from bigclip.engine.ddp import DDPEngine
from bigclip.engine.deepspeed import DeepSpeedEngine
from bigclip.engine.fsdp import FSDPEngine
from bigclip.errors import UserError
from bigclip.flag_fields import idle
from bigclip.memory import add_setup_source
from bigclip.optim import optimizer_kind
from bigclip.precision import resolve_precision

# --engine NAME -> the Engine class. To add an engine: a subclass in its own file (its flags, rules, memory
# setups), and one line here.
for _cls in (DDPEngine, FSDPEngine, DeepSpeedEngine):
    ENGINES.register(_cls.name, _cls, help=_cls.help)
# bigclip.memory lists the registered engines' memory setups (bigclip plan's rows, --dry-run's)
add_setup_source(lambda: {setup: memory for _, cls in ENGINES.items() for setup, memory in cls.memory_setups().items()})


def engine_selected_by(flags: dict[str, Any]) -> tuple[str, str] | None:
    """(engine, the flag that picks it) when a flag other than --engine names an engine (DeepSpeed's launch
    lines pass --ds_config or --deepspeed); None otherwise."""
    for name, cls in ENGINES.items():
        for flag in cls.selected_by:
            if flags.get(flag):
                return name, flag
    return None


def engine_flag_classes() -> dict[str, type]:
    """Each engine's own flags (its Flags dataclass), in registry order: composed into the flags and --help
    (config/flags.py) and sliced for EngineConfig.given_engine_flags (config/sections.py)."""
    return {name: cls.Flags for name, cls in ENGINES.items()}


def refuse_other_engines_flags(cfg: EngineConfig) -> None:
    """The one rule for every engine: a flag of an engine other than the run's, set to anything but its default,
    is refused in one line naming it and its engine (it would do nothing)."""
    for name, given in cfg.given_engine_flags.items():
        if name == cfg.engine:
            continue
        for f in dataclasses.fields(given):
            if getattr(given, f.name) != f.default:
                raise UserError(
                    f"--{f.name.replace('_', '-')}: only applies to --engine {name} (the engine is {cfg.engine}); "
                    "drop the flag or choose that engine"
                )


def check_config(cfg: EngineConfig) -> EngineConfig:
    """Flag validation's engine part: the chosen engine exists, no other engine's flag is set, and the chosen
    engine checks its flags. Returns the config completed with what the chosen engine resolved (`resolved`);
    `cfg` itself is left as it was."""
    chosen = ENGINES.get(cfg.engine)
    if cfg.sharded_init not in SHARDED_INIT_MODES:
        raise UserError(f"--sharded-init {cfg.sharded_init!r}: choose one of {', '.join(SHARDED_INIT_MODES)}")
    refuse_other_engines_flags(cfg)
    resolved = chosen.check_config(cfg)
    in_backward.check_config(cfg)
    _check_bf16_rounding(cfg)
    if cfg.torchcompile_backend and cfg.torchcompile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UserError(
            f"--torchcompile-backend {cfg.torchcompile_backend}: torch.compile has no such backend; choose one of "
            f"{', '.join(torch._dynamo.list_backends())}"
        )
    if cfg.torchcompile_mode:
        try:  # torch checks the mode when the wrapper is made; nothing is compiled before the first call
            torch.compile(lambda x: x, backend=cfg.torchcompile_backend or "inductor", mode=cfg.torchcompile_mode)
        except RuntimeError as e:
            raise UserError(f"--torchcompile-mode {cfg.torchcompile_mode}: {e}") from None
    return dataclasses.replace(cfg, resolved=resolved)


def _check_bf16_rounding(cfg: EngineConfig) -> None:
    """--bf16-round-to-nearest acts where the optimizer itself rounds its updates into bf16 weights (the engine
    stores the weights in --precision's dtype; an engine keeping float32 masters refuses the flag itself)."""
    if not cfg.optimizer.bf16_round_to_nearest:
        return
    if not optimizer_kind(cfg.optimizer).rounds_bf16_stochastically:
        raise UserError(
            f"--bf16-round-to-nearest: --opt {cfg.optimizer.opt} always rounds to nearest; drop the flag (adamw, "
            f"stableadamw and adamw8bit round stochastically without it)"
        )
    weights = resolve_precision(cfg.precision, torch.device(cfg.device_type())).param_dtype
    if weights != torch.bfloat16:
        raise UserError(
            f"--bf16-round-to-nearest: only applies with bf16 weights (--precision pure_bf16), and --precision "
            f"{cfg.precision} keeps {str(weights).removeprefix('torch.')} weights; drop the flag"
        )


def build_model(cfg: EngineConfig, world: World, factory) -> nn.Module:
    """Step 0: the engine decides whether the model is built whole or on meta (see above)."""
    return ENGINES.get(cfg.engine).build_model(cfg, world, factory)


def describe_plan(cfg: EngineConfig, world: World, num_params: int) -> tuple[str, str]:
    """For --dry-run: (this run's memory setup, see memory_model; one line on how the engine lays the run out)."""
    return ENGINES.get(cfg.engine).describe_plan(cfg, world, num_params)


def state_ranks(cfg: EngineConfig, world: World) -> int:
    """For --dry-run: over how many ranks one copy of the training state is spread (HSDP: a replica group's)."""
    return ENGINES.get(cfg.engine).state_ranks(cfg, world)


def frozen_bytes(cfg: EngineConfig, world: World, num_params: int) -> float:
    """For --dry-run: bytes per GPU of a forward-only module's weights (a distillation teacher) as the engine
    places it."""
    return ENGINES.get(cfg.engine).frozen_bytes(cfg, world, num_params)


def memory_notes() -> list[str]:
    """What every engine says under `bigclip plan`'s table about reading its rows."""
    return [note for _, cls in ENGINES.items() for note in cls.memory_notes()]


def apply_locks(model: nn.Module, cfg: EngineConfig) -> None:
    if cfg.lock_image_freeze_bn_stats and not has_batchnorm(model):
        idle("lock_image_freeze_bn_stats", NO_BATCHNORM["lock_image_freeze_bn_stats"])
    if cfg.lock_image:
        model.lock_image_tower(cfg.lock_image_unlocked_groups, cfg.lock_image_freeze_bn_stats)
    if cfg.lock_text:
        model.lock_text_tower(cfg.lock_text_unlocked_layers, cfg.lock_text_freeze_layer_norm)


def batchnorm_flags_set(cfg: EngineConfig) -> list[str]:
    """The BatchNorm flags this run sets (field names): idle on a model without BatchNorm."""
    given = {"use_bn_sync": getattr(cfg.engine_flags, "use_bn_sync", False)}  # (DDP's own flag)
    given["lock_image_freeze_bn_stats"] = cfg.lock_image_freeze_bn_stats
    return [name for name, on in given.items() if on]


def say_idle_batchnorm_flags(cfg: EngineConfig, model: nn.Module) -> None:
    """For --dry-run, which builds nothing to train: the BatchNorm flags the built model would make idle, said as
    where it is built (`model`: the architecture, e.g. on the meta device)."""
    if not has_batchnorm(model):
        for name in batchnorm_flags_set(cfg):
            idle(name, NO_BATCHNORM[name])


def apply_activation_checkpointing(model: nn.Module, cfg: EngineConfig) -> None:
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True, every=cfg.grad_checkpointing_every)


def apply_compile(model: nn.Module, cfg: EngineConfig) -> None:
    # Per block rather than whole-model: compile time stays flat in depth, parameter names stay the
    # same (checkpoints and sharding see the usual names), and a graph break stays local to one block.
    # The block's forward is compiled, not its __call__: the engines' per-block hooks (FSDP2's all-gather,
    # ZeRO-3's parameter fetch) stay outside the graph, so their changing state fails no guard (under ZeRO-3
    # compiling __call__ recompiled every block on every call).
    if cfg.torchcompile:
        options = {"backend": cfg.torchcompile_backend or "inductor", "mode": cfg.torchcompile_mode}
        for block in model.transformer_blocks():
            block.forward = torch.compile(block.forward, **options)


def build_engine(cfg: EngineConfig, model: nn.Module, world: World) -> Engine:
    apply_locks(model, cfg)
    apply_activation_checkpointing(model, cfg)
    apply_compile(model, cfg)
    return ENGINES.get(cfg.engine)(cfg, model, world)


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "Engine",
    "EngineConfig",
    "DDPEngine",
    "FSDPEngine",
    "DeepSpeedEngine",
    "build_engine",
    "describe_plan",
    "frozen_bytes",
    "build_model",
    "check_config",
    "engine_flag_classes",
    "engine_selected_by",
    "memory_notes",
]
