"""Command line: `bigclip [train] FLAGS`, `python -m bigclip`, `python launch/train.py`, and the subcommands
(eval, models, export, plan, generate). The training flags' parser is in cli_args.py."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from bigclip import evaluate, export, generate, plan, report
from bigclip.ckpt.manager import ABANDONED
from bigclip.cli_args import build_train_parser, parse_train_args  # noqa: F401  (cli's public names)
from bigclip.dist import where
from bigclip.errors import UserError, first_line, user_message
from bigclip.model import get_model_config, list_models
from bigclip.preemption import StoppedAfterTraining, StoppedBeforeTraining
from bigclip.storage_options import redact_urls_in
from bigclip.train import run


def _cmd_models(argv: list[str]) -> int:
    for name in list_models():
        cfg = get_model_config(name)
        print(f"{name:16s} embed_dim={cfg.get('embed_dim')}")
    return 0


def _cmd_train(argv: list[str]) -> int:
    cfg, launcher = parse_train_args(argv)
    return run(cfg, local_rank=launcher.get("local_rank"))


def _cmd_export(argv: list[str]) -> int:
    return export.main(argv)


def _cmd_plan(argv: list[str]) -> int:
    return plan.main(argv)


SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _cmd_train,
    "eval": evaluate.main,
    "models": _cmd_models,
    "export": _cmd_export,
    "plan": _cmd_plan,
    "generate": generate.main,
    "report": report.main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug (any subcommand, or BIGCLIP_DEBUG=1): the traceback above an error's one line, for bug reports.
    # Training and eval also keep OpenCLIP's meaning of the flag (debug-level logging); the other
    # subcommands' parsers do not know it.
    debug = "--debug" in argv or os.environ.get("BIGCLIP_DEBUG", "") not in ("", "0")
    command = _cmd_train
    if argv and argv[0] in SUBCOMMANDS:
        command = SUBCOMMANDS[argv.pop(0)]
    if command not in (_cmd_train, evaluate.main):
        argv = [a for a in argv if a != "--debug"]
    here = where()  # "rank R on HOST" in a multi-process run: which of hundreds of ranks failed, and where
    try:
        return command(argv)
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
