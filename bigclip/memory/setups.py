"""Memory setups: each engine lists the ways it can keep a model's state (ddp, fsdp, zero1 ... zero3_nvme), with
its state and working-memory arithmetic and the flags that select it (Engine.memory_setups). engine/__init__.py
adds the engine registry as their source, so memory_setups() always lists the registered engines' setups (an
engine registered later, an experiment's, included) and importing bigclip.engine is what fills it.

`bigclip plan`'s rows, --dry-run's memory line, bench/plan_check.py's measured setups and the GPU kit's
predictions all read memory_setups(); none keeps a list of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bigclip.errors import UserError
from bigclip.memory.recipe import StateRecipe
from bigclip.memory.size import ModelSize

# (Ψ parameters, N data-parallel ranks, the state's recipe, the model's block sizes or None) -> bytes per GPU, or
# None where the engine cannot run that recipe (DeepSpeed with 8-bit moments)
StateBytes = Callable[[int, int, StateRecipe, ModelSize | None], float | None]


@dataclass(frozen=True)
class WorkingBytes:
    """Memory beyond the training state, per GPU: what lives from the forward to the end of the backward besides
    the activations (autocast's 16-bit copies of fp32 weights), and the optimizer step's temporaries; and whether
    the gradients' memory stays allocated between steps (DDP's buckets, DeepSpeed's flat buffers) or is freed
    after each step and filled again during the backward (FSDP2: one block's unsharded gradients at a time)."""

    backward: float = 0.0
    step: float = 0.0
    gradients_persist: bool = True
    # held when the text tower's backward ends, beyond the state at the backward's start: its largest tensor's (the
    # token embedding's) gradient in flight, and the text tower's kept gradients where they were freed at the step
    text_end: float = 0.0
    # allocated once beside the whole state and a step's inputs, at the second step's start: DDP's reducer re-buckets
    # the gradients in the order the first backward produced them, building the new buckets while the old still
    # hold every gradient (when accumulating: engine/ddp.py)
    rebucket: float = 0.0
    # allocated beside the whole state and a step's inputs after the optimizer step: the moving average's update
    # (--ema-decay) converting weights that are not float32, a window at a time (engine/ema.py)
    ema_update: float = 0.0


# (Ψ, N, recipe, the model's sizes, device type) -> what the setup allocates beyond the state
WorkingBytesOf = Callable[[int, int, StateRecipe, ModelSize, str], WorkingBytes]
# (frozen parameters, N, recipe) -> bytes per GPU of the weights --lock-image/--lock-text freeze: no gradients and no
# optimizer state, placed and typed as the engine places and types the model's weights
LockedWeightBytes = Callable[[int, int, StateRecipe], float]


def whole_locked_weights(frozen: int, n: int, recipe: StateRecipe) -> float:
    """Every rank holds the frozen weights whole, in the weights' dtype (DDP)."""
    return recipe.weight_bytes * frozen


@dataclass(frozen=True)
class MemorySetup:
    """One way an engine keeps the state: its arithmetic, and the flags (TrainConfig field -> value) that select
    it (a path in a value is relative to the repository: the shipped ds_configs/)."""

    state: StateBytes
    working: WorkingBytesOf | None = None  # None: nothing beyond the state
    locked_weights: LockedWeightBytes = whole_locked_weights
    flags: Mapping[str, Any] = field(default_factory=dict)
    offloaded: bool = False  # the state lives in host memory or on NVMe: the GPU holds working buffers only
    # The flag (TrainConfig field) that keeps the state in replica groups, each holding it sharded over its ranks
    # and replicated across the groups; its value is the number of groups (HSDP: FSDP2's fsdp_replicate_degree).
    # None: the setup spreads the state over every rank, no other way.
    replicas_flag: str | None = None


# Who lists the setups: engine/__init__.py adds the engines' (a function, so engines registered later count too).
_SOURCES: list[Callable[[], Mapping[str, MemorySetup]]] = []


def add_setup_source(source: Callable[[], Mapping[str, MemorySetup]]) -> None:
    _SOURCES.append(source)


def memory_setups() -> dict[str, MemorySetup]:
    """Every memory setup, by name, in the order their engines were registered."""
    return {name: setup for source in _SOURCES for name, setup in source().items()}


def memory_setup(name: str) -> MemorySetup:
    setups = memory_setups()
    if name not in setups:
        raise UserError(f"memory setup {name!r}: choose one of {', '.join(setups)}")
    return setups[name]


def state_bytes(
    setup: str, psi: int, n: int, recipe: StateRecipe | str = "amp", size: ModelSize | None = None
) -> float | None:
    """Parameters + gradients + optimizer state per GPU (bytes) for Ψ = `psi` parameters on `n` ranks, kept as
    `recipe` says (a --precision name alone: AdamW, gradients kept); None where the setup cannot run it."""
    return memory_setup(setup).state(psi, n, StateRecipe(recipe) if isinstance(recipe, str) else recipe, size)


def working_bytes(
    setup: str, psi: int, n: int, recipe: StateRecipe, size: ModelSize, device_type: str = "cuda"
) -> WorkingBytes:
    """What `setup` allocates per GPU beyond the state (its engine's own arithmetic, Engine.working_bytes)."""
    working = memory_setup(setup).working
    return working(psi, n, recipe, size, device_type) if working else WorkingBytes()


def locked_weight_bytes(setup: str, frozen: int, n: int, recipe: StateRecipe | str = "amp") -> float:
    """Bytes per GPU of `frozen` locked parameters' weights under `setup` (0 when nothing is locked)."""
    if not frozen:
        return 0.0
    return memory_setup(setup).locked_weights(frozen, n, StateRecipe(recipe) if isinstance(recipe, str) else recipe)
