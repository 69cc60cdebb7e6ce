"""`bigclip report` and every run's own report.html/.png: drawn from real short runs (one, two overlaid, a resumed
one), checked by the figure's axes and series (not pixels); a run folder on the S3 server; a killed run's cut last
line; the page opened in headless Chromium."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import yaml
from helpers import REPO, TINY_SYNTHETIC, python_train, read_metrics
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)

from bigclip import cli
from bigclip.report import MAX_DRAWING_SHARE, RunReports, write_report
from bigclip.report.figure import build_figure
from bigclip.report.runs import load_run
from bigclip.run.code_version import code_version

# One test process for the module: the runs fixture (four short trainings, ~35 s) is made once, not per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("report-runs")]

TRAINING_PANELS = [
    "training loss by step",
    "training loss",
    "learning rate",
    "logit scale",
    "gradient norm",
    "throughput",
    "time waiting for data",
    "peak memory",
]
EVAL_PANELS = ["retrieval recall", "retrieval ranks", "validation loss"]


def train(logs, name: str, *flags: str) -> str:
    assert cli.main([*TINY_SYNTHETIC, "--val-num-samples", "16", "--logs", str(logs), "--name", name, *flags]) == 0
    return os.path.join(logs, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run a (batch 8, its own report drawn at the end), b (SigLIP, batch 4), c (one epoch, then resumed to two)."""
    logs = tmp_path_factory.mktemp("logs")
    os.environ["BIGCLIP_RUN_REPORT"] = "1"
    try:
        a = train(logs, "a")
    finally:
        os.environ["BIGCLIP_RUN_REPORT"] = "0"
    b = train(logs, "b", "--siglip", "--batch-size", "4")
    train(logs, "c", "--epochs", "1")
    c = train(logs, "c", "--resume", "latest")
    return {"a": a, "b": b, "c": c}


def axes_by_title(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def lines(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_a_run_reports_every_panel_it_has_data_for_and_only_those(runs):
    run = load_run(runs["a"])
    fig = build_figure([run])
    assert [ax.get_title() for ax in fig.axes] == [*TRAINING_PANELS, *EVAL_PANELS, "checkpoints"]
    axes = axes_by_title(fig)
    records = [r for r in read_metrics(runs["a"]) if "loss" in r]
    by_step = lines(axes["training loss by step"])
    assert set(by_step) == {"raw", "smoothed"}
    assert list(by_step["raw"].get_xdata()) == [r["step"] for r in records]
    assert list(by_step["raw"].get_ydata()) == [r["loss"] for r in records]
    assert list(lines(axes["learning rate"])["run"].get_ydata()) == [r["lr"] for r in records]
    evals = [r for r in read_metrics(runs["a"]) if "eval/val_loss" in r]
    recall = lines(axes["retrieval recall"])
    assert sorted(recall) == sorted(f"{d}_R@{k}" for d in ("image_to_text", "text_to_image") for k in (1, 5, 10))
    assert list(recall["image_to_text_R@5"].get_ydata()) == [r["eval/image_to_text_R@5"] for r in evals]
    # evaluations sit at the samples seen by their step
    assert list(recall["image_to_text_R@5"].get_xdata()) == [64, 128]
    assert list(lines(axes["validation loss"])["val_loss"].get_ydata()) == [r["eval/val_loss"] for r in evals]
    # two checkpoints, each with the loop's pause and its commit time, as out.log says
    checkpoints = lines(axes["checkpoints"])
    assert (
        len(checkpoints["loop paused (s)"].get_xdata()) == 2 and len(checkpoints["save to commit (s)"].get_xdata()) == 2
    )
    # the run drew its own report at its end: the page embeds the PNG beside it
    page = open(os.path.join(runs["a"], "report.html")).read()
    png = open(os.path.join(runs["a"], "report.png"), "rb").read()
    assert base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)) == png
    assert "<td>test-tiny</td>" in page and "<td>ddp</td>" in page and "<td>fp32</td>" in page
    # which code ran: params.yaml records the checkout's commit (and whether it had changes); the page shows it
    params = yaml.safe_load(open(os.path.join(runs["a"], "params.yaml")))
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert params["git_commit"] == head and isinstance(params["git_dirty"], bool)
    assert f"<td>{head}" in page


