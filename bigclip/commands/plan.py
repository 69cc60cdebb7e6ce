"""`bigclip plan [--model M ...]`: the memory table of bigclip.plan for the given models, GPU counts and sizes."""

from __future__ import annotations

from bigclip import plan
from bigclip.commands import COMMANDS, Command
from bigclip.engine import StateRecipe
from bigclip.errors import OneLineErrorParser
from bigclip.loss import LOSS_IMPLS, LOSS_PRECISIONS, LossConfig, check_loss


def main(argv: list[str]) -> int:
    parser = OneLineErrorParser(prog="bigclip plan", description=plan.__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["ViT-H-14", "ViT-bigG-14"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 256, 1024])
    parser.add_argument("--gpu-mem", nargs="+", type=float, default=[40, 80], help="GB per GPU")
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch per GPU")
    parser.add_argument("--precision", choices=("amp", "amp_bf16", "fp32", "pure_bf16", "bf16"), default="amp")
    parser.add_argument("--opt", choices=("adamw", "adamw8bit"), default="adamw", help="optimizer state to count")
    parser.add_argument("--optimizer-in-backward", action="store_true", help="gradients are not kept until the step")
    parser.add_argument("--ema", action="store_true", help="a float32 moving average of the weights (--ema-decay)")
    parser.add_argument("--force-image-size", type=int, default=None)
    parser.add_argument("--siglip", action="store_true", help="count the SigLIP loss (default: CLIP's)")
    parser.add_argument("--loss-impl", choices=LOSS_IMPLS, default="auto", help="the loss whose memory counts")
    parser.add_argument("--loss-precision", choices=LOSS_PRECISIONS, default="exact")
    parser.add_argument("--loss-dist-impl", default=None, help="the loss's exchange between ranks (its default)")
    parser.add_argument("--local-loss", action="store_true")
    args = parser.parse_args(argv)
    recipe = StateRecipe(args.precision, args.opt, args.optimizer_in_backward, args.ema)
    loss = LossConfig(
        loss="siglip" if args.siglip else "clip",
        siglip=args.siglip,
        loss_impl=args.loss_impl,
        loss_precision=args.loss_precision,
        loss_dist_impl=args.loss_dist_impl,
        local_loss=args.local_loss,
    )
    check_loss(loss)
    print(plan.render(args.model, args.gpus, args.gpu_mem, args.batch_size, recipe, args.force_image_size, loss))
    return 0


COMMANDS.register(
    "plan",
    Command(main, "bigclip plan [--model M]"),
    help="memory per GPU under each engine (state, activations, largest batch)",
)
