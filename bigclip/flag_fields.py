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

set where it would do nothing, it is never silently ignored (config/sections.py checks every rule): `idle` says so
in one line naming it and where it applies. How loudly follows from whose flag it is: one of OpenCLIP's
(OPENCLIP_FLAGS) is accepted as open_clip_train accepts it, with one warning at the run's start ("the flag does
nothing in this run"), so OpenCLIP's command lines run unchanged; bigclip's own flags are refused. Rules that need
more than the flags (the data source a path names, the model's towers, the engine's layout) are their owner's
checks, and call `idle` alike; a rule that only a bigclip flag triggers (--loss-impl naive beside --loss-dist-impl
ring) is a plain refusal, as is an engine's flag under another engine.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from bigclip.errors import UserError
from bigclip.registry import Registry

logger = logging.getLogger("bigclip")

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


# Every flag of OpenCLIP's open_clip_train/params.py: main's (4.2.0.dev, commit 89fb801) and 3.3.0's (--horovod,
# --torchscript, --trace). A run OpenCLIP accepts must run here too, so where one of these would do nothing it
# warns (idle) instead of stopping the run.
OPENCLIP_FLAGS = frozenset(
    """
accum-freq audio-ext audio-fill audio-fusion audio-int16-normalize audio-layer-decay audio-multiprocessing-context
audio-trunc audio-zeroshot-audio-key audio-zeroshot-class-key audio-zeroshot-dataset
audio-zeroshot-multiprocessing-context audio-zeroshot-split audio-zeroshot-target-key audio-zeroshot-template
audio-zeroshot-workers aug-cfg batch-size beta1 beta2 bucket-chunk bucket-pool bucket-prefetch-pools cache-dir
coca-caption-loss-weight coca-contrastive-loss-weight copy-codebase csv-caption-key csv-img-key csv-separator
dataset-resampled dataset-type ddp-static-graph debug delete-previous-checkpoint device dist-backend dist-url
distill-model distill-pretrained epochs epochs-cooldown eps force-context-length force-custom-text force-image-size
force-naflex-vision force-patch-dropout force-quick-gelu fsdp fsdp-checkpoint fsdp-no-reshard-after-forward
fsdp-offload-cpu gather-with-grad grad-checkpointing grad-clip-norm horovod image-interpolation image-key
image-layer-decay image-mean image-resize-mode image-std imagenet-v2 imagenet-val json-text-key json-text-key-probs
length-bucketing local-loss lock-image lock-image-freeze-bn-stats lock-image-unlocked-groups lock-text
lock-text-freeze-layer-norm lock-text-unlocked-layers log-every-n-steps log-local log-metric-every-n-steps logs
loss-dist-impl lr lr-cooldown-end lr-cooldown-power lr-scheduler max-image-pixels model momentum naflex-batch-divisor
naflex-loss-scale naflex-max-text-tokens naflex-max-tokens-per-batch naflex-num-train-image-tokens
naflex-pad-multiple naflex-patch-size-probs naflex-patch-sizes naflex-seq-len-probs naflex-seq-lens name
no-set-device-rank opt opt-fallback-list opt-kwargs precision pretrained pretrained-audio pretrained-image
remote-sync remote-sync-frequency remote-sync-protocol report-to resume save-frequency save-most-recent seed siglip
skip-scheduler text-key text-layer-decay text-pad-multiple text-pooler-own-group torchcompile torchcompile-backend
torchcompile-mode torchcompile-strategy torchscript trace train-data train-data-upsampling-factors
train-loss-ema-samples train-num-samples use-bn-sync use-bnb-linear use-naflex val-data val-frequency
val-num-samples val-retrieval-chunk-size val-retrieval-precision visual-layer-decay wandb-notes wandb-project-name
warmup wd wd-exclude workers zeroshot-frequency
""".split()
)

IDLE = "the flag does nothing in this run"
# The warnings of idle OpenCLIP flags, collected while the flags are checked (config/sections.py) so the run says
# each once at its start; None outside such a check (where the model is built): said there, by the main process.
_notes: ContextVar[list[str] | None] = ContextVar("idle_flag_notes", default=None)


def is_openclip_flag(name: str) -> bool:
    """Whether the flag of field `name` is one of OpenCLIP's (by its own spelling)."""
    return flag_name(name).removeprefix("--") in OPENCLIP_FLAGS


def idle(name: str, where: str, fix: str = "drop the flag", shown: str | None = None) -> None:
    """The flag of field `name` is set where it does nothing (`where`: where it applies, and why not here). One of
    OpenCLIP's warns in one line, once; bigclip's own is refused in one line: "{flag}: {where}; {fix}"."""
    shown = shown or flag_name(name)
    if not is_openclip_flag(name):
        raise UserError(f"{shown}: {where}; {fix}")
    line = f"{shown}: {where}; {IDLE}"
    notes = _notes.get()
    if notes is not None:
        # one line per flag: where two rules find it idle (--json-text-key-probs on synthetic data and without
        # --json-text-key), the first said is enough
        if not any(note.startswith(f"{shown}:") for note in notes):
            notes.append(line)
    elif _main_process():
        logger.warning(line)


def _main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@contextlib.contextmanager
def noting_idle_flags() -> Iterator[list[str]]:
    """Collect the warnings `idle` gives inside the block (the run says them at its start) instead of logging."""
    notes: list[str] = []
    token = _notes.set(notes)
    try:
        yield notes
    finally:
        _notes.reset(token)


def idle_where_inapplicable(flags: Any, given: frozenset[str] | set[str]) -> None:
    """Each flag the user set (`given`: YAML or command line) to anything but its default, where a rule of its
    declared `applies` does not hold, is idle: warned or refused in one line naming it and where it applies.
    Defaults and the demo preset's values are not the user's, so they never trip this."""
    for f in dataclasses.fields(flags):
        if f.name not in given or getattr(flags, f.name) == default_of(f):
            continue
        for rule in f.metadata.get("applies", ()):
            if not rule.when(flags):
                shown = (f.metadata["argparse"].get("aliases") or [flag_name(f.name)])[0]
                idle(f.name, f"only applies {rule.where}", rule.fix, shown=shown)
                break


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
