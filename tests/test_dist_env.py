"""Rank discovery from torchrun, DeepSpeed-launcher and SLURM environments."""

import os

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


def test_launcher_names_and_where_a_rank_runs():
    import socket

    from bigclip.dist import launcher_name, where

    host = socket.gethostname()
    assert launcher_name({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert launcher_name({"RANK": "0", "WORLD_SIZE": "2", "CROSS_RANK": "1"}) == "deepspeed launcher"
    assert launcher_name({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}) == "srun"
    assert launcher_name({}) == "single process"
    assert where({"RANK": "5", "GROUP_RANK": "2"}) == f"rank 5 on {host} (node 2)"
    assert where({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_NODEID": "1"}) == f"rank 3 on {host} (node 1)"
    assert where({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == ""  # a one-task job step is a single process


def test_rank_ranges_in_the_per_node_lines():
    from bigclip.dist import _ranges

    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _ranges([3]) == "3"


@pytest.mark.slow
def test_dry_run_prints_world_engine_and_memory_plan_and_trains_nothing(tmp_path):
    from helpers import python_train

    out = python_train(["--model", "ViT-B-32", "--dataset-type", "synthetic", "--engine", "fsdp", "--dry-run",
                        "--sharded-init", "always", "--batch-size", "16", "--logs", str(tmp_path)])  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].endswith("ranks 0 (local world size 1), device cpu")
    assert lines[1] == "world: 1 rank(s) on 1 node(s), backend none, launched by single process"
    assert "model ViT-B-32: 151.3M parameters" in lines
    assert any(line.startswith("engine fsdp2:") and "built on meta" in line for line in lines)
    assert any(line.startswith("memory per GPU (fsdp, amp, adamw, 1 rank(s), micro-batch 16)") for line in lines)
    assert os.listdir(tmp_path) == []  # no run folder


def test_a_second_preemption_notice_does_not_cut_the_final_save_short():
    """Under a launcher the notice arrives twice (from Slurm, and forwarded by the launcher)."""
    import signal

    from bigclip.preemption import PreemptionFlag, StoppedBeforeTraining

    flag = PreemptionFlag()
    flag.install()
    try:
        with pytest.raises(StoppedBeforeTraining, match="SIGTERM received before training started"):
            os.kill(os.getpid(), signal.SIGTERM)  # before the first step: nothing to save, stop now
        flag.arm()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # would kill the process if not handled
        assert flag.requested and flag.signal_name == "SIGUSR1"
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_double_dash_after_the_subcommand_is_what_torchrun_needs_and_is_taken(capsys):
    """`torchrun ... -m bigclip train -- --logs DIR ...`: torchrun's own parser takes --logs unless `--` comes first,
    and hands the `--` on after the subcommand's name; bigclip takes the flags after it."""
    from bigclip import cli

    assert cli.main(["train", "--", "--model", "test-tiny", "--dataset-type", "synthetic", "--dry-run"]) == 0
    assert "test-tiny" in capsys.readouterr().out
