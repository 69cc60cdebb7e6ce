"""The repository's sbatch templates, submitted as written to a one-node Slurm cluster started by the tests
(tests/slurm_cluster.py): CPU overrides go on the sbatch command line and in the environment.

- torchrun_per_node.sbatch trains test-tiny with 2 processes (the uninterrupted reference);
- srun_per_task.sbatch gets the preemption notice mid-run (USR1 to its batch shell, as `--signal=B:USR1@N`
  sends it), saves a final checkpoint, requeues itself and continues to the end with the reference's
  per-step losses;
- deepspeed_per_node.sbatch trains, and a job cancelled with scancel is not requeued and leaves only
  checkpoints that verify.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
from helpers import REPO, TINY_SYNTHETIC, free_port, read_metrics, step_losses, subprocess_env, wait_for_step
from slurm_cluster import FINAL_STATES, slurm  # noqa: F401  (pytest fixture)

from bigclip.ckpt import verify

# one cluster per test session: under pytest-xdist every Slurm test runs in the same worker (--dist loadgroup)
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

# 500 steps: 15-40 s of training on 2 CPUs, depending on the machine.
RUN = [*TINY_SYNTHETIC, "--epochs", "1", "--train-num-samples", "8000", "--log-every-n-steps", "10"]
STEPS = 8000 // (8 * 2)
# The templates ask for their own notice (`--signal=B:USR1@180`) 180 s before the time limit, which Slurm sends up
# to a minute early: with a 5-minute limit that is 2 minutes into a job, which a loaded machine reaches mid-run
# (the job then requeues itself, as a real time limit makes it). The jobs get 30 minutes, so that only the notices
# a test sends itself arrive.
TIME_LIMIT = "--time=30"


def _submit(slurm, tmp_path, template: str, sbatch: list[str], flags: list[str], **env: str) -> int:
    """Submit launch/slurm/<template> from the repository root (its documented place), output in tmp_path.
    The job's ranks meet on a free port (MASTER_PORT, which the templates honour): their default, 20000 + the
    job id, is 20001 for this cluster's first job, and a CI run once found that port taken (EADDRINUSE)."""
    env.setdefault("MASTER_PORT", str(free_port()))
    args = [f"--output={tmp_path}/%x-%j.out", *sbatch, f"launch/slurm/{template}", *flags]
    return slurm.submit(args, cwd=REPO, env=subprocess_env(**env))


def _output(tmp_path) -> str:
    return "".join(open(p).read() for p in glob.glob(str(tmp_path / "*.out")))


def _report(tmp_path, chars: int = 3000) -> str:
    """What a failed assertion shows: every error line of the job's output (a rank's `bigclip: error:` may sit
    pages above the end, under the other ranks' C++ stack frames), then the output's tail without the frames."""
    lines = [line for line in _output(tmp_path).splitlines() if "frame #" not in line]
    errors = [line for line in lines if "error" in line.lower() or "Error" in line][:20]
    return "\n".join(["error lines:", *errors, "tail:", "\n".join(lines)[-chars:]])


def _wait_for_step(slurm, job: int, run_dir: str, step: int, timeout: float = 240) -> bool:
    """Poll until the run logs `step`; False as soon as the job has ended without it, or at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wait_for_step(run_dir, step, timeout=1):
            return True
        if slurm.state(job) in FINAL_STATES:
            return wait_for_step(run_dir, step, timeout=1)
    return False


def wait_for_text(tmp_path, text: str, timeout: float = 60) -> bool:
    """Poll the job's output until it holds `text` (Slurm may flush it a moment after the job ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in _output(tmp_path):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("torchrun-template")
    job = _submit(slurm, tmp, "torchrun_per_node.sbatch", ["--cpus-per-task=2", TIME_LIMIT],
                  [*RUN, "--logs", str(tmp)], GPUS_PER_NODE="2", BIGCLIP_NAME="reference")  # fmt: skip
    assert slurm.wait(job, timeout=300) == "COMPLETED", _report(tmp)
    out = _output(tmp)
    assert "--resume latest: no committed checkpoint" in out and "starting fresh" in out
    assert "world: 2 rank(s) on 1 node(s), backend gloo, launched by torchrun" in out
    losses = step_losses(str(tmp / "reference"))
    assert sorted(losses) == list(range(10, STEPS + 1, 10)) + ([STEPS] if STEPS % 10 else [])
    return losses


