"""The tests' preloaded launches (tests/preloaded.py, helpers.launch) against the real ones: a run forked from the
preloaded server gets the environment torchrun gives its ranks, ends as `python script` ends, stops a failed rank's
peers as torchrun does, and trains to the same losses as a fresh torchrun launch."""

import json
import os
import subprocess
import sys

import pytest
from helpers import (
    TINY_SYNTHETIC,
    preloaded_run,
    preloaded_server,
    run_training,
    step_losses,
    subprocess_env,
    torchrun,
    torchrun_cmd,
)

pytestmark = pytest.mark.slow  # the server's imports: ~6 s once per test process

SCRIPT = """
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
out = sys.argv[1]
with open(os.path.join(out, f"seen{os.environ.get('RANK', '')}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
               "file": __file__}, f)
what = sys.argv[2]
if what == "raise":
    raise ValueError("raised at top level")
if what == "exit":
    sys.exit(3)
if what == "rank1-hangs":
    if os.environ["RANK"] == "1":
        time.sleep(600)
    sys.exit(5)
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
"""

# Told apart on purpose: the port and error file are per launch, and without an agent rank 0 hosts the store.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def seen(folder, rank=""):
    with open(os.path.join(folder, f"seen{rank}.json")) as f:
        return json.load(f)


def test_ranks_get_the_environment_torchrun_gives(tmp_path, script):
    env = subprocess_env()
    real, ours = tmp_path / "real", tmp_path / "ours"
    real.mkdir(), ours.mkdir()
    proc = subprocess.run(
        torchrun_cmd(2, script, str(real), "ok"), env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert preloaded_run(script, [str(ours), "ok"], env, timeout=300, nproc=2).returncode == 0
    for rank in (0, 1):
        theirs, mine = seen(real, rank)["env"], seen(ours, rank)["env"]
        added = {k for k in theirs if env.get(k) != theirs[k]}
        assert added == {k for k in mine if env.get(k) != mine[k]}, rank
        assert {k: theirs[k] for k in added - PER_LAUNCH} == {k: mine[k] for k in added - PER_LAUNCH}
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "False" and theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_a_run_ends_as_python_script_ends(tmp_path, script):
    env = subprocess_env(BIGCLIP_PROBE="given")
    (tmp_path / "cwd").mkdir()
    ok = preloaded_run(script, [str(tmp_path), "ok"], env, timeout=120, cwd=str(tmp_path / "cwd"))
    assert ok.returncode == 0 and ok.stdout == "thread joined\natexit ran\n", ok  # threads joined before atexit
    what = seen(tmp_path)
    assert what["name"] == "__main__" and what["argv"] == [script, str(tmp_path), "ok"] and what["file"] == script
    assert what["path0"] == str(tmp_path) and what["cwd"] == str(tmp_path / "cwd")
    assert what["env"]["BIGCLIP_PROBE"] == "given" and "RANK" not in what["env"]

    raised = preloaded_run(script, [str(tmp_path), "raise"], env, timeout=120)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: raised at top level"), raised
    assert "Traceback (most recent call last)" in raised.stderr and raised.stdout == "atexit ran\n"
    assert preloaded_run(script, [str(tmp_path), "exit"], env, timeout=120).returncode == 3


def test_a_failed_rank_stops_its_peers_and_the_launch_fails_as_torchruns(tmp_path, script):
    """Rank 0 exits 5 while rank 1 sleeps 10 minutes: the peer is stopped (SIGTERM) and the launch's status is 1,
    torchrun's."""
    env = subprocess_env()
    proc = preloaded_run(script, [str(tmp_path), "rank1-hangs"], env, timeout=120, nproc=2)
    assert proc.returncode == 1, proc
    real = run_training(torchrun_cmd(2, script, str(tmp_path), "rank1-hangs"), timeout=120, env=env)
    assert real.returncode == 1, real.stderr[-3000:]


def test_a_run_whose_environment_a_preloaded_library_may_read_at_import_gets_a_server_started_in_it(tmp_path, script):
    env = subprocess_env()
    server = preloaded_server(env)
    same = subprocess_env(BIGCLIP_X="1", DS_ACCELERATOR="cpu", AWS_ENDPOINT_URL="http://127.0.0.1:9", RANK="3")
    assert preloaded_server(same) is server
    for variable in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRITON_INTERPRET", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR"):
        assert not server.serves(subprocess_env(**{variable: "9"})), variable
    other = subprocess_env(HF_HUB_OFFLINE="1")
    assert preloaded_run(script, [str(tmp_path), "ok"], other, timeout=120).returncode == 0
    assert preloaded_server(other) is not server and not server.alive
    assert seen(tmp_path)["env"]["HF_HUB_OFFLINE"] == "1"


def test_training_takes_the_same_steps_as_under_a_fresh_torchrun(tmp_path, monkeypatch):
    args = [*TINY_SYNTHETIC, "--workers", "1", "--logs", str(tmp_path)]
    ours = torchrun(2, [*args, "--name", "ours"])
    assert ours.returncode == 0 and ours.args[0] == "preloaded", ours.stderr[-3000:]
    monkeypatch.setenv("BIGCLIP_TEST_PRELOAD", "0")
    real = torchrun(2, [*args, "--name", "real"])
    assert real.returncode == 0 and real.args[0] == sys.executable, real.stderr[-3000:]
    losses = step_losses(str(tmp_path / "ours"))
    assert len(losses) == 8 and losses == step_losses(str(tmp_path / "real"))
