"""The training flags as an argparse parser, generated from TrainConfig: a flag exists exactly when a config
field does, and its help, group and default cannot drift apart; a flag that names a registered choice lists the
registry's names and their help. Flags default to "not given"
(argparse.SUPPRESS): the config layer needs to know what the user typed to apply the defaults < demo < YAML
< flags precedence. Shared by `bigclip [train]` and `bigclip eval`.
"""

from __future__ import annotations

import argparse
from typing import Any

from bigclip import config as config_mod
from bigclip.commands import commands_help
from bigclip.errors import OneLineErrorParser, UserError
from bigclip.flag_fields import default_of


def _argparse_kwargs(f) -> dict[str, Any]:
    kwargs = {k: v for k, v in f.metadata["argparse"].items() if k != "aliases"}
    shows = f.metadata.get("shows")  # a registry: its names and what each means, as registered now
    kwargs["help"] = f.metadata["help"] + (f" {shows.help()}" if shows is not None else "")
    annotation = str(f.type)
    if annotation == "bool":
        kwargs["action"] = "store_true"
    elif "type" not in kwargs:
        if annotation.startswith("int"):
            kwargs["type"] = int
        elif annotation.startswith("float"):
            kwargs["type"] = float
        else:
            kwargs["type"] = str
    default = default_of(f)  # a list or dict flag's default comes from its factory
    if default not in (None, False, [], {}, "") and "action" not in kwargs:
        kwargs["help"] += f" (default: {default!r})"
    kwargs["default"] = argparse.SUPPRESS
    return kwargs


def build_train_parser(prog: str = "bigclip") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog,
        description="Train CLIP-style image-text models. Flags keep OpenCLIP's names and defaults; with no "
        "data flags the embedded digits demo runs.",
        epilog=commands_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in config_mod.config_fields():
        group_name = f.metadata["group"]
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        names = [config_mod.flag_name(f.name), *f.metadata["argparse"].get("aliases", [])]
        groups[group_name].add_argument(*names, dest=f.name, **_argparse_kwargs(f))
    # Launchers add these: the DeepSpeed launcher passes --local_rank; torchrun may pass --local-rank.
    launcher = parser.add_argument_group("launcher (set by torchrun / deepspeed; not needed by hand)")
    launcher.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    return parser


def parse_train_args(argv: list[str]) -> tuple[config_mod.TrainConfig, dict[str, Any]]:
    """Return the resolved config and the launcher-only values (e.g. local_rank)."""
    for arg in argv:
        refused = arg.startswith("--") and config_mod.refused_family(arg)
        if refused:
            raise UserError(refused)
    values = vars(build_train_parser().parse_args(argv))
    launcher = {k: values.pop(k) for k in ("local_rank",) if k in values}
    return config_mod.resolve(values), launcher
