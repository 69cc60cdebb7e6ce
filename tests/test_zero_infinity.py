"""ZeRO-Infinity (ds_configs/zero3_nvme.json): parameters swapped to a local folder through DeepSpeed's async I/O
(libaio), on this CPU machine, and what DeepSpeed cannot do exactly here refused in one line."""

from __future__ import annotations

import json
import os

import pytest
from helpers import REPO, TINY_SYNTHETIC, step_losses, torchrun
from test_engine_multiprocess import FP32_RTOL, assert_same_run, run_worker

from bigclip import cli
from bigclip.config import resolve
from bigclip.errors import UserError
from bigclip.model import get_model_config

NVME = os.path.join(REPO, "ds_configs", "zero3_nvme.json")
OFFLOAD = os.path.join(REPO, "ds_configs", "zero3_offload.json")
MIB = 1 << 20


def _variant(tmp_path, name: str, change) -> str:
    ds = json.load(open(NVME))
    change(ds["zero_optimization"])
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def test_what_deepspeed_cannot_do_exactly_here_is_refused_in_one_line(tmp_path):
    folder = str(tmp_path)
    flags = {"ds_config": NVME, "precision": "amp"}
    assert resolve({**flags, "zero_nvme_path": folder}).zero_nvme_path == folder
    optimizer_on_nvme = _variant(
        tmp_path, "optimizer_on_nvme", lambda z: z["offload_optimizer"].update(device="nvme", nvme_path=folder)
    )
    stage_2 = _variant(tmp_path, "stage_2", lambda z: z.update(stage=2))
    refused = [
        ({**flags}, 'nvme_path is "auto"; pass --zero-nvme-path DIR'),
        ({**flags, "zero_nvme_path": str(tmp_path / "missing")}, "missing: not a writable folder"),
        ({**flags, "zero_nvme_path": folder, "precision": "fp32"}, "stored in bf16 by DeepSpeed whatever --precision"),
        ({**flags, "zero_nvme_path": folder, "ds_config": optimizer_on_nvme}, "cannot resume the checkpoints"),
        ({**flags, "zero_nvme_path": folder, "ds_config": stage_2}, "swaps to NVMe only at zero_optimization.stage 3"),
    ]
    for values, says in refused:
        with pytest.raises(UserError) as e:
            resolve(values)
        assert says in str(e.value) and "\n" not in str(e.value), (values, str(e.value))


def test_a_refused_run_exits_2_with_one_line_and_writes_nothing(tmp_path, capfd):
    logs = tmp_path / "logs"
    assert cli.main([*TINY_SYNTHETIC, "--logs", str(logs), "--ds_config", NVME, "--precision", "amp"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("bigclip: error: ") and "--zero-nvme-path" in err and "\n" not in err
    assert not logs.exists()


# Extended tier: builds DeepSpeed's async I/O op and trains ZeRO-3 twice (5+ min); in CI ZeRO-3 with CPU offload
# (test_engine_multiprocess.py)
@pytest.mark.extended
@pytest.mark.slow
def test_parameters_swapped_to_nvme_train_and_resume_like_zero3_offload(tmp_path):
    # test-tiny with a 512-wide image tower: its MLP weights' bf16 partitions on 2 ranks are 1 MiB each, the
    # smallest tensor DeepSpeed swaps (aio's minimum); everything smaller stays in host memory.
    arch = get_model_config("test-tiny")
    arch["vision_cfg"].update(width=512, head_width=64)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": arch, "preprocess_cfg": {}}))
    nvme = tmp_path / "swap"
    nvme.mkdir()
    common = ["--model", f"local-dir:{model_dir}", "--dataset-type", "synthetic", "--train-num-samples", "32",
              "--batch-size", "4", "--epochs", "2", "--precision", "amp", "--workers", "0", "--lr", "1e-3",
              "--log-every-n-steps", "1", "--seed", "0", "--logs", str(tmp_path)]  # fmt: skip

    def run(name: str, *flags: str) -> dict[int, float]:
        out = torchrun(2, [*common, "--name", name, *flags], timeout=900, DS_ACCELERATOR="cpu")
        assert out.returncode == 0, out.stderr[-3000:]
        return step_losses(str(tmp_path / name))

    swapped = run("nvme", "--ds_config", NVME, "--zero-nvme-path", str(nvme), "--save-frequency", "1")
    # DeepSpeed's swap files, one per swapped parameter partition and rank: the 2 blocks' two MLP matrices
    for rank in (0, 1):
        folder = nvme / "zero_stage_3" / "bfloat16params" / f"rank{rank}"
        sizes = sorted(os.path.getsize(folder / f) for f in os.listdir(folder))
        assert len(sizes) == 4 and sizes[0] >= MIB, (rank, sizes)
    # The same arithmetic as keeping the parameters in host memory (bf16 either way), step for step
    assert run("host_memory", "--ds_config", OFFLOAD) == swapped
    resume = str(tmp_path / "nvme" / "checkpoints" / "epoch_1")
    resumed = run("resumed", "--ds_config", NVME, "--zero-nvme-path", str(nvme), "--resume", resume)
    assert resumed == {step: loss for step, loss in swapped.items() if step > 4} and resumed  # 4 steps per epoch


# Extended tier: DeepSpeed's CPU Adam is JIT-built on first use (~100 s of CPU); in CI the same offload of
# parameters and optimizer state with bigclip's torch AdamW matches DDP (test_engine_multiprocess.py)
@pytest.mark.extended
@pytest.mark.slow
def test_the_shipped_offload_config_steps_with_deepspeeds_cpu_adam_like_ddp(tmp_path):
    """ds_configs/zero3_offload.json as shipped: DeepSpeed's own CPU Adam over offloaded parameters and optimizer
    state gives DDP's losses and gradient norms step for step (test-tiny, fp32, 2 ranks)."""
    tiny = {"model": "test-tiny", "batch_size": 8}
    runs = [
        {"name": "ddp", "steps": 5, "config": tiny},
        {"name": "zero3_offload", "steps": 5, "config": {**tiny, "ds_config": OFFLOAD}},
    ]
    r = run_worker(tmp_path, runs)
    assert r["zero3_offload"]["optimizer"] == "DeepSpeedCPUAdam", r["zero3_offload"]["optimizer"]
    assert_same_run(r["zero3_offload"], r["ddp"], FP32_RTOL)
