"""From what the user typed to a validated TrainConfig: defaults < the embedded demo's preset (only when no data
is given) < ``--config file.yaml`` < command-line flags.

resolve() is the single place a value is checked, for YAML and flags alike: each flag's declared choices and
value check (bigclip/flag_fields.py), then every component's rules on its own slice (config/sections.py). Every
problem is one line that names the flag, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import yaml

from bigclip.config.flags import DEMO_PRESET, TrainConfig, config_fields, refused_family
from bigclip.data import reads_without_path
from bigclip.engine import ENGINES
from bigclip.errors import UserError
from bigclip.flag_fields import default_of, flag_name
from bigclip.loss import LOSSES
from bigclip.registry import Registry


def resolve(cli_values: dict[str, Any]) -> TrainConfig:
    """Apply the precedence chain to the flags the user actually typed and return a validated config."""
    yaml_values = load_yaml(cli_values["config"]) if cli_values.get("config") else {}
    explicit = {**yaml_values, **cli_values}
    values = {f.name: default_of(f) for f in config_fields()}
    # The embedded demo: no data named, and no --dataset-type that makes its own (synthetic).
    demo = explicit.get("train_data") is None and not reads_without_path(explicit.get("dataset_type", "auto"))
    if demo:
        values.update(DEMO_PRESET)
    values.update(explicit)
    _apply_selectors(values, explicit)
    cfg = TrainConfig(**values, demo=demo, given=tuple(sorted(explicit)))
    reject_unsupported(explicit)
    check_values(cfg)
    cfg.sections  # noqa: B018  (builds every component's slice: each checks its own rules, idle flags included)
    return cfg


def _selectors() -> dict[str, dict[str, str]]:
    """Flags that pick a registered name of another option, as OpenCLIP's and DeepSpeed's launch lines do:
    option -> {flag: the name it picks} (--siglip: --loss siglip; --ds_config FILE, --deepspeed: --engine
    deepspeed). Each registered entry declares its own (selected_by)."""
    return {
        "engine": {flag: name for name, cls in ENGINES.items() for flag in cls.selected_by},
        "loss": {flag: name for name, family in LOSSES.items() for flag in family.selected_by},
    }


def _shown(name: str) -> str:
    """How a flag is shown in messages: its first spelling (--ds_config, as DeepSpeed's users type it)."""
    field = next(f for f in config_fields() if f.name == name)
    return (field.metadata["argparse"].get("aliases") or [flag_name(name)])[0]


def _apply_selectors(values: dict[str, Any], explicit: dict[str, Any]) -> None:
    for option, selectors in _selectors().items():
        chosen_by: str | None = None
        for flag, name in selectors.items():
            if not values.get(flag):
                continue
            if explicit.get(option, name) != name:
                raise UserError(
                    f"{_shown(flag)} selects the {name} {option} but {flag_name(option)} is {explicit[option]}; "
                    f"drop one of them"
                )
            if chosen_by is not None and values[option] != name:
                raise UserError(
                    f"{_shown(chosen_by)} selects the {values[option]} {option} but {_shown(flag)} selects "
                    f"{name}; drop one of them"
                )
            values[option], chosen_by = name, flag


def reject_unsupported(explicit: dict[str, Any]) -> None:
    for f in config_fields():
        why = f.metadata.get("unsupported")
        if why and f.name in explicit and explicit[f.name] != f.default:
            raise UserError(f"{flag_name(f.name)}: not supported yet ({why})")


def check_values(cfg: TrainConfig) -> None:
    """Each flag's declared choices (a registry or a tuple) and value check (bigclip/flag_fields.py)."""
    for f in config_fields():
        value, choices, check = getattr(cfg, f.name), f.metadata.get("choices"), f.metadata.get("check")
        if isinstance(choices, Registry) and value is not None:
            choices.entry(value)
        elif choices is not None and value is not None and value not in choices:
            raise UserError(f"{flag_name(f.name)} {value!r}: choose one of {', '.join(choices)}")
        problem = check(value) if check is not None else None
        if problem:
            raise UserError(f"{flag_name(f.name)} {value!r}: {problem}")


def load_yaml(path: str) -> dict[str, Any]:
    """Read a --config file: a mapping of option names (dashes or underscores) to values."""
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: file not found; pass a YAML file of option: value lines")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"--config {path}: not valid YAML{where}; fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    fields = {f.name: f for f in config_fields()}
    out = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        refused = refused_family(flag_name(name))
        if refused:
            raise UserError(f"--config {path}: {refused}")
        if name not in fields or name == "config":
            raise UserError(f"--config {path}: unknown option '{key}'; see `bigclip --help` for names")
        expected = _yaml_type_problem(fields[name], value)
        if expected:
            raise UserError(f"--config {path}: {key}: {value!r} is not {expected}; fix the value or remove the line")
        out[name] = value
    return out


# A field's annotation (a string: `from __future__ import annotations`) -> what a YAML value may be.
_YAML_TYPES = {
    "str": (("a string",), lambda v: isinstance(v, str)),
    "int": (("an integer",), lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": (("a number",), lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": (("true or false",), lambda v: isinstance(v, bool)),
    "list": (("a list",), lambda v: isinstance(v, list)),
    "dict": (("a mapping",), lambda v: isinstance(v, dict)),
    "None": (("null",), lambda v: v is None),
}


def _yaml_type_problem(field: dataclasses.Field, value: Any) -> str | None:
    """None when `value` fits the field's annotation, else what it should have been (a YAML file bypasses
    argparse's type conversion, so `model: null` must be caught here, not deep in the run)."""
    kinds = [re.sub(r"\[.*", "", part.strip()) for part in str(field.type).split("|")]
    if any(kind not in _YAML_TYPES for kind in kinds):
        return None  # Any, or a type this check does not describe
    if any(_YAML_TYPES[kind][1](value) for kind in kinds):
        return None
    return " or ".join(_YAML_TYPES[kind][0][0] for kind in kinds)
