"""`bigclip plan`: how much GPU memory a run needs per GPU under each engine, before renting the GPUs.

    bigclip plan --model ViT-bigG-14 --gpus 8 64 256 1024 --gpu-mem 40 80 --batch-size 32

The arithmetic is bigclip/memory/ (memory/peak.py says what counts); this command renders its table for the given
models, GPU counts and sizes: state per GPU under every registered memory setup (and, for setups that can keep
the state in replica groups, their HSDP row: sharded within each node of --gpus-per-node GPUs, replicated across
nodes), the largest micro-batch that fits, and which setups fit a given batch.
"""

from __future__ import annotations

from bigclip.commands import COMMANDS, Command
from bigclip.engine import memory_notes
from bigclip.errors import OneLineErrorParser
from bigclip.loss import LOSS_IMPLS, LOSS_PRECISIONS, LossConfig, check_loss
from bigclip.loss.memory import chosen_impl
from bigclip.memory import (
    OVERHEAD_BYTES,
    GiB,
    Locks,
    ModelFacts,
    StateRecipe,
    activation_bytes,
    contrastive_loss_bytes,
    feature_bytes,
    fitting_setups,
    hsdp_group,
    max_batch,
    memory_setups,
    model_facts,
    model_state_bytes,
)
from bigclip.optim import OPTIMIZERS
from bigclip.precision import PRECISIONS


def main(argv: list[str]) -> int:
    parser = OneLineErrorParser(prog="bigclip plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["ViT-H-14", "ViT-bigG-14"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 256, 1024])
    parser.add_argument("--gpu-mem", nargs="+", type=float, default=[40, 80], help="GB per GPU")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="the HSDP rows' group: GPUs per node")
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch per GPU")
    parser.add_argument("--precision", choices=PRECISIONS.names(), default="amp")
    optimizers = [name for name, _ in OPTIMIZERS.items() if not OPTIMIZERS.entry(name).prefix]
    parser.add_argument("--opt", choices=optimizers, default="adamw", help="optimizer state to count")
    parser.add_argument("--optimizer-in-backward", action="store_true", help="gradients are not kept until the step")
    parser.add_argument("--ema", action="store_true", help="a float32 moving average of the weights (--ema-decay)")
    parser.add_argument("--accum-freq", type=int, default=1, help="micro-batches per step (--batch-size is each one's)")
    parser.add_argument("--force-image-size", type=int, default=None)
    parser.add_argument("--lock-image", action="store_true", help="the image tower frozen (LiT): weights only")
    parser.add_argument("--lock-image-unlocked-groups", type=int, default=0, help="with --lock-image")
    parser.add_argument("--lock-text", action="store_true", help="the text tower frozen: weights only")
    parser.add_argument("--lock-text-unlocked-layers", type=int, default=0, help="with --lock-text")
    parser.add_argument("--lock-text-freeze-layer-norm", action="store_true", help="with --lock-text")
    parser.add_argument("--siglip", action="store_true", help="count the SigLIP loss (default: CLIP's)")
    parser.add_argument("--loss-impl", choices=LOSS_IMPLS, default="auto", help="the loss whose memory counts")
    parser.add_argument("--loss-precision", choices=LOSS_PRECISIONS, default="exact")
    parser.add_argument("--loss-dist-impl", default=None, help="the loss's exchange between ranks (its default)")
    parser.add_argument("--local-loss", action="store_true")
    args = parser.parse_args(argv)
    if args.accum_freq < 1:
        parser.error(f"argument --accum-freq: {args.accum_freq} is not a positive integer")
    if args.gpus_per_node < 1:
        parser.error(f"argument --gpus-per-node: {args.gpus_per_node} is not a positive integer")
    if args.accum_freq > 1 and args.optimizer_in_backward:
        parser.error("--optimizer-in-backward cannot accumulate micro-batches (--accum-freq); plan one or the other")
    recipe = StateRecipe(args.precision, args.opt, args.optimizer_in_backward, args.ema, args.accum_freq)
    loss = LossConfig(
        loss="siglip" if args.siglip else "clip",
        siglip=args.siglip,
        loss_impl=args.loss_impl,
        loss_precision=args.loss_precision,
        loss_dist_impl=args.loss_dist_impl,
        local_loss=args.local_loss,
    )
    check_loss(loss)
    for refinement, lock in (
        ("lock_image_unlocked_groups", "lock_image"),
        ("lock_text_unlocked_layers", "lock_text"),
        ("lock_text_freeze_layer_norm", "lock_text"),
    ):
        if getattr(args, refinement) and not getattr(args, lock):
            flag = "--" + refinement.replace("_", "-")
            parser.error(f"{flag}: acts only with --{lock.replace('_', '-')}; add it or drop {flag}")
    locks = Locks.of(args)
    print(
        render(
            args.model, args.gpus, args.gpu_mem, args.batch_size, recipe, args.force_image_size, loss, locks,
            args.gpus_per_node,
        )
    )  # fmt: skip
    return 0


def _gb(x: float) -> str:
    return f"{x / GiB:.1f}"


