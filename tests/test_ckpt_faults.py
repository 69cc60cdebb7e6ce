"""Checkpoints under storage faults: a store that hangs, a store that refuses connections, a job killed in the
middle of an upload. The S3-protocol server runs behind tests/tcp_proxy.py, which can freeze or refuse while
the server keeps its objects."""

import json
import os
import subprocess
import time

import pytest
from helpers import TINY_SYNTHETIC, TRAIN_SCRIPT, read_metrics, subprocess_env, torchrun_cmd
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)
from tcp_proxy import TcpProxy

from bigclip.ckpt.manifest import MANIFEST


@pytest.fixture
def proxy(s3):
    p = TcpProxy(("127.0.0.1", s3.port))
    yield p
    p.close()


def committed(fs, prefix: str) -> list[str]:
    return sorted(p.split("/")[-2] for p in fs.glob(f"{prefix}/checkpoints/*/{MANIFEST}"))


def wait_for(predicate, proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def last_step(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return max((r["step"] for r in read_metrics(run_dir) if "loss" in r), default=0)


def test_training_goes_on_while_the_store_hangs(s3, s3_bucket, proxy, tmp_path):
    """2 ranks, a checkpoint every 5 steps to S3; the store hangs (no byte answered) in the middle of the run:
    steps keep being logged through the freeze, the saves that fall due meanwhile are deferred and counted
    (ckpt/skipped), and after the store answers again the run ends with committed checkpoints."""
    run_dir = str(tmp_path / "logs" / "frozen")
    flags = [*TINY_SYNTHETIC, "--train-num-samples", "1600", "--epochs", "1", "--lr-scheduler", "const",
             "--logs", str(tmp_path / "logs"), "--name", "frozen", "--remote-sync", f"s3://{s3_bucket}/runs",
             "--save-every-n-steps", "5", "--log-every-n-steps", "1"]  # fmt: skip
    env = subprocess_env(**s3.env(AWS_ENDPOINT_URL=proxy.endpoint))
    proc = subprocess.Popen(torchrun_cmd(2, TRAIN_SCRIPT, "--", *flags), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_for(lambda: last_step(run_dir) >= 12, proc, 180, "step 12")
        proxy.freeze()
        frozen_at = time.time()
        frozen_step = last_step(run_dir)
        wait_for(lambda: last_step(run_dir) >= frozen_step + 40, proc, 120, "40 steps during the freeze")
        thawed_at = time.time()
        proxy.thaw()
        out, err = proc.communicate(timeout=240)
    finally:
        proxy.thaw()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    records = read_metrics(run_dir)
    during = [r["step"] for r in records if "loss" in r and frozen_at < r["time"] < thawed_at]
    assert len(during) >= 40  # the loop never waited on the frozen store
    skipped = [r["ckpt/skipped"] for r in records if "ckpt/skipped" in r]
    # every 5 steps a save fell due behind the hung upload: ~8 in 40 steps, counted in the step records
    assert skipped == sorted(skipped) and skipped[-1] >= 5, skipped
    log = open(os.path.join(run_dir, "out.log")).read()
    assert log.count("deferred:") >= 1 and "the deferred save, now that the previous one has finished" in log
    names = committed(s3.fs(), f"{s3_bucket}/runs/frozen")
    assert "epoch_1" in names and len(names) >= 3, names  # before, after the freeze, and the final one
    manifest = json.loads(s3.fs().cat(f"{s3_bucket}/runs/frozen/checkpoints/epoch_1/{MANIFEST}"))
    assert manifest["step"] == 100 and manifest["world_size"] == 2
