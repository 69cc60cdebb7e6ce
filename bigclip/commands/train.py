"""`bigclip [train] FLAGS` (and `python launch/train.py FLAGS`): the training run; the flags are TrainConfig's
(cli_args.py)."""

from __future__ import annotations

from bigclip.cli_args import parse_train_args
from bigclip.commands import COMMANDS, Command
from bigclip.train import run


def main(argv: list[str]) -> int:
    cfg, launcher = parse_train_args(argv)
    return run(cfg, local_rank=launcher.get("local_rank"))


COMMANDS.register(
    "train",
    Command(main, "bigclip [train] FLAGS", keeps_debug=True),
    help="train (the default; `python launch/train.py FLAGS` is the same)",
)