def _fit_lines(
    facts: ModelFacts,
    n: int,
    gpu_mem: list[float],
    batch: int,
    loss: LossConfig,
    accum_freq: int = 1,
    group: int | None = None,
) -> list[str]:
    lines = []
    for mem in gpu_mem:
        fits = fitting_setups(facts, n, mem * 1e9, batch, loss, accum_freq, group)
        where = f"{batch} samples per GPU with --grad-checkpointing on {n} GPUs of {mem:g} GB"
        if facts.uncounted:
            lines.append(f"{where}: not estimated (the {facts.uncounted}'s activations are not counted)")
        elif not fits:
            lines.append(f"{where}: no setup fits without offloading to host memory or NVMe")
        else:
            (most, setup, recipe), (least, lean_setup, lean_recipe) = fits[0], fits[-1]
            lines.append(
                f"{where}: the setup that keeps the most state and fits is {setup} ({recipe.describe()}: "
                f"{_gb(most)} GiB of state); the leanest is {lean_setup} ({lean_recipe.describe()}: {_gb(least)} GiB)"
            )
    return lines


def render(
    models: list[str],
    gpus: list[int],
    gpu_mem: list[float],
    batch: int,
    recipe: StateRecipe | str,
    image_size: int | None = None,
    loss: LossConfig | None = None,
    locks: Locks | None = None,
    gpus_per_node: int | None = None,
) -> str:
    """The plan's text; `gpus_per_node`: HSDP rows in groups of that many GPUs (None: none)."""
    recipe = StateRecipe(recipe) if isinstance(recipe, str) else recipe
    loss = loss or LossConfig()
    lines = []
    for name in models:
        facts = model_facts(name, image_size, locks)
        act = activation_bytes(facts, batch, False, recipe.activation_bytes)
        act_ckpt = activation_bytes(facts, batch, True, recipe.activation_bytes)
        loss_line = "; ".join(
            f"{n} GPUs: {chosen_impl(loss, batch * recipe.accum_freq, n, feature_bytes(recipe))} "
            f"{contrastive_loss_bytes(loss, facts, n, recipe, batch * recipe.accum_freq) / GiB:.2f} GiB"
            for n in gpus
        )
        lines += [
            f"## {name}: {facts.params / 1e9:.2f}B parameters (largest block "
            f"{facts.block_params / 1e6:.0f}M, outside blocks {facts.root_params / 1e6:.0f}M"
            + (f"; {facts.frozen_params / 1e9:.2f}B locked" if facts.frozen_params else "")
            + f"), {recipe.describe()}",
            "",
            f"Activations for {batch} samples per GPU: {_gb(act)} GiB, with --grad-checkpointing {_gb(act_ckpt)} GiB"
            + (f" (not counting the {facts.uncounted}: no batch size is suggested)." if facts.uncounted else "."),
            "",
            f"Contrastive loss per GPU at {batch * recipe.accum_freq} samples per GPU (--loss-impl {loss.loss_impl}, "
            f"{'siglip' if loss.siglip or loss.loss == 'siglip' else loss.loss}): {loss_line}.",
            "",
            "State per GPU (GiB) = parameters + gradients + optimizer state; then the largest "
            "micro-batch per GPU whose peak (peak_parts: the largest of the backward's, the optimizer step's and the "
            f"engine's one-off moments) fits ({_gb(OVERHEAD_BYTES)} GiB reserved), without / with checkpointing.",
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
            lines.append(_row(engine, facts, gpus, gpu_mem, recipe, loss))
            if any(hsdp_group(engine, n, gpus_per_node) not in (None, n) for n in gpus):
                lines.append(_row(engine, facts, gpus, gpu_mem, recipe, loss, gpus_per_node))
        lines += ["", *_fit_lines(facts, gpus[0], gpu_mem, batch, loss, recipe.accum_freq, gpus_per_node), ""]
    for note in memory_notes():  # what each engine says about reading its rows
        lines += [note, ""]
    return "\n".join(lines).rstrip("\n")


def _row(
    engine: str,
    facts: ModelFacts,
    gpus: list[int],
    gpu_mem: list[float],
    recipe: StateRecipe,
    loss: LossConfig,
    group: int | None = None,
) -> str:
    """One setup's row: its state per GPU at each GPU count, and its largest micro-batch without / with
    checkpointing on the first count at each memory size; `group`: its HSDP row (n/a where the GPUs are not
    whole groups)."""
    label, spread = engine, {n: n for n in gpus}
    if group is not None:
        label, spread = f"{engine} HSDP, {group} GPUs per node", {n: hsdp_group(engine, n, group) for n in gpus}
    states = [None if spread[n] is None else model_state_bytes(engine, facts, spread[n], recipe) for n in gpus]
    if spread[gpus[0]] is not None and states[0] is None:
        return f"| {label} | " + " | ".join("cannot" for _ in gpus + gpu_mem) + " |"
    fits = []
    for mem in gpu_mem:
        if spread[gpus[0]] is None:
            fits.append("n/a")
            continue
        a, b = (
            max_batch(facts, engine, gpus[0], mem * 1e9, ckpt, recipe, loss, state_ranks=spread[gpus[0]])
            for ckpt in (False, True)
        )
        fits.append("n/a" if a is None else f"{a} / {b}")
    shown = ["n/a" if x is None else _gb(x) for x in states]
    return f"| {label} | " + " | ".join(shown) + " | " + " | ".join(fits) + " |"


COMMANDS.register(
    "plan",
    Command(main, "bigclip plan [--model M]"),
    help="memory per GPU under each engine (state, activations, largest batch)",
)
