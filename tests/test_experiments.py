"""launch/experiments/int8_switchback.sh runs its arms and prints the summary table."""

import os
import subprocess

import pytest
from helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow


# Extended tier: two arms of training (2 min); in CI SwitchBack's demo (test_demo.py) and kernels (test_switchback.py)
@pytest.mark.extended
def test_int8_switchback_experiment_runs_its_arms_and_summarises(tmp_path):
    out = subprocess.run(
        ["bash", "launch/experiments/int8_switchback.sh", str(tmp_path), "--", "--epochs", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=subprocess_env(ARMS="linear-fp32 SwitchBackLinearGlobal", OPTS="stableadamw"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    arms = ["linear-fp32-stableadamw", "SwitchBackLinearGlobal-stableadamw"]  # each arm x optimizer: a run
    for arm in arms:
        assert os.path.exists(tmp_path / arm / "metrics.jsonl"), arm
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line.split(" | ")[0][2:] in arms]
    assert sorted(line.split(" | ")[0][2:] for line in rows) == sorted(arms), out.stdout[-2000:]
    for line in rows:  # final loss, zero-shot top-1, samples/s: numbers
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2]) > 0 and 0 <= float(cells[3]) <= 1 and float(cells[4]) > 0, line
    # and one page overlays every arm's plots
    page = open(tmp_path / "report.html").read()
    assert all(f"<td>{arm}</td>" in page for arm in arms) and os.path.exists(tmp_path / "report.png")
    assert f"report: {tmp_path / 'report.html'} and {tmp_path / 'report.png'} (2 runs)" in out.stdout
    # a second call keeps finished arms and only summarises
    again = subprocess.run(["bash", "launch/experiments/int8_switchback.sh", str(tmp_path), "--", "--epochs", "1"],
                           cwd=REPO, capture_output=True, text=True, timeout=900,
                           env=subprocess_env(ARMS="linear-fp32", OPTS="stableadamw"))  # fmt: skip
    assert again.returncode == 0 and "linear-fp32-stableadamw: done before, kept" in again.stdout
