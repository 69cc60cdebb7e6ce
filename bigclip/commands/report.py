"""`bigclip report RUN [RUN ...] [-o FILE]`: the command over bigclip.report (one page of a run's plots, or
several runs overlaid)."""

from __future__ import annotations

from bigclip import report
from bigclip.commands import COMMANDS, Command

COMMANDS.register(
    "report",
    Command(report.main, "bigclip report RUN [RUN ...]"),
    help="one page of plots of a run, or of several overlaid (-o FILE.html|FILE.png)",
)
