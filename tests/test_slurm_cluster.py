"""The Slurm test cluster itself: a batch job with a 2-task srun step runs to COMPLETED."""

from __future__ import annotations

import pytest
from slurm_cluster import slurm  # noqa: F401  (pytest fixture)

# one cluster per test session: under pytest-xdist every Slurm test runs in the same worker (--dist loadgroup)
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

JOB = """\
#!/bin/bash
#SBATCH --job-name=smoke
#SBATCH --ntasks=2
#SBATCH --time=1
#SBATCH --output=out-%j.txt
echo "batch $SLURM_JOB_ID ntasks=$SLURM_NTASKS"
srun --ntasks=2 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $(hostname -s)"'
"""


def test_two_task_job_completes(slurm, tmp_path):
    (tmp_path / "job.sh").write_text(JOB)
    job = slurm.submit(["job.sh"], cwd=str(tmp_path))
    assert slurm.wait(job, timeout=120) == "COMPLETED"  # a guard, not a measurement
    info = slurm.job_info(job)
    assert info["ExitCode"] == "0:0" and info["NumTasks"] == "2", info
    lines = (tmp_path / f"out-{job}.txt").read_text().splitlines()
    assert lines[0] == f"batch {job} ntasks=2"
    assert sorted(lines[1:]) == [f"task {i} of 2 on {slurm.host}" for i in range(2)]


def test_submit_error_carries_sbatch_stderr(slurm, tmp_path):
    with pytest.raises(RuntimeError, match="(?i)invalid partition"):
        slurm.submit(["--partition=nope", "--wrap=true"], cwd=str(tmp_path))
