"""--aug-cfg: training augmentation settings as key=value pairs, with OpenCLIP's AugmentationCfg keys.

    scale=0.9::1.0  ratio=(0.75,1.33)  color_jitter=0.4  color_jitter_prob=0.8  gray_scale_prob=0.2
    re_prob=0.25  re_count=1  use_timm=true

Pairs (a::b, (a,b) or [a,b]) become tuples; true/false become booleans. `scale_range` and
`ratio_range` are accepted as other names for `scale` and `ratio`.
"""

from __future__ import annotations

from typing import Any

from bigclip.errors import UserError
from bigclip.flag_fields import parse_key_values

DEFAULTS: dict[str, Any] = {
    "scale": (0.9, 1.0),  # RandomResizedCrop area range
    "ratio": None,  # RandomResizedCrop aspect range (torchvision's 3/4..4/3 when None)
    "color_jitter": None,  # brightness, contrast, saturation[, hue]; one number means all three
    "color_jitter_prob": None,
    "gray_scale_prob": None,
    "re_prob": None,  # random erasing (timm only)
    "re_count": None,
    "use_timm": False,  # build the train transform with timm's create_transform
}
ALIASES = {"scale_range": "scale", "ratio_range": "ratio"}


def _error(key: str, value: Any, what: str) -> UserError:
    return UserError(f"--aug-cfg {key}={value}: {what}")


def parse_aug_cfg(items: list[str] | None) -> dict[str, Any]:
    """key=value strings from the command line -> validated dict (unknown keys are an error)."""
    return validate_aug_cfg(parse_key_values("--aug-cfg", items, "scale=0.9::1.0"))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _pair(key: str, value: Any) -> tuple[float, float]:
    if not (isinstance(value, tuple) and len(value) == 2 and all(map(_is_number, value)) and 0 < value[0] <= value[1]):
        raise _error(key, value, "expected two positive numbers low::high with low <= high")
    return float(value[0]), float(value[1])


def _probability(key: str, value: Any) -> float:
    if not (_is_number(value) and 0 <= value <= 1):
        raise _error(key, value, "expected a probability between 0 and 1")
    return float(value)


def validate_aug_cfg(cfg: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    """Check an already-parsed mapping (or parse a list of key=value strings); returns only given keys."""
    if cfg is None or isinstance(cfg, (list, tuple)):
        return parse_aug_cfg(cfg)
    out: dict[str, Any] = {}
    for raw_key, value in cfg.items():
        key = ALIASES.get(raw_key, raw_key)
        if key not in DEFAULTS:
            raise UserError(f"--aug-cfg {raw_key}: unknown key; use one of {', '.join(DEFAULTS)}")
        if value is None:
            out[key] = None
        elif key in ("scale", "ratio"):
            out[key] = _pair(raw_key, value)
        elif key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
            out[key] = _probability(raw_key, value)
        elif key == "re_count":
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise _error(raw_key, value, "expected a whole number >= 1")
            out[key] = value
        elif key == "use_timm":
            if not isinstance(value, bool):
                raise _error(raw_key, value, "expected true or false")
            out[key] = value
        elif key == "color_jitter":
            parts = value if isinstance(value, tuple) else (value,)
            if len(parts) not in (1, 3, 4) or not all(_is_number(p) and p >= 0 for p in parts):
                raise _error(raw_key, value, "expected one, three or four non-negative numbers")
            out[key] = tuple(float(p) for p in parts) if isinstance(value, tuple) else float(value)
    return out
