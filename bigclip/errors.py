"""Errors a user can cause and fix: the CLI prints them as one line and exits non-zero."""

import argparse


class UserError(Exception):
    """A bad flag value, a missing file, an unreadable checkpoint: something the user can fix.

    The message must name the thing (flag, file or URL) and say what to do.
    """


def first_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one short line for a user-facing message: its type, then its first line of text
    (library errors can span pages; the one line has to name what went wrong)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:limit]}" if text else type(error).__name__


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage and exits; bigclip wants one line naming the flag, then exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)
