"""The report as files: a PNG of the grid, and one self-contained HTML page (the grid embedded as a data: URL, a
table of each run's config essentials above it) that opens without a server or network."""

from __future__ import annotations

import base64
import html
import io
from datetime import datetime

from bigclip.report.runs import Run

ESSENTIALS = ("model", "engine", "precision", "batch_size", "accum_freq", "epochs", "lr", "opt", "siglip")


def _essentials(run: Run) -> dict[str, str]:
    row = {"run": run.name, "folder": run.url}
    row["world"] = str(run.world) if run.world is not None else "?"
    for key in ESSENTIALS:
        if key in run.config:
            row[key] = str(run.config[key])
    last = next((r for r in reversed(run.records) if "step" in r), {})
    row["steps"] = str(last.get("step", "?"))
    row["samples seen"] = str(max((r.get("samples_seen", 0) for r in run.records), default=0))
    if run.resumed_at_steps:
        row["resumed at steps"] = ", ".join(map(str, run.resumed_at_steps))
    commit = run.config.get("git_commit")
    if commit:
        dirty = run.config.get("git_dirty")
        row["git commit"] = str(commit) + (" (with uncommitted changes)" if dirty else "")
    return row


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def html_page(runs: list[Run], png: bytes) -> str:
    rows = [_essentials(run) for run in runs]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(row.get(c, ''))}</td>" for c in columns) + "</tr>" for row in rows
    )
    title = "bigclip report: " + ", ".join(run.name for run in runs)
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }}
table {{ border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<table><tr>{head}</tr>{body}</table>
<img id="plots" alt="bigclip run plots" src="data:image/png;base64,{image}">
<p>Written {datetime.now().strftime("%Y-%m-%d %H:%M")} by <code>bigclip report</code>.</p>
</body>
</html>
"""
