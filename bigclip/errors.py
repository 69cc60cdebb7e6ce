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


def user_message(error: UserError) -> str:
    """A UserError's own message. One raised in a DataLoader worker reaches the loop re-raised by the loader as
    the same type with its worker's traceback for text ("Caught UserError in DataLoader worker process 0.
    Original Traceback ... bigclip.errors.UserError: <message>"): the message is its last line."""
    text = str(error).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.splitlines()[-1]
        prefix = f"{type(error).__module__}.{type(error).__name__}: "
        return last[len(prefix) :] if last.startswith(prefix) else last
    return text


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage and exits; bigclip wants one line naming the flag, then exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)
