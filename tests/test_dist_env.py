"""Rank discovery from torchrun, DeepSpeed-launcher and SLURM environments."""

import pytest

from bigclip.dist import detect_launch, first_host


def test_torchrun_environment():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.source) == (3, 1, 8, "torchrun")


def test_deepspeed_launcher_local_rank_argument():
    # The deepspeed launcher sets RANK/WORLD_SIZE and passes --local_rank; LOCAL_RANK may be absent.
    launch = detect_launch({"RANK": "1", "WORLD_SIZE": "2"}, local_rank_arg=1)
    assert (launch.rank, launch.local_rank, launch.world_size) == (1, 1, 2)


def test_slurm_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NODELIST": "gpu[003-004,9]",
        "SLURM_JOB_ID": "1234",
    }
    launch = detect_launch(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.source) == (5, 1, 8, "slurm")
    assert launch.master_addr == "gpu003"
    assert launch.master_port == str(20000 + 1234)


def test_torchrun_inside_slurm_wins():
    # torchrun started by sbatch: torchrun's own variables describe this process, not SLURM's.
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_launch(env).source == "torchrun"


def test_single_process():
    launch = detect_launch({})
    assert (launch.rank, launch.world_size, launch.source) == (0, 1, "single")


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node01", "node01"),
        ("gpu[003-005]", "gpu003"),
        ("a[7,9],b1", "a7"),
        ("x-1,x-2", "x-1"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host
