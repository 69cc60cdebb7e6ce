"""--dry-run: what a launch would do, without building the model or training.

Run under the real launcher (torchrun, the DeepSpeed launcher, srun), it joins the process group (so the
rendezvous itself is tested), then rank 0 prints the world as every rank sees it (one line per node), the
engine's layout and the memory each GPU would need (bigclip.memory's arithmetic for this model, engine, world
size, micro-batch and precision).
"""

from __future__ import annotations

from bigclip import memory
from bigclip.dist import World, describe_world
from bigclip.engine import (
    EngineConfig,
    batchnorm_flags_set,
    describe_plan,
    frozen_bytes,
    say_idle_batchnorm_flags,
    state_ranks,
)
from bigclip.loss import LossConfig
from bigclip.model.config import ModelConfig

# memory.peak_parts' moments, as the memory line names the one where the peak is
MOMENTS = {
    "backward": "the start of the backward",
    "text_end": "the end of the text tower's backward",
    "step": "the optimizer step",
    "rebucket": "the second step's start (DDP rebuilds its gradient buckets)",
    "ema_update": "the moving average's update (--ema-decay)",
}


def _memory_lines(
    cfg: EngineConfig,
    world: World,
    setup: str,
    facts: memory.ModelFacts,
    teacher_bytes: float = 0.0,
    loss: LossConfig | None = None,
) -> list[str]:
    recipe = memory.StateRecipe(
        cfg.precision, cfg.optimizer.opt, cfg.optimizer_in_backward, cfg.ema_decay is not None, cfg.accum_freq
    )
    shards = state_ranks(cfg, world)
    spread = f" (the state over {shards} of them)" if shards != world.world_size else ""
    where = (
        f"memory per GPU ({setup}, {recipe.describe()}, {world.world_size} rank(s){spread}, micro-batch "
        f"{cfg.batch_size}"
        f"{f', --accum-freq {cfg.accum_freq}' if cfg.accum_freq > 1 else ''}"
        f"{', --grad-checkpointing' if cfg.grad_checkpointing else ''})"
    )
    parts = memory.peak_parts(
        setup, facts, world.world_size, recipe, cfg.batch_size, cfg.grad_checkpointing, world.device.type, loss, shards
    )
    if parts is None:
        return [f"{where}: this engine cannot keep the state so"]
    gib = memory.GiB
    moment = MOMENTS[max(MOMENTS, key=lambda name: parts[name])]
    total = parts["peak"] + memory.OVERHEAD_BYTES + teacher_bytes
    teacher = f" + the teacher's weights {teacher_bytes / gib:.1f} GiB" if teacher_bytes else ""
    return [
        f"{where}: state {parts['state'] / gib:.1f} GiB, activations {parts['activations'] / gib:.1f} GiB, "
        f"contrastive loss {parts['loss'] / gib:.2f} GiB, working "
        f"buffers {parts['working'] / gib:.1f} GiB; peak at {moment} {parts['peak'] / gib:.1f} GiB + "
        f"{memory.OVERHEAD_BYTES / gib:.0f} GiB reserved{teacher} = {total / gib:.1f} GiB"
        + (f" + the {facts.uncounted}'s activations, not estimated" if facts.uncounted else ""),
    ]


def report(model: ModelConfig, engine: EngineConfig, world: World, loss: LossConfig | None = None) -> list[str]:
    """The lines to print (on rank 0). Collective: every rank must call it."""
    lines = describe_world(world)
    if batchnorm_flags_set(engine):  # what only the model tells (idle BatchNorm flags), from its meta build
        from bigclip.model import create_model

        size = model.force_image_size[0] if model.force_image_size else None
        say_idle_batchnorm_flags(engine, create_model(model.model, device="meta", image_size=size))
    # Every architecture bigclip builds has facts (towers without an activation formula say so themselves).
    image_size = model.force_image_size[0] if model.force_image_size else None
    facts = memory.model_facts(model.model, image_size, memory.Locks.of(engine))
    setup, layout = describe_plan(engine, world, facts.params)
    locked = f" ({facts.frozen_params / 1e6:.1f}M of them locked)" if facts.frozen_params else ""
    lines.append(f"model {model.model}: {facts.params / 1e6:.1f}M parameters{locked}")
    lines.append(f"engine {layout}")
    teacher_bytes = 0.0
    if model.distill_model is not None:  # --distill-model: its weights, placed as the engine places the model
        teacher = memory.model_facts(model.distill_model, None)
        teacher_bytes = frozen_bytes(engine, world, teacher.params)
        lines.append(
            f"teacher {model.distill_model}: {teacher.params / 1e6:.1f}M parameters, "
            f"{teacher_bytes / memory.GiB:.2f} GiB of weights per GPU (its forward's activations are not estimated)"
        )
    return lines + _memory_lines(engine, world, setup, facts, teacher_bytes, loss)
