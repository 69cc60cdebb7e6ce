"""`bigclip report RUN [RUN ...] [-o FILE.html|FILE.png]`: one page of plots of one run or several overlaid, read
from run folders (local, or any fsspec URL such as a --remote-sync copy). Every run also writes its own report
(logs/<name>/report.html and .png) at each epoch's end and at its end.

    runs.py    a run folder read: metrics.jsonl (a truncated last line skipped), params.yaml, out.log's events
    figure.py  the grid: one panel per quantity some run recorded (matplotlib, imported only here)
    page.py    the PNG and the self-contained HTML page
"""

from __future__ import annotations

import logging
import os
import posixpath

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


class RunReports:
    """A training run's own report (report.html and .png in its folder), redrawn from its metrics.jsonl at each
    epoch's end and at its end, by the rank that writes the logs. Without matplotlib the run says so once and
    trains on; a report that fails to draw is a warning, never the run's end."""

    def __init__(self, run_dir: str, active: bool, disabled: bool):
        """`disabled`: --no-run-report; BIGCLIP_RUN_REPORT=0 in the environment does the same (the test suite sets
        it: its hundreds of short runs would each spend seconds drawing a page nobody opens)."""
        self.run_dir = run_dir
        self.enabled = active and not disabled and os.environ.get("BIGCLIP_RUN_REPORT", "1") != "0"
        self.page: str | None = None
        if self.enabled and matplotlib_missing():
            logger.info(f"{INSTALL_HINT} (or pass --no-run-report)")
            self.enabled = False

    def write(self) -> None:
        if not self.enabled:
            return
        try:
            self.page, _ = write_report([load_run(self.run_dir)], os.path.join(self.run_dir, "report.html"))
        except Exception as e:  # noqa: BLE001 — plots are a convenience: training goes on without them
            logger.warning(f"run report not written: {type(e).__name__}: {e}")


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
