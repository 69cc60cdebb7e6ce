"""`bigclip models`: the architectures --model takes, with their embedding width."""

from __future__ import annotations

from bigclip.commands import COMMANDS, Command
from bigclip.model import get_model_config, list_models


def main(argv: list[str]) -> int:
    for name in list_models():
        cfg = get_model_config(name)
        print(f"{name:16s} embed_dim={cfg.get('embed_dim')}")
    return 0


COMMANDS.register("models", Command(main, "bigclip models"), help="list the architectures")
