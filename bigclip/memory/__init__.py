"""The memory model: what a training run holds per GPU, predicted before any GPU is rented, and measured.

    size.py      ModelSize / ModelFacts: a model's parameters, largest block and tensor, towers' activation shapes,
                 what locked towers (Locks: --lock-image, --lock-text) freeze
    traced.py    TracedActivations: what an image tower no formula describes (timm, ResNet) saves per block,
                 its forward traced on the meta device
    recipe.py    StateRecipe: bytes per parameter from the precision and optimizer registries; recipes(): every
                 distinct footprint they offer
    setups.py    memory_setups(): each registered engine's ways of keeping the state (its arithmetic, the flags
                 that select it; Engine.memory_setups)
    peak.py      the predicted peak (state + activations + contrastive loss + working buffers), the largest batch
                 that fits, the setups that fit

`bigclip plan` (commands/plan.py), --dry-run (dry_run.py), bench/plan_check.py and the GPU kit read it. What a
rank actually holds is measured by walking the engine's own objects (engine/memory.py: DTensor shards,
DeepSpeed's flat partitions), so that stays with the engines.
"""

from bigclip.memory.peak import (
    OVERHEAD_BYTES,
    GiB,
    activation_bytes,
    contrastive_loss_bytes,
    feature_bytes,
    fitting_setups,
    hsdp_group,
    max_batch,
    model_state_bytes,
    peak_parts,
)
from bigclip.memory.recipe import StateRecipe, distinct_optimizers, distinct_precisions, recipes
from bigclip.memory.setups import (
    MemorySetup,
    StateBytes,
    WorkingBytes,
    WorkingBytesOf,
    add_setup_source,
    locked_weight_bytes,
    memory_setup,
    memory_setups,
    state_bytes,
    working_bytes,
)
from bigclip.memory.size import Locks, ModelFacts, ModelSize, model_facts, parameter_count

__all__ = [
    "GiB",
    "Locks",
    "OVERHEAD_BYTES",
    "MemorySetup",
    "ModelFacts",
    "ModelSize",
    "StateBytes",
    "StateRecipe",
    "WorkingBytes",
    "WorkingBytesOf",
    "activation_bytes",
    "add_setup_source",
    "memory_setup",
    "memory_setups",
    "contrastive_loss_bytes",
    "distinct_optimizers",
    "distinct_precisions",
    "feature_bytes",
    "fitting_setups",
    "hsdp_group",
    "locked_weight_bytes",
    "max_batch",
    "model_facts",
    "model_state_bytes",
    "parameter_count",
    "peak_parts",
    "recipes",
    "state_bytes",
    "working_bytes",
]
