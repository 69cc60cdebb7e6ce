"""The config as it may be recorded (params.yaml, checkpoints, trackers, wandb's copy of the command line):
secrets redacted, URLs without credentials or signatures."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from bigclip.ckpt.storage import redact_options, redact_url
from bigclip.config.flags import TrainConfig


def scrub_argv(argv: list[str]) -> list[str]:
    """A command line that can be recorded (wandb stores it): --storage-options' value redacted like to_dict's,
    every URL without userinfo or query string."""
    out, redact_next = [], False
    for arg in argv:
        if redact_next:
            out.append(json.dumps(redact_options(arg)))
            redact_next = False
        elif arg == "--storage-options":
            out.append(arg)
            redact_next = True
        elif arg.startswith("--storage-options="):
            out.append("--storage-options=" + json.dumps(redact_options(arg.split("=", 1)[1])))
        else:
            out.append(" ".join(redact_url(word) or word for word in arg.split(" ")) if "://" in arg else arg)
    return out


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as a plain dict for params.yaml, checkpoints and trackers: secrets redacted."""
    values = dataclasses.asdict(cfg)
    values.pop("given", None)  # resolution's bookkeeping (which flags were typed), not a setting
    if values.get("storage_options"):
        values["storage_options"] = redact_options(values["storage_options"])
    for name in ("remote_sync", "resume", "logs", "train_data", "val_data"):
        if isinstance(values.get(name), str):
            values[name] = redact_url(values[name])
    return values
