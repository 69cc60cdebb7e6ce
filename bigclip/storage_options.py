"""--storage-options: the JSON of fsspec options (credentials, endpoints) for checkpoints, logs and data URLs."""

from __future__ import annotations

import json
import re
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


# A URL's user:password@ and its query string (a presigned URL's signature, a SAS token), wherever a URL appears
# in a line of text; "::" joins several data URLs in one flag, so a query ends there too (and before a ": ").
_URL_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/\s@]*@")
_URL_QUERY = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s?#]*)\?[^\s#]*?(?=::|#|:?(?:\s|$))")


def redact_urls_in(text: str) -> str:
    """`text` (a log line, an error message quoting --train-data or a shard URL) with every URL's credentials and
    query string replaced."""
    return _URL_QUERY.sub(r"\1?<redacted>", _URL_USERINFO.sub(r"\1***@", text))