def test_code_version_of_a_checkout(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    assert code_version(str(tmp_path)) == {"git_commit": None, "git_dirty": None}  # not a checkout
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "out.log").write_text("untracked: a run folder inside the checkout\n")
    assert code_version(str(tmp_path)) == {"git_commit": head.strip(), "git_dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_version(str(tmp_path)) == {"git_commit": head.strip(), "git_dirty": True}


def test_runs_overlay_on_the_same_axes_aligned_on_samples_seen(runs):
    a, b = load_run(runs["a"]), load_run(runs["b"])
    fig = build_figure([a, b])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [*TRAINING_PANELS[:4], "logit bias", *TRAINING_PANELS[4:], *EVAL_PANELS, "checkpoints"]
    loss = lines(axes_by_title(fig)["training loss"])
    assert set(loss) == {"a smoothed", "b smoothed"}
    # b takes batches of 4: twice the steps of a, the same samples
    assert list(loss["a smoothed"].get_xdata()) == list(range(8, 129, 8))
    assert list(loss["b smoothed"].get_xdata()) == list(range(4, 129, 4))
    assert set(lines(axes_by_title(fig)["logit bias"])) == {"b"}  # only the SigLIP run has a bias
    html, png = write_report([a, b], str(os.path.join(os.path.dirname(runs["a"]), "both.png")))
    assert html.endswith("both.html") and os.path.getsize(png) > 10_000


def test_a_resumed_run_marks_where_it_resumed(runs):
    c = load_run(runs["c"])
    assert c.resumed_at_steps == [8]
    axes = axes_by_title(build_figure([c]))
    marker = lines(axes["training loss by step"])["resumed at step 8"]
    assert list(marker.get_xdata()) == [8, 8]
    assert list(lines(axes["training loss"])["resumed at step 8"].get_xdata()) == [64, 64]
    raw = lines(axes["training loss by step"])["raw"]
    assert list(raw.get_xdata()) == list(range(1, 17))  # both invocations' steps, in one run


def test_a_killed_runs_cut_last_line_is_left_out(runs, tmp_path):
    killed = tmp_path / "killed"
    shutil.copytree(runs["a"], killed)
    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"time": 1.0, "step": 17, "lo')  # the run died mid-write
    run = load_run(str(killed))
    assert [r for r in run.records if "loss" in r] == [r for r in read_metrics(runs["a"]) if "loss" in r]
    assert [ax.get_title() for ax in build_figure([run]).axes][:2] == TRAINING_PANELS[:2]


def test_a_run_folder_on_s3_reports_like_the_local_one(runs, s3, s3_bucket, tmp_path):  # noqa: F811
    url = f"s3://{s3_bucket}/runs/a"
    s3.fs().put(runs["a"], url, recursive=True)
    local, remote = build_figure([load_run(runs["a"])]), build_figure([load_run(url)])
    assert [ax.get_title() for ax in remote.axes] == [ax.get_title() for ax in local.axes]
    for mine, theirs in zip(local.axes, remote.axes):
        for x, y in zip(mine.get_lines(), theirs.get_lines()):
            assert list(x.get_ydata()) == list(y.get_ydata()), mine.get_title()
    # the command line, to a report on the store itself
    assert cli.main(["report", url, "-o", f"s3://{s3_bucket}/reports/a.html"]) == 0
    assert s3.fs().cat(f"{s3_bucket}/reports/a.png")[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_report_arguments_are_one_line(runs, tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bigclip: error: {tmp_path / 'nothing'}: no metrics.jsonl there; name a run folder (logs/<name>)"
    )
    assert cli.main(["report", runs["a"], "-o", str(tmp_path / "r.txt")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bigclip: error: -o {tmp_path / 'r.txt'}: name an .html or a .png file (both are written)"
    )
    assert not os.listdir(tmp_path)


def test_a_runs_report_is_redrawn_between_epochs_only_within_its_share_of_time(runs, tmp_path, monkeypatch):
    """The first epoch's end draws; a later epoch's end draws only once the time since the last draw is the draw's
    cost over MAX_DRAWING_SHARE; the end always draws. The clock's readings are given: the draw itself is real."""
    monkeypatch.setenv("BIGCLIP_RUN_REPORT", "1")
    run_dir = shutil.copytree(runs["b"], tmp_path / "b")
    wait = 1 / MAX_DRAWING_SHARE  # after a draw that cost 1 s
    readings = iter([0, 0, 1, 1 + wait - 0.5, 30, 31, 31 + wait, 31 + wait, 32 + wait])
    reports = RunReports(str(run_dir), active=True, disabled=False, clock=lambda: next(readings))
    drawn = []
    for final in (False, False, True, False):
        page = run_dir / "report.html"
        page.unlink(missing_ok=True)
        reports.write(final=final)
        drawn.append(page.is_file())
    assert drawn == [True, False, True, True]
    assert next(readings, None) is None  # every reading was asked for: no draw went unmeasured
    assert reports.page == str(page)


def test_no_run_report_and_a_missing_matplotlib_leave_training_alone(tmp_path):
    off = python_train([*TINY_SYNTHETIC, "--epochs", "1", "--logs", str(tmp_path), "--name", "off", "--no-run-report"],
                       BIGCLIP_RUN_REPORT="1")  # fmt: skip
    assert off.returncode == 0, off.stderr[-3000:]
    assert not os.path.exists(tmp_path / "off" / "report.html")
    # an environment without matplotlib (an import of it fails): the run trains and says once how to get reports
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    from helpers import REPO

    bare = python_train([*TINY_SYNTHETIC, "--logs", str(tmp_path), "--name", "bare"], BIGCLIP_RUN_REPORT="1",
                        PYTHONPATH=os.pathsep.join([str(blocker.parent), REPO]))  # fmt: skip
    assert bare.returncode == 0, bare.stderr[-3000:]
    said = (bare.stdout + bare.stderr).count("run reports need matplotlib: pip install 'bigclip[report]'")
    assert said == 1 and not os.path.exists(tmp_path / "bare" / "report.html")
    assert max(r["step"] for r in read_metrics(str(tmp_path / "bare"))) == 16  # both epochs trained


def test_the_page_opens_in_headless_chromium_and_shows_the_plots(runs, tmp_path):
    """A real browser (Debian's chromium, which .ci/run installs): the page loads without a console error and
    its screenshot holds the plots (matplotlib's first colour, in the curves, over thousands of pixels)."""
    from PIL import Image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Chromium is not installed: apt-get install chromium (as .ci/run does)"
    page = os.path.join(runs["a"], "report.html")
    shot = tmp_path / "shot.png"
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1600,1800",
         f"--screenshot={shot}", "--enable-logging=stderr", "--v=0", f"file://{page}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CONSOLE" not in out.stderr and "Uncaught" not in out.stderr, out.stderr[-3000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16).reshape(-1, 3)  # (getdata: gone in Pillow 14)
    blue = int((np.abs(pixels - np.array([31, 119, 180])) < 30).all(axis=1).sum())
    assert blue > 5000, blue
