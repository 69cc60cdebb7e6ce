"""DeepSpeed's memory setups (zero1 ... zero3_nvme): the ZeRO paper's arithmetic for each stage and offload, what
ZeRO-3 keeps gathered and what its optimizer step allocates, and the flags that select each (its shipped config).
`bigclip plan`, --dry-run and bench/plan_check.py read them through bigclip.memory's memory_setups()."""

from __future__ import annotations

import dataclasses

from bigclip.memory import MemorySetup, ModelSize, StateRecipe, WorkingBytes

# DeepSpeed's default for zero_optimization.stage3_max_live_parameters (parameters kept gathered at once)
STAGE3_MAX_LIVE_PARAMETERS = 10**9


def memory_setups() -> dict[str, MemorySetup]:
    """ZeRO paper arithmetic, K = 12 bytes of fp32 master weights + Adam moments per parameter, plus the
    working copy of weights and gradients in the compute dtype: 2 bytes each under --precision amp (bf16/fp16),
    4 under fp32 (DeepSpeed keeps a separate fp32 master even then). Each setup is selected by its shipped
    config (ds_configs/)."""

    def setup(stage_bytes, config: str, offloaded: bool = False, full_gradients_between_boundaries=False):
        # stage_bytes(Ψ, N, working-copy bytes per parameter) -> bytes
        def state(psi: int, n: int, recipe: StateRecipe, size: ModelSize | None) -> float | None:
            if recipe.quantized_state or recipe.in_backward:
                return None  # refused by check_config: DeepSpeed keeps its own fp32 Adam state and steps
            # --ema-decay: a float32 average of each rank's fp32 master partition (engine/deepspeed_ema.py)
            return stage_bytes(psi, n, recipe.activation_bytes) + (4 * psi / n if recipe.ema else 0)

        stage3 = config.startswith("zero3")

        def working(psi: int, n: int, recipe: StateRecipe, size: ModelSize, device_type: str) -> WorkingBytes:
            working = _working(stage3, offloaded, psi, n, recipe, device_type, size.params)
            if full_gradients_between_boundaries and recipe.accum_freq > 1:
                # ZeRO-1 reduces a gradient into its partition only at the accumulation boundary (the last
                # micro-batch's backward): the micro-batches before it leave every full gradient in .grad, in the
                # working dtype, alive when the last backward starts
                working = dataclasses.replace(working, backward=working.backward + recipe.activation_bytes * psi)
            return working

        def locked(frozen: int, n: int, recipe: StateRecipe) -> float:
            # DeepSpeed casts the whole module to its working dtype and keeps fp32 masters of what it optimizes
            # only; ZeRO-3 partitions the locked weights too (offloaded: in host memory)
            if offloaded:
                return 0.0
            return recipe.activation_bytes * frozen / (n if stage3 else 1)

        return MemorySetup(
            state,
            working,
            flags={"ds_config": f"ds_configs/{config}.json"},
            offloaded=offloaded,
            locked_weights=locked,
        )

    return {
        # full weights; gradients reduced into partitions as the backward makes them (zero1: only in the last
        # micro-batch's backward; see setup())
        "zero1": setup(lambda psi, n, w: w * psi + (12 + w) * psi / n, "zero1", full_gradients_between_boundaries=True),
        "zero2": setup(lambda psi, n, w: w * psi + (12 + w) * psi / n, "zero2"),
        "zero3": setup(lambda psi, n, w: (12 + 2 * w) * psi / n, "zero3"),  # everything partitioned
        # all of it in host memory: GPU buffers only
        "zero3_offload": setup(lambda psi, n, w: 0.0, "zero3_offload", offloaded=True),
        # weights on NVMe, the rest in host memory: GPU buffers only
        "zero3_nvme": setup(lambda psi, n, w: 0.0, "zero3_nvme", offloaded=True),
    }


def _working(stage3: bool, offloaded: bool, psi: int, n: int, recipe: StateRecipe, device_type: str, whole: int):
    # ZeRO-3 keeps the parameters it gathered in the forward for the backward, up to stage3_max_live_parameters
    # (DeepSpeed's default, 1e9; bigclip's configs leave it), in the working dtype: all `whole` of them, locked
    # towers' too (measured: ViT-B-32 with --lock-image peaked their bf16 copies above a plan without them)
    gathered = recipe.activation_bytes * min(whole, STAGE3_MAX_LIVE_PARAMETERS) if stage3 else 0.0
    if offloaded:
        return WorkingBytes(backward=gathered)  # the step runs in host memory (DeepSpeed's CPU Adam)
    # ZeRO's step flattens the rank's gradient partition into a new float32 tensor (the .grad of its fp32
    # master partition, whatever --precision), then the client optimizer (torch's AdamW) steps that one tensor
    masters = dataclasses.replace(recipe, precision="fp32")
    return WorkingBytes(gathered, 4 * psi / n + masters.step_scratch_bytes(psi / n, psi / n, device_type))


MEMORY_NOTES = [
    "zero3_offload keeps weights, gradients and Adam state in host memory (16Ψ/N bytes per "
    "rank there); its GPU column is working buffers only.",
    "zero3_nvme (ZeRO-Infinity) swaps the 16-bit weights to NVMe files and keeps fp32 masters, gradients "
    "and Adam state in host memory (as zero3_offload); the GPU holds working buffers only.",
    "zero1 keeps full gradients only between --accum-freq's micro-batches (DeepSpeed reduces them into "
    "partitions in the backward that ends the accumulation), so its state is zero2's; with --accum-freq > 1 the "
    "last micro-batch's backward starts with every full gradient beside the activations.",
]
