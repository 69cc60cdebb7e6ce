"""Multi-node launches without a cluster: two "nodes" on 127.0.0.1, one process each.

Two torchrun agents (c10d rendezvous) and two DeepSpeed launchers (no-ssh mode, a node rank each) train
test-tiny with the per-step losses of one `torchrun --nproc_per_node 2` run; a node that never arrives stops
the other within a bounded time, with one line saying what it waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import REPO, TINY_SYNTHETIC, free_port, step_losses, subprocess_env, torchrun

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
# The DeepSpeed engine (ZeRO-2, fp32) for all three launches, so that only the launch differs.
RUN = [*TINY_SYNTHETIC, "--epochs", "1", "--ds_config", "ds_configs/zero2.json"]
ENV = subprocess_env(DS_ACCELERATOR="cpu")


def _start(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], logs: list, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
    return outputs


def _two_nodes(tmp_path, node_cmd) -> tuple[list[subprocess.Popen], list[str]]:
    logs = [open(tmp_path / f"node{n}.log", "w+") for n in range(2)]
    procs = [_start(node_cmd(n), logs[n]) for n in range(2)]
    outputs = _finish(procs, logs)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    return procs, outputs


def _assert_same_losses(run_dir, reference: dict[int, float]) -> None:
    losses = step_losses(run_dir)
    assert sorted(losses) == sorted(reference) and len(losses) == 4  # 64 samples / (8 x 2 ranks)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), (step, losses[step], loss)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of one torchrun with 2 processes."""
    logs = tmp_path_factory.mktemp("reference")
    out = torchrun(2, [*RUN, "--logs", str(logs), "--name", "one"], DS_ACCELERATOR="cpu")
    assert out.returncode == 0, out.stderr[-3000:]
    return step_losses(str(logs / "one"))


def test_two_torchrun_agents_with_c10d_rendezvous_train_like_one(tmp_path, reference):
    port = free_port()

    def node(n: int) -> list[str]:
        return [*TORCHRUN, "--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "loopback",
                "launch/train.py", "--", *RUN, "--logs", str(tmp_path), "--name", "agents"]  # fmt: skip

    _, outputs = _two_nodes(tmp_path, node)
    _assert_same_losses(tmp_path / "agents", reference)
    log = "".join(outputs)
    assert "world: 2 rank(s) on 2 node(s), backend gloo, launched by torchrun" in log


@pytest.mark.extended  # in CI the two-node rendezvous with torchrun (above)
def test_two_deepspeed_launchers_without_ssh_train_like_one(tmp_path, reference):
    port = free_port()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")

    def node(n: int) -> list[str]:
        return [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(n),
                "--master_addr", "127.0.0.1", "--master_port", str(port),
                "launch/train.py", *RUN, "--logs", str(tmp_path), "--name", "launchers"]  # fmt: skip

    _, outputs = _two_nodes(tmp_path, node)
    _assert_same_losses(tmp_path / "launchers", reference)
    log = "".join(outputs)
    # rank 0's startup lines: one per node, then the world
    assert "(node 0): ranks 0 (local world size 1), device cpu" in log
    assert "(node 1): ranks 1 (local world size 1), device cpu" in log
    assert "world: 2 rank(s) on 2 node(s), backend gloo, launched by deepspeed launcher" in log


@pytest.mark.extended  # waits out a rendezvous timeout; in CI the two-node rendezvous (above)
def test_a_node_that_never_arrives_stops_the_other_with_one_line(tmp_path):
    """DeepSpeed launcher (no rendezvous of its own): bigclip's --dist-timeout bounds the wait. torchrun: the
    agents' rendezvous (join_timeout) does, before any rank starts."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = free_port()
    alone = subprocess.run(
        [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0", "--master_addr", "127.0.0.1",
         "--master_port", str(port), "launch/train.py", *RUN, "--logs", str(tmp_path), "--name", "alone",
         "--dist-timeout", "4"],  # fmt: skip
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert alone.returncode != 0, alone.stdout[-2000:]  # within the guard: --dist-timeout 4 s, not the default 30 min
    errors = [line for line in (alone.stdout + alone.stderr).splitlines() if line.startswith("bigclip: error:")]
    assert len(errors) == 1, alone.stderr[-3000:]
    assert "rank 0 on " in errors[0] and "(node 0)" in errors[0]
    assert f"the process group of 2 ranks did not form within --dist-timeout 4 s at 127.0.0.1:{port}" in errors[0]

    agent = subprocess.run(
        [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
         "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "alone", "--rdzv_conf", "join_timeout=4",
         "launch/train.py", "--", *RUN, "--logs", str(tmp_path), "--name", "alone-agent"],  # fmt: skip
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert agent.returncode != 0, agent.stderr[-2000:]
    assert "RendezvousTimeoutError" in agent.stderr
    assert not os.path.exists(tmp_path / "alone-agent")  # no rank ever started
