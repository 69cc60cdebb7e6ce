"""`kill -USR2 <pid>` on a training process prints every thread's Python stack and the run goes on.

The run is held at a known point by its data: its one shard comes from `pipe:cat FIFO`, so the process waits in
the read until the test writes the shard. The test waits for that event (the reader has opened the FIFO),
asks for the stacks, then feeds the shard: the stacks name the shard reader and the run trains to the end.
"""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest
from helpers import TRAIN_SCRIPT, read_metrics, start_job
from test_wds_stream import write_shards


def wait_for_reader(fifo: str, proc, limit_s: float = 600) -> int:
    """A write end of `fifo` once some process has opened it for reading (ENXIO until then)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            assert e.errno == errno.ENXIO, e
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never opened its shard"
        time.sleep(0.1)


@pytest.mark.slow
def test_sigusr2_prints_the_stacks_of_a_waiting_run_which_then_trains_on(tmp_path):
    shard = write_shards(tmp_path, [8])[0]
    fifo = str(tmp_path / "shard.fifo")
    os.mkfifo(fifo)
    args = ["--model", "test-tiny", "--dataset-type", "webdataset", "--train-data", f"pipe:cat {fifo}",
            "--train-num-samples", "8", "--batch-size", "4", "--epochs", "1", "--workers", "0",
            "--precision", "fp32", "--lr", "1e-3", "--log-every-n-steps", "1", "--logs", str(tmp_path),
            "--name", "held"]  # fmt: skip
    proc = start_job(TRAIN_SCRIPT, args)
    try:
        fd = wait_for_reader(fifo, proc)
        proc.send_signal(signal.SIGUSR2)
        os.set_blocking(fd, True)
        with open(shard, "rb") as f, os.fdopen(fd, "wb") as feed:
            feed.write(f.read())  # blocks until cat has taken it all: the dump came before
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "(most recent call first)" in err and "in iter_shard_samples" in err, err[-3000:]
    assert [r["step"] for r in read_metrics(str(tmp_path / "held")) if "loss" in r] == [1, 2]
