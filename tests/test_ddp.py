"""Real 2-process DDP over gloo through torchrun, against a single process on the same global batch."""

import os

import pytest
from helpers import TINY_SYNTHETIC, python_train, step_losses, torchrun

pytestmark = pytest.mark.slow


def test_two_process_ddp_matches_one_process_on_the_global_batch(tmp_path):
    """2 ranks x batch 8 with gathered features == 1 process x batch 16, step by step (fp32).

    With --gather-with-grad every rank's loss is the loss of the whole global batch, and DDP's gradient
    average then equals the single-process gradient, so the runs stay together step after step.
    """
    common = [*TINY_SYNTHETIC, "--epochs", "1", "--logs", str(tmp_path)]
    # --log-metric-every-n-steps: every record's loss is the mean over ranks (here every rank's is the global one)
    ddp = torchrun(
        2, [*common, "--name", "ddp", "--gather-with-grad", "--batch-size", "8", "--log-metric-every-n-steps", "1"]
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = python_train([*common, "--name", "single", "--batch-size", "16"])
    assert single.returncode == 0, single.stderr[-3000:]

    ddp_losses = step_losses(os.path.join(tmp_path, "ddp"))
    single_losses = step_losses(os.path.join(tmp_path, "single"))
    assert sorted(ddp_losses) == sorted(single_losses) == [1, 2, 3, 4]
    for step, loss in single_losses.items():
        assert ddp_losses[step] == pytest.approx(loss, rel=1e-4), step
    # Only rank 0 logs: one metrics line per step, and the throughput line names both numbers.
    assert "/s/gpu" in ddp.stdout + ddp.stderr


# Extended tier: in CI two-process DDP against one process (above), the local loss on ranks (test_loss_distributed.py)
@pytest.mark.extended
def test_two_process_local_loss_run_and_bad_flag_exit_code(tmp_path):
    common = [*TINY_SYNTHETIC, "--epochs", "1", "--logs", str(tmp_path)]
    ok = torchrun(2, [*common, "--name", "local", "--local-loss", "--gather-with-grad", "--accum-freq", "2"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert len(step_losses(os.path.join(tmp_path, "local"))) == 2
    bad = torchrun(2, [*common, "--name", "bad", "--precision", "fp8"])
    assert bad.returncode != 0
    # torchrun reports the failed children with its own traceback; bigclip's part is one line per rank, saying
    # which rank on which node.
    errors = sorted(line for line in bad.stderr.splitlines() if line.startswith("bigclip: error: "))
    assert len(errors) == 2 and all("--precision 'fp8'" in line for line in errors), errors
    assert errors[0].startswith("bigclip: error: rank 0 on ") and errors[1].startswith("bigclip: error: rank 1 on ")
    assert "bigclip/" not in "".join(line for line in bad.stderr.splitlines(True) if line.startswith("  File"))
