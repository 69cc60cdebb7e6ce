"""EngineConfig: the slice of the flags engines read, and what an engine's memory model is given.

Engines own how the model is wrapped, sharded, optimised and saved; these are the flags that decide it (the
engine's own, and the run's values an engine must agree with: precision, batch sizes, clipping, the optimizer).
`resolved` holds what the chosen engine's check_config returned at validation (DeepSpeed: its JSON config with
every "auto" the flags decide filled), so the file is read once and validation changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bigclip.optim import OptimizerConfig

DEFAULT_ENGINE = "ddp"  # OpenCLIP's own parallelism
SHARDED_INIT_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class EngineConfig:
    engine: str = DEFAULT_ENGINE
    ds_config: str | None = None
    sharded_init: str = "auto"
    fsdp_offload_cpu: bool = False
    fsdp_no_reshard_after_forward: bool = False
    fsdp_hybrid: bool = False
    fsdp_replicate_degree: int = 1
    ddp_static_graph: bool = False
    use_bn_sync: bool = False
    device: str = "cuda"
    precision: str = "amp"
    batch_size: int = 64
    accum_freq: int = 1
    grad_clip_norm: float | None = None
    seed: int = 0
    # applied to the finished model before wrapping (engine/__init__.py's order)
    grad_checkpointing: bool = False
    grad_checkpointing_every: int = 1
    torchcompile: bool = False
    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_image_freeze_bn_stats: bool = False
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    lock_text_freeze_layer_norm: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    resolved: Any = None  # the chosen engine's check_config result (DeepSpeed: the resolved JSON)


@dataclass(frozen=True)
class ModelSize:
    """What an engine's memory model needs to know of a model (bigclip.plan measures it)."""

    params: int
    block_params: int  # the largest transformer block
    root_params: int  # parameters outside the blocks (embeddings, projections, norms, logit scale)
