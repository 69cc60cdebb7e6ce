"""Errors a user can cause and fix: the CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """A bad flag value, a missing file, an unreadable checkpoint: something the user can fix.

    The message must name the thing (flag, file or URL) and say what to do.
    """