def test_torchrun_template_trains_with_two_processes(reference):
    assert reference[STEPS] < reference[10]


def test_preempted_job_saves_requeues_itself_and_finishes_like_an_uninterrupted_run(slurm, tmp_path, reference):
    # Slurm sends `--signal=B:USR1@N` on slurmctld's 30 s tick, anywhere in the 30 s before limit-N: on a fast
    # machine that was before the first step or after the last. So the test sends the same signal to the
    # batch shell (`scancel --batch --signal=USR1`) once the run is training (the template's own notice, with
    # TIME_LIMIT, comes long after the run has ended).
    job = _submit(slurm, tmp_path, "srun_per_task.sbatch", ["--ntasks-per-node=2", "--cpus-per-task=1", TIME_LIMIT],
                  [*RUN, "--logs", str(tmp_path)], BIGCLIP_NAME="preempted")  # fmt: skip
    assert _wait_for_step(slurm, job, str(tmp_path / "preempted"), 100), _report(tmp_path)
    slurm.cancel(job, "--batch", "--signal=USR1")
    assert slurm.wait(job, timeout=420) == "COMPLETED", _report(tmp_path, 4000)
    out = _output(tmp_path)
    assert int(slurm.job_info(job)["Restarts"]) >= 1, _report(tmp_path)
    assert "preemption notice; the training step saves a final checkpoint and stops" in out
    assert "requeueing the job" in out
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM at step" in line]
    assert stopped and all("committed" in line and "no checkpoint" not in line for line in stopped), _report(tmp_path)
    assert "resumed from" in out and "saved by 2 ranks, resumed on" not in out  # same world size
    losses = step_losses(str(tmp_path / "preempted"))
    assert set(reference) <= set(losses)  # a resumed segment may log its first step off the 10-step grid
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), (step, losses[step], loss)


# Extended tier: in CI the torchrun template and a preempted job (above), DeepSpeed's launcher by
# test_engine_multiprocess.py
@pytest.mark.extended
def test_deepspeed_template_trains_and_a_cancelled_job_is_not_requeued(slurm, tmp_path):
    job = _submit(slurm, tmp_path, "deepspeed_per_node.sbatch", ["--cpus-per-task=2", TIME_LIMIT],
                  [*RUN, "--ds_config", "ds_configs/zero2.json", "--logs", str(tmp_path), "--save-every-n-steps", "20"],
                  GPUS_PER_NODE="2", BIGCLIP_NAME="cancelled", DS_ACCELERATOR="cpu")  # fmt: skip
    run_dir = str(tmp_path / "cancelled")
    assert _wait_for_step(slurm, job, run_dir, 60), _report(tmp_path)
    assert "launched by deepspeed launcher" in _output(tmp_path)
    slurm.cancel(job)
    assert slurm.wait(job, timeout=60) == "CANCELLED"
    # The batch shell heard the cancel (TERM) and says so before anything else it does: from then on it never
    # requeues the job, so what Slurm shows now is final.
    assert wait_for_text(tmp_path, "cancelled (SIGTERM to the batch shell); the job is not requeued"), _report(tmp_path)
    assert "requeueing the job" not in _output(tmp_path)
    info = slurm.job_info(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    assert max(r["step"] for r in read_metrics(run_dir)) < STEPS
    # What --resume latest could pick: only committed checkpoints, and each of them verifies.
    saved = glob.glob(os.path.join(run_dir, "checkpoints", "step_*"))
    committed = [d for d in saved if not d.endswith(".partial")]  # a local save is renamed when it commits
    assert committed
    for directory in committed:
        verify(directory)
