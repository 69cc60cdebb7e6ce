"""The predicted peak memory per GPU of a training step: the engine's state (memory/setups.py), activations, the
contrastive loss and the engine's working buffers, at the five moments that can be the peak.

Training state per GPU (Ψ parameters, N data-parallel ranks; ZeRO paper arithmetic, Rajbhandari et al. 2020):
each engine states its own memory model (one MemorySetup per way it keeps the state, in engine/ddp.py, fsdp.py,
deepspeed.py) and what to know when reading its rows (Engine.memory_notes); this module adds the activations.

Activations per sample (Korthikanti et al. 2022 without dropout and with fused attention, which saves no s×s
scores): each block stores about s·h·(8 + 2r) values (s tokens, width h, MLP ratio r), 2 bytes each (amp, pure
bf16) or 4 (fp32). With --grad-checkpointing each block keeps only its s·h-value input, plus one block's full
activations while it is recomputed. Both towers count. Image towers no formula describes (timm trunks: EVA,
ConvNeXt, Swin, …; ResNet) are measured instead: their forward traced on the meta device (memory/traced.py), the
same rule for checkpointing applied to what each block saves. The contrastive loss counts at the start of the backward
(bigclip.loss.memory: the implementation --loss-impl auto picks on a GPU for the global batch, or the one named:
OpenCLIP's naive loss holds four B_global x B_global logit matrices, the fused path a chunk of logits and O(B d)).

The peak (peak_parts) is the larger of the start of the backward (weights, optimizer state, the gradients'
memory where the engine keeps it between steps, the step's input batches, activations, autocast's weight copies)
and the optimizer step (the whole state, the inputs and the step's temporaries: torch's multi-tensor AdamW builds
one float32 moment-sized temporary on CUDA). Checked against measurement by bench/plan_check.py (CPU, every
setup) and the GPU kit. A tower whose forward cannot be traced on meta (an operation without a meta kernel) is not
estimated, and no batch size is suggested for it.
"""

from __future__ import annotations

import dataclasses
import itertools

from bigclip.loss import LossConfig
from bigclip.loss.memory import loss_peak_bytes
from bigclip.memory.recipe import StateRecipe, recipes
from bigclip.memory.setups import locked_weight_bytes, memory_setup, memory_setups, state_bytes, working_bytes
from bigclip.memory.size import ModelFacts

GiB = 1024**3
# CUDA context, allocator fragmentation, communication buckets: kept out of the arithmetic, reserved here.
OVERHEAD_BYTES = 3 * GiB


def activation_bytes(facts: ModelFacts, batch: int, checkpointing: bool, element_bytes: int = 2) -> float:
    """Activation memory per GPU for `batch` samples, each saved value `element_bytes` wide (16-bit by default;
    4 under --precision fp32)."""
    full_per_block = [tokens * width * (8 + 2 * ratio) * element_bytes for _, tokens, width, ratio in facts.towers]
    traced = sum(tower.kept_bytes(checkpointing, element_bytes) for tower in facts.traced)
    if not checkpointing:
        return batch * (sum(layers * f for (layers, *_), f in zip(facts.towers, full_per_block)) + traced)
    kept = sum(layers * tokens * width * element_bytes for layers, tokens, width, _ in facts.towers)
    # while one block is recomputed: a formula tower's (everything else kept), or a traced tower's at its own peak
    recomputing = [traced + f for (layers, *_), f in zip(facts.towers, full_per_block) if layers]
    recomputing += [traced - t.kept_bytes(True, element_bytes) + t.checkpointed_peak_bytes(element_bytes)
                    for t in facts.traced]  # fmt: skip
    return batch * (kept + max(recomputing, default=traced))


def input_bytes(facts: ModelFacts, samples: int, recipe: StateRecipe) -> float:
    """The step's input batches on the device: images in the weights' dtype (the loop casts them; float32 under amp
    and fp32, bfloat16 under pure bf16) and int64 token ids. With --accum-freq every micro-batch's are there for the
    whole step (bigclip.loop.forward_backward recomputes each after caching all their features)."""
    return samples * (facts.input_pixels * recipe.weight_bytes + facts.input_tokens * 8)


