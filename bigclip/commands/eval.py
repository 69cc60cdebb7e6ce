"""`bigclip eval FLAGS`: zero-shot ImageNet (--imagenet-val, --imagenet-v2) of a model without training.

Takes the training command's flags (--model, --pretrained, --batch-size, --workers, --precision, --engine, …),
runs under any launcher like training does, and prints one JSON object on stdout (rank 0), as CLIP_benchmark
does: the model, the weights, and OpenCLIP's metric names with their values.
"""

from __future__ import annotations

import json

from bigclip.build import build_engine, build_model, build_tokenizer, build_transforms, seed_everything
from bigclip.cli_args import parse_train_args
from bigclip.commands import COMMANDS, Command
from bigclip.data.imagenet import build_zeroshot_sets
from bigclip.dist import join_world, shutdown
from bigclip.errors import UserError
from bigclip.evaluation.zero_shot import imagenet_zero_shot


def main(argv: list[str]) -> int:
    cfg, launcher = parse_train_args(argv)
    if not (cfg.imagenet_val or cfg.imagenet_v2):
        raise UserError("bigclip eval: nothing to evaluate; pass --imagenet-val DIR and/or --imagenet-v2 DIR")
    run = cfg.sections
    world = join_world(run.dist, launcher.get("local_rank"))
    try:
        seed_everything(cfg.seed)
        engine = build_engine(run.engine, build_model(run.model, run.engine, world), world)
        _, preprocess_val, _ = build_transforms(run.model, run.data)
        sets = build_zeroshot_sets(run.data, preprocess_val, world.rank, world.world_size)
        tokenizer = build_tokenizer(run.model)
        engine.eval()
        metrics = imagenet_zero_shot(engine, sets, tokenizer, world)
        if world.is_main:
            result = {"model": cfg.model, "pretrained": cfg.pretrained, "metrics": metrics}
            result["images"] = {prefix: info.num_samples for prefix, info in sets.items()}
            print(json.dumps(result), flush=True)
        return 0
    finally:
        shutdown()


COMMANDS.register(
    "eval",
    Command(main, "bigclip eval FLAGS", keeps_debug=True),
    help="zero-shot --imagenet-val / --imagenet-v2 of --model [--pretrained], JSON on stdout",
)
