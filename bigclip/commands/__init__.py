"""The subcommands of `bigclip`: one module each in this package, registered in COMMANDS, which both the
dispatch (cli.py) and `bigclip --help` read, so neither can list a command the other lacks.

A command module registers itself on import (`COMMANDS.register(name, Command(...))`); cli.py imports every
command module. This module imports none of them: command modules import the training parser (cli_args),
which reads COMMANDS for its help.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bigclip.registry import Registry


@dataclass(frozen=True)
class Command:
    run: Callable[[list[str]], int]  # argv after the command's name -> exit code
    usage: str  # "bigclip export CKPT OUT"
    keeps_debug: bool = False  # its parser takes --debug itself (train and eval: OpenCLIP's logging flag)


COMMANDS: Registry[Command] = Registry("bigclip SUBCOMMAND")
DEFAULT_COMMAND = "train"


def commands_help() -> str:
    """`bigclip --help`'s list of subcommands, from the registry."""
    names = sorted(COMMANDS.names(), key=lambda name: name != DEFAULT_COMMAND)  # the default first
    entries = [(COMMANDS.get(name).usage, COMMANDS.entry(name).help) for name in names]
    width = max((len(usage) for usage, _ in entries), default=0) + 2
    lines = ["subcommands:", *(f"  {usage:<{width}}{text}" for usage, text in entries)]
    lines += [
        "",
        "Errors are one line (exit code 2); add --debug to any command (or set BIGCLIP_DEBUG=1) for the traceback.",
    ]
    return "\n".join(lines)