def model_state_bytes(setup: str, facts: ModelFacts, n: int, recipe: StateRecipe) -> float | None:
    """The training state per GPU of this model under `setup`: the trainable parameters' weights, gradients and
    optimizer state, and the locked towers' weights; None where the setup cannot keep the state as `recipe` says."""
    kept = state_bytes(setup, facts.trainable_params, n, recipe, facts)
    return None if kept is None else kept + locked_weight_bytes(setup, facts.frozen_params, n, recipe)


def peak_parts(
    setup: str,
    facts: ModelFacts,
    n: int,
    recipe: StateRecipe,
    batch: int,
    checkpointing: bool,
    device_type: str = "cuda",
    loss: LossConfig | None = None,
    state_ranks: int | None = None,
) -> dict[str, float] | None:
    """The predicted peak per GPU (bytes; the fixed reserve not included) and its parts, or None where the setup
    cannot keep the state as `recipe` says. `n` ranks share the data (the contrastive loss's global batch); the
    state is spread over `state_ranks` of them (default n; HSDP: a replica group). The peak is the largest of
    five moments:

    - the start of the backward: weights, optimizer state, the gradients' memory where the engine keeps it between
      steps (else one block's), the step's input batches (input_bytes), all activations, what the engine keeps
      from forward to backward (autocast's weight copies, ZeRO-3's gathered parameters) and the contrastive loss's
      peak (`loss`: the flags; default --loss-impl auto, CLIP);
    - the end of the text tower's backward (below);
    - the optimizer step: the whole state, gradients included, the inputs and the step's temporaries (stepped in
      the backward: at the end of the text tower's backward, for its largest tensor);
    - where the engine allocates once beside the whole state and a step's inputs (WorkingBytes.rebucket: DDP's
      reducer rebuilding its gradient buckets at the second step's start, when accumulating);
    - the moving average's update after the step (--ema-decay: WorkingBytes.ema_update).
    """
    psi = facts.trainable_params  # the state and the step are the trainable parameters'; locked ones are weights
    shards = state_ranks or n  # the state is spread over n ranks, or over a replica group's (HSDP)
    kept = model_state_bytes(setup, facts, shards, recipe)
    if kept is None:
        return None
    frozen = locked_weight_bytes(setup, facts.frozen_params, shards, recipe)
    working = working_bytes(setup, psi, shards, recipe, facts, device_type)
    at_backward = kept
    if not working.gradients_persist:  # the state with one block's gradients instead of all of them
        at_backward = frozen + state_bytes(setup, psi, shards, dataclasses.replace(recipe, in_backward=True), facts)
    activations = activation_bytes(facts, batch, checkpointing, recipe.activation_bytes)
    # --accum-freq: the activations are one micro-batch's; the loss runs over the features of all of them (the
    # others' cached without gradients, bigclip.loop.forward_backward)
    loss_bytes = contrastive_loss_bytes(loss or LossConfig(), facts, n, recipe, batch * recipe.accum_freq, device_type)
    inputs = input_bytes(facts, batch * recipe.accum_freq, recipe)
    backward = at_backward + inputs + activations + working.backward + loss_bytes
    step = kept + inputs + working.step
    # When the text tower's backward ends (it runs first: its forward ran last) the image tower's activations are
    # alive, and its largest tensor's gradient (the token embedding's) is in flight; stepped in the backward, that
    # tensor is updated then, with the step's temporaries.
    image_first = dataclasses.replace(facts, towers=facts.towers[:-1])  # a traced tower is an image tower
    image_activations = activation_bytes(image_first, batch, checkpointing, recipe.activation_bytes)
    text_end = at_backward + inputs + image_activations + working.backward + working.text_end
    if recipe.in_backward:
        text_end, step = text_end + working.step, 0.0
    rebucket = kept + inputs + working.rebucket if working.rebucket else 0.0
    ema_update = kept + inputs + working.ema_update if working.ema_update else 0.0
    return {
        "state": kept,
        "inputs": inputs,
        "activations": activations,
        "loss": loss_bytes,
        "working": working.backward + working.step,
        "backward": backward,
        "text_end": text_end,
        "step": step,
        "rebucket": rebucket,
        "ema_update": ema_update,
        "peak": max(backward, text_end, step, rebucket, ema_update),
    }


