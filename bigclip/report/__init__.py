"""`bigclip report RUN [RUN ...] [-o FILE.html|FILE.png]`: one page of plots of one run or several overlaid, read
from run folders (local, or any fsspec URL such as a --remote-sync copy). Every run also writes its own report
(logs/<name>/report.html and .png) at its first epoch's end, at later epochs' ends while drawing stays a small share
of the run's time, and at its end.

    runs.py    a run folder read: metrics.jsonl (a truncated last line skipped), params.yaml, out.log's events
    figure.py  the grid: one panel per quantity some run recorded (matplotlib, imported only here)
    page.py    the PNG and the self-contained HTML page
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Callable

import fsspec

from bigclip.ckpt.storage import write_durably
from bigclip.errors import OneLineErrorParser, UserError
from bigclip.report.figure import build_figure
from bigclip.report.page import html_page, png_bytes
from bigclip.report.runs import Run, load_run
from bigclip.storage_options import parse_storage_options

logger = logging.getLogger(__name__)

INSTALL_HINT = "run reports need matplotlib: pip install 'bigclip[report]'"


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def _write(url: str, data: bytes, storage_options: dict) -> None:
    """Whole or not at all: a local file is written beside and renamed into place (a report being replaced
    stays readable); object stores make an upload visible only once complete."""
    if "://" not in url:
        write_durably(os.path.abspath(url), data)
        return
    with fsspec.open(url, "wb", **storage_options) as f:
        f.write(data)


def write_report(runs: list[Run], out: str, storage_options: dict | None = None) -> tuple[str, str]:
    """The page at `out` (.html or .png) and its twin beside it (.png or .html); returns (html, png)."""
    stem, ext = posixpath.splitext(out)
    if ext not in (".html", ".png"):
        raise UserError(f"-o {out}: name an .html or a .png file (both are written)")
    png = png_bytes(build_figure(runs))
    page, image = f"{stem}.html", f"{stem}.png"
    _write(image, png, storage_options or {})
    _write(page, html_page(runs, png).encode("utf-8"), storage_options or {})
    return page, image


# A redraw costs about a second on a CPU core (matplotlib's layout and PNG) whatever the epoch's length: the demo's
# epochs take about as long, so a redraw at every epoch's end doubled its time (62 s, of which 26 s drawing). Between
# epochs the page is redrawn only once the time since the last draw is at least the last draw's cost over this share.
MAX_DRAWING_SHARE = 0.05


class RunReports:
    """A training run's own report (report.html and .png in its folder), redrawn from its metrics.jsonl by the rank
    that writes the logs: at the first epoch's end, at a later epoch's end when drawing stays within
    MAX_DRAWING_SHARE of the time since the last draw, and always at the end (`final`). Without matplotlib the run
    says so once and trains on; a report that fails to draw is a warning, never the run's end."""

    def __init__(self, run_dir: str, active: bool, disabled: bool, clock: Callable[[], float] = time.monotonic):
        """`disabled`: --no-run-report; BIGCLIP_RUN_REPORT=0 in the environment does the same (the test suite sets
        it: its hundreds of short runs would each spend seconds drawing a page nobody opens)."""
        self.run_dir = run_dir
        self.enabled = active and not disabled and os.environ.get("BIGCLIP_RUN_REPORT", "1") != "0"
        self.page: str | None = None
        self.clock = clock
        self._next_draw = float("-inf")  # the clock's reading from which an epoch's end redraws
        if self.enabled and matplotlib_missing():
            logger.info(f"{INSTALL_HINT} (or pass --no-run-report)")
            self.enabled = False

    def write(self, final: bool = False) -> None:
        if not self.enabled or (not final and self.clock() < self._next_draw):
            return
        start = self.clock()
        try:
            self.page, _ = write_report([load_run(self.run_dir)], os.path.join(self.run_dir, "report.html"))
        except Exception as e:  # noqa: BLE001 — plots are a convenience: training goes on without them
            logger.warning(f"run report not written: {type(e).__name__}: {e}")
        end = self.clock()
        self._next_draw = end + (end - start) / MAX_DRAWING_SHARE


def _parser() -> OneLineErrorParser:
    p = OneLineErrorParser(prog="bigclip report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders (logs/<name>), local or URLs; several are overlaid")
    p.add_argument("-o", "--output", default="report.html", help="FILE.html or FILE.png: both are written")
    p.add_argument("--storage-options", default=None, help="fsspec options (JSON) for URLs")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    options = parse_storage_options(args.storage_options)
    if matplotlib_missing():
        raise UserError(INSTALL_HINT)
    runs = [load_run(url, options) for url in args.runs]
    page, image = write_report(runs, args.output, options)
    print(f"report: {page} and {image} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
