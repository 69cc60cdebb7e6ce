"""--storage-options: the JSON of fsspec options (credentials, endpoints) for checkpoints, logs and data URLs."""

from __future__ import annotations

import json
from typing import Any

from bigclip.errors import UserError


def parse_storage_options(value: str | dict | None) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    try:
        options = json.loads(value)
    except ValueError:
        raise UserError(
            '--storage-options: not valid JSON; pass e.g. \'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\''
        ) from None
    if not isinstance(options, dict):
        raise UserError("--storage-options: expected a JSON object of fsspec options")
    return options
