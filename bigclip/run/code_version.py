"""Which code ran: the git commit of the bigclip tree a run imported, and whether that tree had uncommitted
changes, recorded in params.yaml (git_commit, git_dirty) and shown by `bigclip report`. None for both where
bigclip is not a git checkout (an installed wheel) or git is not installed."""

from __future__ import annotations

import os
import subprocess

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bigclip/


def code_version(directory: str = PACKAGE_DIR) -> dict[str, str | bool | None]:
    """{"git_commit": full hash or None, "git_dirty": True/False or None} for the work tree holding
    `directory`. Dirty means tracked files differ from the commit (untracked files are not counted: run
    folders and caches often live inside a checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", directory, *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}