def feature_bytes(recipe: StateRecipe) -> int:
    """The loss's features: 16-bit under pure bf16, float32 otherwise (amp's F.normalize computes in float32)."""
    return 2 if recipe.weight_bytes == 2 else 4


def contrastive_loss_bytes(
    loss: LossConfig, facts: ModelFacts, n: int, recipe: StateRecipe, batch: int, device_type: str = "cuda"
) -> float:
    """The contrastive loss's peak on one of n ranks for `batch` samples each (bigclip.loss.memory)."""
    if batch == 0 or not facts.embed_dim:
        return 0.0
    return loss_peak_bytes(loss, batch, n, facts.embed_dim, feature_bytes(recipe), device_type)


def max_batch(
    facts: ModelFacts,
    engine: str,
    n: int,
    gpu_bytes: float,
    checkpointing: bool,
    recipe: StateRecipe | str = "amp",
    loss: LossConfig | None = None,
    state_ranks: int | None = None,
) -> int | None:
    """The largest micro-batch per GPU whose predicted peak fits; None when a tower's activations are not counted
    or the setup cannot keep the state as `recipe` says. `state_ranks`: as peak_parts's (HSDP's group)."""
    recipe = StateRecipe(recipe) if isinstance(recipe, str) else recipe
    room = gpu_bytes - OVERHEAD_BYTES

    def parts(batch: int) -> dict[str, float] | None:
        return peak_parts(engine, facts, n, recipe, batch, checkpointing, loss=loss, state_ranks=state_ranks)

    def fits(batch: int) -> bool:
        return parts(batch)["peak"] <= room

    if facts.uncounted or parts(0) is None:
        return None
    if not fits(0):
        return 0
    low, high = 0, 1  # the peak grows with the batch: double until it does not fit, then bisect
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def hsdp_group(setup: str, n: int, group: int | None) -> int | None:
    """The ranks that hold the state in `setup`'s HSDP row on n GPUs in groups of `group` (a node's), or None where
    there is no such row: the setup cannot replicate, no group was given, or n GPUs are not whole groups. One
    group or fewer GPUs: the plain setup's n."""
    if group is None or memory_setup(setup).replicas_flag is None or n % min(n, group):
        return None
    return min(n, group)


def fitting_setups(
    facts: ModelFacts,
    n: int,
    gpu_bytes: float,
    batch: int,
    loss: LossConfig | None = None,
    accum_freq: int = 1,
    group: int | None = None,
) -> list[tuple[float, str, StateRecipe]]:
    """(state bytes, setup, recipe) of every setup on the GPU that fits `batch` samples per GPU (each of
    `accum_freq` micro-batches) with --grad-checkpointing, most state first; offload setups (whose GPU holds
    buffers only) are left out, and with accumulation the optimizer stepped in the backward (which cannot
    accumulate). `group`: also each setup's HSDP in groups of that many GPUs (named "<setup> HSDP"), where it
    differs from the setup."""
    if facts.uncounted:
        return []
    fits = []
    for setup, memory in memory_setups().items():
        if memory.offloaded:
            continue
        spreads = [(setup, None)]
        hsdp = hsdp_group(setup, n, group)
        if hsdp is not None and hsdp < n:
            spreads.append((f"{setup} HSDP", hsdp))
        for (name, state_ranks), recipe in itertools.product(
            spreads, (dataclasses.replace(r, accum_freq=accum_freq) for r in recipes())
        ):
            if recipe.in_backward and accum_freq > 1:
                continue
            parts = peak_parts(setup, facts, n, recipe, batch, True, loss=loss, state_ranks=state_ranks)
            if parts is not None and parts["peak"] + OVERHEAD_BYTES <= gpu_bytes:
                fits.append((parts["state"], name, recipe))
    return sorted(fits, key=lambda fit: -fit[0])
