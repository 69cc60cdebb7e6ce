"""`bigclip plan`: how much GPU memory a run needs per GPU under each engine, before renting the GPUs.

    bigclip plan --model ViT-bigG-14 --gpus 8 64 256 1024 --gpu-mem 40 80 --batch-size 32

Training state per GPU (Ψ parameters, N data-parallel ranks; ZeRO paper arithmetic, Rajbhandari et al. 2020):
each engine states its own memory model (Engine.memory_models in engine/ddp.py, fsdp.py, deepspeed.py, one row
per setup it can run) and what to know when reading its rows (Engine.memory_notes); this module measures the
model and adds the activations.

Activations per sample (16-bit, Korthikanti et al. 2022 without dropout and with fused attention, which saves
no s×s scores): each block stores about s·h·(16 + 4r) bytes (s tokens, width h, MLP ratio r). With
--grad-checkpointing each block keeps only its 2·s·h-byte input, plus one block's full activations while it
is recomputed. Both towers count; the contrastive loss is chunked (no B×B logits) and is ignored here.
ResNet and timm image towers are not transformers: their parameters count, their activations are not
estimated, and no batch size is suggested for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigclip.engine import ModelSize, memory_notes, memory_setups
from bigclip.engine import state_bytes as engine_state_bytes
from bigclip.errors import OneLineErrorParser
from bigclip.model import create_model

GiB = 1024**3
# CUDA context, allocator fragmentation, communication buckets: kept out of the arithmetic, reserved here.
OVERHEAD_BYTES = 3 * GiB


@dataclass(frozen=True)
class ModelFacts(ModelSize):
    name: str = ""
    towers: tuple[tuple[int, int, int, float], ...] = ()  # (layers, tokens, width, mlp ratio) per transformer tower
    # A tower whose activations the arithmetic does not describe (ResNet and timm image towers): its
    # parameters count, its activations do not, so a batch size that "fits" would be a guess.
    uncounted: str | None = None


def model_facts(name: str, image_size: int | None = None) -> ModelFacts:
    model = create_model(name, device="meta", image_size=image_size)
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in model.transformer_blocks()]
    params = sum(p.numel() for p in model.parameters())
    vision, text = model.visual.activation_shape(), model.text.activation_shape()
    towers = tuple(shape for shape in (vision, text) if shape is not None)
    uncounted = None if vision else f"image tower ({model.visual.description})"
    return ModelFacts(
        params, max(block_sizes), params - sum(block_sizes), name=name, towers=towers, uncounted=uncounted
    )


def state_bytes(setup: str, psi: int, n: int, precision: str = "amp", facts: ModelSize | None = None) -> float:
    """Parameters + gradients + optimizer state per GPU (bytes): the engine's own memory model for `setup`."""
    return engine_state_bytes(setup, psi, n, precision, facts)


def activation_bytes(facts: ModelFacts, batch: int, checkpointing: bool) -> float:
    """Activation memory per GPU for `batch` samples (16-bit activations)."""
    full_per_block = [tokens * width * (16 + 4 * ratio) for _, tokens, width, ratio in facts.towers]
    if not checkpointing:
        return batch * sum(layers * f for (layers, *_), f in zip(facts.towers, full_per_block))
    kept = sum(layers * 2 * tokens * width for layers, tokens, width, _ in facts.towers)
    return batch * (kept + max(full_per_block))


def max_batch(
    facts: ModelFacts, engine: str, n: int, gpu_bytes: float, checkpointing: bool, precision: str = "amp"
) -> int | None:
    """The largest micro-batch per GPU that fits; None when a tower's activations are not counted."""
    if facts.uncounted:
        return None
    free = gpu_bytes - OVERHEAD_BYTES - state_bytes(engine, facts.params, n, precision, facts)
    per_sample = activation_bytes(facts, 1, checkpointing)
    return max(0, math.floor(free / per_sample))


def _gb(x: float) -> str:
    return f"{x / GiB:.1f}"


def render(
    models: list[str], gpus: list[int], gpu_mem: list[float], batch: int, precision: str, image_size: int | None = None
) -> str:
    lines = []
    for name in models:
        facts = model_facts(name, image_size)
        act = activation_bytes(facts, batch, False)
        act_ckpt = activation_bytes(facts, batch, True)
        lines += [
            f"## {name}: {facts.params / 1e9:.2f}B parameters (largest block "
            f"{facts.block_params / 1e6:.0f}M, outside blocks {facts.root_params / 1e6:.0f}M), "
            f"precision {precision}",
            "",
            f"Activations for {batch} samples per GPU: {_gb(act)} GiB, with --grad-checkpointing {_gb(act_ckpt)} GiB"
            + (f" (not counting the {facts.uncounted}: no batch size is suggested)." if facts.uncounted else "."),
            "",
            "State per GPU (GiB) = parameters + gradients + optimizer state; then the largest "
            f"micro-batch per GPU that fits ({_gb(OVERHEAD_BYTES)} GiB reserved), without / with "
            "checkpointing.",
            "",
        ]
        header = (
            "| engine | "
            + " | ".join(f"{n} GPUs" for n in gpus)
            + " | "
            + " | ".join(f"max batch @ {m:g} GB, {gpus[0]} GPUs" for m in gpu_mem)
            + " |"
        )
        lines += [header, "|" + "---|" * (1 + len(gpus) + len(gpu_mem))]
        for engine in memory_setups():
            states = [_gb(state_bytes(engine, facts.params, n, precision, facts)) for n in gpus]
            fits = []
            for mem in gpu_mem:
                gpu_bytes = mem * 1e9
                a = max_batch(facts, engine, gpus[0], gpu_bytes, False, precision)
                b = max_batch(facts, engine, gpus[0], gpu_bytes, True, precision)
                fits.append("n/a" if a is None else f"{a} / {b}")
            lines.append(f"| {engine} | " + " | ".join(states) + " | " + " | ".join(fits) + " |")
        lines.append("")
    for note in memory_notes():  # what each engine says about reading its rows
        lines += [note, ""]
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str]) -> int:
    parser = OneLineErrorParser(prog="bigclip plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["ViT-H-14", "ViT-bigG-14"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 256, 1024])
    parser.add_argument("--gpu-mem", nargs="+", type=float, default=[40, 80], help="GB per GPU")
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch per GPU")
    parser.add_argument("--precision", choices=("amp", "fp32"), default="amp")
    parser.add_argument("--force-image-size", type=int, default=None)
    args = parser.parse_args(argv)
    print(render(args.model, args.gpus, args.gpu_mem, args.batch_size, args.precision, args.force_image_size))
    return 0
