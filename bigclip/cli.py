"""Command line: `bigclip [train] FLAGS`, `python -m bigclip`, `python launch/train.py`, and the subcommands
(bigclip/commands/: one module each, registered in COMMANDS). The training flags' parser is in cli_args.py."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import NoReturn

from bigclip.ckpt.manager import ABANDONED
from bigclip.cli_args import build_train_parser, parse_train_args  # noqa: F401  (cli's public names)
from bigclip.commands import COMMANDS, DEFAULT_COMMAND
from bigclip.commands import eval as _eval  # noqa: F401  (each command module registers its command)
from bigclip.commands import export as _export  # noqa: F401
from bigclip.commands import fetch as _fetch  # noqa: F401
from bigclip.commands import generate as _generate  # noqa: F401
from bigclip.commands import models as _models  # noqa: F401
from bigclip.commands import plan as _plan  # noqa: F401
from bigclip.commands import report as _report  # noqa: F401
from bigclip.commands import train as _train  # noqa: F401
from bigclip.dist import where
from bigclip.errors import UserError, first_line, user_message
from bigclip.preemption import StoppedAfterTraining, StoppedBeforeTraining
from bigclip.storage_options import redact_urls_in


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug (any subcommand, or BIGCLIP_DEBUG=1): the traceback above an error's one line, for bug reports.
    # Training and eval also keep OpenCLIP's meaning of the flag (debug-level logging); the other
    # subcommands' parsers do not know it.
    debug = "--debug" in argv or os.environ.get("BIGCLIP_DEBUG", "") not in ("", "0")
    command = COMMANDS.get(argv.pop(0) if argv and argv[0] in COMMANDS.names() else DEFAULT_COMMAND)
    if argv[:1] == ["--"]:  # `torchrun ... -m bigclip train -- --logs DIR`: the `--` torchrun's parser needs
        argv.pop(0)
    if not command.keeps_debug:
        argv = [a for a in argv if a != "--debug"]
    here = where()  # "rank R on HOST" in a multi-process run: which of hundreds of ranks failed, and where
    try:
        return command.run(argv)
    except UserError as e:
        if debug:
            traceback.print_exc()
        _say(f"bigclip: error: {here + ': ' if here else ''}{user_message(e)}")
        return 2
    except BrokenPipeError:  # `bigclip models | head`: the reader has gone; nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        _say("bigclip: interrupted")
        return 130
    except (StoppedBeforeTraining, StoppedAfterTraining) as e:
        _say(f"bigclip: {here + ': ' if here else ''}{e}")
        return 143
    except Exception as e:
        if here:  # the traceback follows; this line says whose it is
            _say(f"bigclip: {here} failed: {type(e).__name__}: {first_line(e)}")
        raise


def run_cli() -> NoReturn:
    """The `bigclip` console script."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """The entry points' exit. When a checkpoint save was given up unfinished, its threads may hang in a
    store's socket for good: flush what was said and exit without joining them."""
    if ABANDONED.is_set():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _say(line: str) -> None:
    """One write per line: ranks sharing a terminal or log file must not run their lines together (print
    writes the text and the newline separately). URLs in it lose their credentials and signatures."""
    sys.stderr.write(redact_urls_in(line) + "\n")
    sys.stderr.flush()
