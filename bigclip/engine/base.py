"""The Engine contract: everything the loop, evaluation and checkpoints may ask of DDP, FSDP2 or DeepSpeed.

An engine is built from (config, model, world). It owns the wrapped model, the optimizer, loss scaling,
gradient synchronisation and the on-disk format of its state. Callers use only:

    Engine.check_config(cfg)               classmethod, at flag validation, of the run's engine: the rules of the
                                           flags it owns; returns what it resolved from them (DeepSpeed: its
                                           JSON), which the EngineConfig then carries as `resolved`
    Engine.build_model(cfg, world, factory)
                                           classmethod, before the engine exists: where the model is built. The
                                           default calls factory() (a real, initialised model); sharding engines
                                           may return factory(device="meta") for giant models and materialise
                                           the shards themselves.
    Engine.describe_plan(cfg, world, num_params)
                                           classmethod, for --dry-run: (the memory setup of memory_setups() this
                                           run is, one line saying how it would be laid out)
    Engine.memory_setups()                 classmethod: setup name -> MemorySetup (bigclip/memory/setups.py):
                                           state bytes per GPU (parameters, gradients, optimizer state) for Ψ
                                           parameters on N ranks, working memory, the flags that select it: what
                                           `bigclip plan` and --dry-run print (DeepSpeed: one setup per ZeRO
                                           stage, and offload)
    Engine.memory_notes()                  classmethod: what `bigclip plan` says under its table about these rows
    Engine.selected_by                     flags that pick this engine without --engine (--ds_config, --deepspeed)
    Engine.Flags                           this engine's own flags: a frozen dataclass of flag() fields, composed
                                           through ENGINES into the flags and --help; the run's engine reads
                                           them as cfg.engine_flags, and one rule (engine/__init__.py's
                                           check_config) refuses any of them given to another engine
    engine.module(images=..., texts=...)   forward (features dict), also for eval; a collective when sharded
    engine.model                           the unwrapped model (named parameters, constraints, logging)
    engine.train() / engine.eval()
    with engine.autocast(): ...            the precision context for forward and loss
    with engine.no_sync(): ...             micro-batches before the last of a step (--accum-freq): the engine
                                           accumulates their gradients where it keeps them (DDP's buckets, unsynced;
                                           FSDP2's shards, reduce-scattered; ZeRO's partitions)
    engine.backward(loss)
    engine.step() -> grad norm             unscale, clip, optimizer step, zero grads (inf/nan: step skipped)
    engine.steps_in_backward               True when backward() already updated the parameters
                                           (--optimizer-in-backward): a checkpoint's staging must be done
                                           before it, not just before step()
    engine.before_updates_in_backward(fn)  such an engine calls fn() once, right before the first update of the
                                           next backward (the forward and the backward up to there run before)
    engine.update_parameter_(p, fix)       after step(): apply an in-place elementwise fix to every copy of p the
                                           engine keeps (the one its optimizer updates and the one the forward
                                           sees); how the model's constraints (CLIP's temperature) are enforced
    engine.zero_grad(), set_lr(lr), get_lr()
    engine.ema                             the moving average of the weights (--ema-decay; engine/ema.py) or
                                           None: the loop updates it after each step, evaluation swaps it in,
                                           the run hands it to its checkpoints as a sharded participant
    engine.checkpoint_layout(group, mode, participants)
                                           the CheckpointLayout (ckpt/layout.py) that saves and loads this
                                           engine's state and the sharded checkpoint participants it is handed
                                           (the EMA): DCP for DDP and FSDP2, DeepSpeed's files for ZeRO
    engine.state_bytes()                   bytes of parameters, gradients and optimizer state on this rank
    engine.name, engine.world, engine.precision
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bigclip import optim
from bigclip.ckpt.dcp_layout import DCPLayout
from bigclip.ckpt.layout import CheckpointLayout
from bigclip.dist import World
from bigclip.engine.config import EngineConfig
from bigclip.engine.ema import WeightsEMA
from bigclip.engine.in_backward import PerParameterOptimizers, StepInBackward
from bigclip.engine.memory import tensor_bytes
from bigclip.engine.sharded_init import is_meta, materialise
from bigclip.errors import UserError
from bigclip.memory import MemorySetup, ModelSize, StateRecipe, WorkingBytes
from bigclip.precision import Precision, resolve_precision

ParameterFix = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class NoEngineFlags:
    """The flags of an engine without flags of its own."""


class Engine(abc.ABC):
    name: str = "base"
    help: str = ""  # --engine's help for this name
    selected_by: tuple[str, ...] = ()  # flags (config field names) that select this engine without --engine
    # The flags only this engine honours (a frozen dataclass of flag() fields): given to another engine they are
    # refused in one line (one rule for every engine, engine/__init__.py's check_config), never silently ignored
    Flags: type = NoEngineFlags

    @classmethod
    def check_config(cls, cfg: EngineConfig) -> object:
        """Raise a UserError for a flag the run cannot honour under this engine (the run's: cfg.engine ==
        cls.name); return what it resolved from the flags for later (None by default)."""
        return None

    @classmethod
    def build_model(cls, cfg: EngineConfig, world: World, factory) -> nn.Module:
        """Build the model for this engine; `factory(**overrides)` is create_model with the run's options."""
        return factory()

    @classmethod
    def describe_plan(cls, cfg: EngineConfig, world: World, num_params: int) -> tuple[str, str]:
        """(this run's setup in memory_setups(), a line describing the layout) without building anything."""
        return cls.name, cls.name

    @classmethod
    def state_ranks(cls, cfg: EngineConfig, world: World) -> int:
        """For --dry-run: over how many ranks one copy of the training state is spread (the N of this engine's
        memory setups); every rank here, fewer where copies are replicated (HSDP)."""
        return world.world_size

    @classmethod
    def frozen_bytes(cls, cfg: EngineConfig, world: World, num_params: int) -> float:
        """Bytes per GPU of the weights of a forward-only module of `num_params` parameters as `frozen()` places it
        (a distillation teacher): here whole, in the weights' dtype."""
        return num_params * resolve_precision(cfg.precision, world.device).param_dtype.itemsize

    @classmethod
    def memory_setups(cls) -> dict[str, MemorySetup]:
        """Setup name -> how this engine keeps the state that way: parameters + gradients + optimizer state per GPU
        in bytes (ZeRO paper arithmetic), its working memory (working_bytes), and the flags that select it.
        bigclip.memory's memory_setups() lists them for every registered engine."""
        return {}

    @classmethod
    def working_bytes(
        cls, setup: str, psi: int, n: int, recipe: StateRecipe, size: ModelSize, device_type: str
    ) -> WorkingBytes:
        """Bytes per GPU beyond the state that the engine's forward/backward and its optimizer step allocate; none
        by default (DeepSpeed stores 16-bit weights and its fused optimizers update in place)."""
        return WorkingBytes()

    @classmethod
    def memory_notes(cls) -> list[str]:
        """Sentences `bigclip plan` prints under its table about reading this engine's rows."""
        return []

    def __init__(self, cfg: EngineConfig, model: nn.Module, world: World):
        self.cfg = cfg
        self.world = world
        self.precision: Precision = resolve_precision(cfg.precision, world.device)

    @property
    def steps_in_backward(self) -> bool:
        return False

    def before_updates_in_backward(self, fn: Callable[[], None]) -> None:
        """fn() once, right before the next backward's first update (engines that step in the backward)."""
        raise NotImplementedError(f"{type(self).__name__} does not update parameters in the backward")

    ema: WeightsEMA | None = None  # --ema-decay: set by engines that keep one

    # -- model access: set by each engine's __init__
    module: nn.Module  # the callable model: forward(images=None, texts=None) -> features dict (maybe wrapped)
    model: nn.Module  # the unwrapped CLIP model

    def frozen(self, module: nn.Module) -> nn.Module:
        """A module the run only runs forward (a distillation teacher: never stepped, never saved), placed as
        this engine places its model; here whole on the device, in the weights' dtype. Eval mode, no gradients.
        A module built on meta (for sharding) gets its weights now."""
        return self._frozen_whole(module, self.precision.param_dtype)

    def _frozen_whole(self, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        """`module` whole on this rank's device in `dtype`, eval mode, no gradients (weights given if on meta)."""
        module.requires_grad_(False)
        if is_meta(module):
            materialise(module, self.world.device, self.cfg.seed, self.world.rank)
        return module.to(device=self.world.device, dtype=dtype).eval()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    # -- precision and accumulation
    def autocast(self):
        return self.precision.autocast(self.world.device)

    def no_sync(self):
        return contextlib.nullcontext()

    # -- optimisation
    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def step(self) -> float:
        """Apply the accumulated gradients. Returns the global grad norm before clipping (inf/nan when the
        step was skipped because gradients were not finite)."""

    @abc.abstractmethod
    def update_parameter_(self, param: nn.Parameter, fix: ParameterFix) -> None:
        """Apply `fix` (in place, elementwise) to every copy of `param` this engine keeps."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None: ...

    @abc.abstractmethod
    def get_lr(self) -> float: ...

    # -- checkpoints and memory
    @abc.abstractmethod
    def checkpoint_layout(self, group, mode: str, participants=None) -> CheckpointLayout:
        """The layout that stages, writes and loads this engine's state. `group`: the checkpoint's own gloo
        group (None in one process); `mode`: the writer asked for (thread or process); `participants`: name ->
        the sharded checkpoint participants (ckpt/participants.py) it saves and reshards beside that state."""

    @abc.abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (see bigclip/engine/memory.py)."""


class TorchOptimizerEngine(Engine):
    """An engine whose optimizer is a plain torch optimizer over the model's own parameters (DDP, FSDP2):
    the parameters are what the optimizer updates, and DCP saves them with the optimizer and grad scaler."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    # True when every rank holds the whole state (DDP): the DCP layout then splits the writing between ranks.
    replicated_state: bool = True

    # Parameters the optimizer updates, for the grad norm and clipping; set by the subclass's __init__.
    _params: list[torch.Tensor]
    # --optimizer-in-backward: the hooks that step each parameter from the backward (engine/in_backward.py)
    _in_backward: StepInBackward | None = None

    def _build_optimizer(self, model: nn.Module, **step_in_backward) -> None:
        """The optimizer over the model's parameter groups: one, or with --optimizer-in-backward one per parameter,
        stepped by hooks (`step_in_backward`: how gradients are made final, see StepInBackward)."""
        groups = optim.param_groups(model, self.cfg.optimizer)
        if self.cfg.optimizer_in_backward:
            self.optimizer = PerParameterOptimizers(self.cfg.optimizer, groups)
            blocks = [list(block.parameters()) for block in model.transformer_blocks()]  # stepped a block at a time
            self._in_backward = StepInBackward(self.optimizer, self.world.device, units=blocks, **step_in_backward)
        else:
            self.optimizer = optim.create_optimizer(self.cfg.optimizer, groups)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.cfg.ema_decay is not None:  # of the parameters as the engine holds them: FSDP2's shards
            self.ema = WeightsEMA(model, self.cfg.ema_decay, self.cfg.ema_warmup, self._release_gathered)

    def _release_gathered(self) -> None:
        """Drop gathered copies of the weights (none here; FSDP2 gathers its shards for a forward)."""

    @property
    def steps_in_backward(self) -> bool:
        return self._in_backward is not None

    def before_updates_in_backward(self, fn: Callable[[], None]) -> None:
        if self._in_backward is None:
            super().before_updates_in_backward(fn)
        self._in_backward.before_first_step = fn

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self._in_backward is not None:
            self._in_backward.finish_backward()

    def step(self) -> float:
        if self._in_backward is not None:
            norm = self._in_backward.take_norm()
            if not math.isfinite(norm):
                raise UserError(
                    f"the gradients were not finite (grad norm {norm}) although the loss was, and "
                    f"--optimizer-in-backward had already applied them; resume from the last checkpoint "
                    f"(--resume latest) with a lower --lr, or without the flag (the ordinary step skips such steps)"
                )
            return norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = clip_and_measure(self._params, self.cfg.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update itself when gradients overflowed
            self.scaler.update()
        elif math.isfinite(norm):
            self.optimizer.step()
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        optim.set_lr(self.optimizer.param_groups, lr)

    def get_lr(self) -> float:
        return optim.base_lr(self.optimizer.param_groups)

    @torch.no_grad()
    def update_parameter_(self, param: nn.Parameter, fix: ParameterFix) -> None:
        fix(param)  # elementwise, so under FSDP2 it applies to each rank's shard as is

    def checkpoint_layout(self, group, mode: str, participants=None) -> CheckpointLayout:
        return DCPLayout(
            self.model, self.optimizer, self.scaler, self.world, group, mode, self.replicated_state, participants
        )

    def state_bytes(self) -> dict[str, int]:
        return tensor_bytes(self.model, self.optimizer)


def has_batchnorm(model: nn.Module) -> bool:
    """Whether `model` holds BatchNorm layers (ResNet towers, some timm trunks): what --use-bn-sync and
    --lock-image-freeze-bn-stats act on; without any they would do nothing (OpenCLIP's flags: warned about)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


# Where each BatchNorm flag applies, as said where the model is built (DDPEngine, apply_locks) and by --dry-run.
NO_BATCHNORM = {
    "use_bn_sync": "only applies to a model with BatchNorm layers, and this model has none",
    "lock_image_freeze_bn_stats": "only applies to an image tower with BatchNorm statistics (a ResNet), and this "
    "model's has none (a ViT)",
}


def clip_and_measure(params: list[torch.Tensor], max_norm: float | None) -> float:
    """Global grad norm of `params` (plain or sharded gradients), clipping in place when max_norm is set."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # FSDP2: the per-shard partial norms, reduced over the shards
    if max_norm is not None and math.isfinite(max_norm):
        nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)
