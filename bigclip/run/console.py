"""What the run prints: OpenCLIP-style lines (`2024-01-01,12:00:00 | ...`) on stdout from rank 0 (or the first
rank of every node with --log-local), and the same lines in <run>/out.log; every line with URLs redacted."""

from __future__ import annotations

import logging
import os
import sys

from bigclip.storage_options import redact_urls_in

logger = logging.getLogger("bigclip")


class RedactUrls(logging.Filter):
    """Every line bigclip logs (its modules', the data loader workers') leaves URLs without credentials or
    query-string signatures: data URLs reach messages from many places (shard errors, skipped samples)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_urls_in(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def setup_console_logging(out_log: str | None, active: bool, debug: bool) -> None:
    level = logging.DEBUG if debug else logging.INFO
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(level if active else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s | %(message)s", datefmt="%Y-%m-%d,%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.addFilter(RedactUrls())
    logger.addHandler(console)
    if out_log and active:
        os.makedirs(os.path.dirname(out_log), exist_ok=True)
        file_handler = logging.FileHandler(out_log)
        file_handler.setFormatter(fmt)
        file_handler.addFilter(RedactUrls())
        logger.addHandler(file_handler)
