"""How a flag is declared: a field of the config slice of the component that owns it, with its help text, its
--help group, the registry or values it chooses from, the kind of number it must be, and argparse settings.

    @dataclass(frozen=True)
    class LoopConfig:
        batch_size: int = flag(64, "Batch size per process.", TRAIN, check=positive_int)   # owned: a flag
        precision: str = "amp"                     # borrowed: EngineConfig owns --precision, the loop reads it

Every flag has exactly one owner; the flat TrainConfig users type (config/flags.py) is the union of the owned
fields. The parser (cli_args.py), the YAML reader and the validator read these; a choice's names and their
help live in the registry that owns them, and --help shows them from there.

A flag that acts only beside other flags says so with `applies` (Applies: when, and where in words):

        unlocked_groups: int = flag(0, "...", MODEL, applies=Applies(lambda c: c.lock_image, "with --lock-image"))

set where it would do nothing, it is refused in one line naming it and where it applies (config/resolve.py),
never silently ignored. Rules that need more than the flags (the data source a path names, the model's towers,
the engine's layout) are their owner's checks.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bigclip.errors import UserError
from bigclip.registry import Registry

# The --help groups, in the order --help shows them.
GROUPS = DATA, MODEL, TRAIN, PREC, LOSS, CKPT, LOG, EVAL, DIST, MISC = (
    "data",
    "model",
    "training",
    "precision and memory",
    "loss",
    "checkpoints",
    "logging",
    "evaluation",
    "distributed",
    "other",
)

# A value check: None when the value is acceptable, else what it must be ("must be a positive integer").
Check = Callable[[Any], str | None]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def positive_int(v: Any) -> str | None:
    return None if _is_int(v) and v >= 1 else "must be a positive integer"


def non_negative_int(v: Any) -> str | None:
    return None if _is_int(v) and v >= 0 else "must be a non-negative integer"


def positive_seconds(v: Any) -> str | None:
    return None if _is_number(v) and 0 < v < float("inf") else "must be a positive number of seconds"


def unit_interval(v: Any) -> str | None:
    return None if _is_number(v) and 0 <= v < 1 else "must be in [0, 1)"


def non_negative_number(v: Any) -> str | None:
    return None if _is_number(v) and math.isfinite(v) and v >= 0 else "must be a non-negative number"


def optional(check: Check) -> Check:
    """The check for a value that may also be None (not given)."""
    return lambda v: None if v is None else check(v)


@dataclass(frozen=True)
class Applies:
    """Where a flag acts: `when(flags)` is true of the run's flags (the flat config: every flag by its field name);
    `where` says it in words for the refusal ("with --lock-image"). A flag may need several (all must hold)."""

    when: Callable[[Any], bool]
    where: str
    fix: str = "add that or drop the flag"


def flag(
    default: Any,
    help: str,
    group: str,
    *,
    choices: Registry | tuple | None = None,
    shows: Registry | None = None,
    check: Check | None = None,
    applies: Applies | tuple[Applies, ...] = (),
    **argparse_kwargs: Any,
) -> Any:
    """A flag its slice owns: its help text, --help group, choices (a registry, whose names and help --help shows,
    or a tuple), a registry --help shows that the owner checks itself (`shows`: a comma list, or a value with
    more names than the registry's), value check, where it acts when not everywhere (`applies`) and any extra
    argparse settings."""
    shows = shows if shows is not None else (choices if isinstance(choices, Registry) else None)
    meta = {
        "help": help,
        "group": group,
        "argparse": argparse_kwargs,
        "choices": choices,
        "shows": shows,
        "check": check,
        "applies": (applies,) if isinstance(applies, Applies) else tuple(applies),
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def unsupported(default: Any, help: str, group: str, why: str, **argparse_kwargs: Any) -> Any:
    """An OpenCLIP flag bigclip does not implement yet: setting it stops the run, never a silent no-op."""
    f = flag(default, f"{help} [not supported yet: {why}]", group, **argparse_kwargs)
    f.metadata = {**f.metadata, "unsupported": why}
    return f


def internal(default: Any) -> Any:
    """Set by resolution, not by users: no flag, no YAML key."""
    return field(default=default, metadata={"internal": True})


def is_flag(f: dataclasses.Field) -> bool:
    """A field declared with flag() (owned by its slice), not one borrowed from another slice."""
    return "help" in f.metadata


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def parse_value(text: str) -> Any:
    """A key=value flag's value: a::b pairs and [a, b] lists become tuples, true/false booleans, Python
    literals their value, anything else stays text."""
    text = text.strip()
    if "::" in text:
        return tuple(parse_value(part) for part in text.split("::"))
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return tuple(value) if isinstance(value, list) else value


def parse_key_values(flag_shown: str, items: list[str] | dict[str, Any] | None, example: str) -> dict[str, Any]:
    """key=value strings as typed (`--aug-cfg scale=0.9::1.0`), or a mapping as a YAML file gives it -> dict."""
    if isinstance(items, dict):
        return dict(items)
    parsed = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag_shown} {item}: expected key=value, e.g. {example}")
        parsed[key.strip()] = parse_value(text)
    return parsed
