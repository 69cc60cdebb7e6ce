"""End-to-end training in one process: what a run writes, accumulation, resume, non-finite losses."""

import json
import os

import pytest
import torch
import yaml
from helpers import TINY_SYNTHETIC, read_metrics, step_losses

from bigclip import cli, loop, train
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.engine import build_engine
from bigclip.loss import ClipLoss
from bigclip.model import create_model


def run(tmp_path, name, *extra):
    code = cli.main([*TINY_SYNTHETIC, "--logs", str(tmp_path), "--name", name, *extra])
    assert code == 0
    return os.path.join(tmp_path, name)


def test_synthetic_run_writes_config_metrics_and_checkpoints(tmp_path):
    run_dir = run(tmp_path, "basic")
    params = yaml.safe_load(open(os.path.join(run_dir, "params.yaml")))
    assert params["batch_size"] == 8 and params["model"] == "test-tiny" and params["name"] == "basic"
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 17))  # 64 samples / 8 = 8 steps x 2 epochs
    for key in (
        "step",
        "epoch",
        "samples_seen",
        "loss",
        "lr",
        "logit_scale",
        "samples_per_s",
        "samples_per_s_per_gpu",
        "peak_memory_bytes",
    ):
        assert key in records[0], key
    assert records[-1]["samples_seen"] == 16 * 8
    for epoch in (1, 2):
        manifest = json.load(open(os.path.join(run_dir, "checkpoints", f"epoch_{epoch}", "manifest.json")))
        assert manifest["epoch"] == epoch and manifest["step"] == 8 * epoch
    assert "Train Epoch: 1" in open(os.path.join(run_dir, "out.log")).read()


def test_existing_run_name_is_refused(tmp_path, capsys):
    run(tmp_path, "taken", "--epochs", "1")
    assert cli.main([*TINY_SYNTHETIC, "--logs", str(tmp_path), "--name", "taken"]) == 2
    assert "already exists" in capsys.readouterr().err


def _tiny_engine(*flags):
    cfg = resolve(dict(model="test-tiny", dataset_type="synthetic", precision="fp32", **dict(flags)))
    torch.manual_seed(0)
    model = create_model("test-tiny")
    return build_engine(cfg.sections.engine, model, World())


def test_accumulation_gives_the_big_batch_gradient():
    """accum 4 x batch 8 == batch 32, in fp32 within 1e-5 (OpenCLIP's semantics: negatives span all
    micro-batches), including the logit-scale gradient, which is counted once."""
    torch.manual_seed(1)
    images = torch.randn(32, 3, 16, 16)
    texts = torch.randint(1, 250, (32, 32))
    texts[:, -1] = 258

    big = _tiny_engine()
    accum = _tiny_engine()
    accum.model.load_state_dict(big.model.state_dict())
    loss_fn = ClipLoss()

    loss_big, _ = loop.forward_backward(big, loss_fn, [(images, texts)], World())
    micro = [(images[i : i + 8], texts[i : i + 8]) for i in range(0, 32, 8)]
    loss_acc, _ = loop.forward_backward(accum, loss_fn, micro, World())

    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    grads_big = {n: p.grad for n, p in big.model.named_parameters() if p.grad is not None}
    grads_acc = {n: p.grad for n, p in accum.model.named_parameters() if p.grad is not None}
    assert grads_big.keys() == grads_acc.keys() and "logit_scale" in grads_big
    for name, g in grads_big.items():
        torch.testing.assert_close(grads_acc[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_accum_freq_run(tmp_path):
    run_dir = run(tmp_path, "accum", "--accum-freq", "2", "--epochs", "1")
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(records) == 4 and records[-1]["samples_seen"] == 64


@pytest.mark.slow
# In CI the linear case; SwitchBack's resume (its int8 state is none: same path) in the extended tier.
@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["linear", "switchback"])
def test_resume_continues_exactly(tmp_path, int8):
    """A run resumed from its epoch-1 checkpoint produces the uninterrupted run's losses (fp32, CPU); with int8
    SwitchBack MLPs too (their checkpoints are ordinary nn.Linear weights)."""
    flags = ["--lr-scheduler", "const"] + (["--use-bnb-linear", "SwitchBackLinearGlobal"] if int8 else [])
    full = step_losses(run(tmp_path, "full", *flags))
    # 'latest' with the same name: run one epoch, then continue the same run to epoch 2.
    run(tmp_path, "split", *flags, "--epochs", "1")
    run(tmp_path, "split", *flags, "--resume", "latest")
    resumed = step_losses(os.path.join(tmp_path, "split"))
    assert sorted(resumed) == sorted(full)
    for step in range(9, 17):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
    # An explicit checkpoint path into a new run directory gives the same losses.
    explicit = step_losses(
        run(tmp_path, "explicit", *flags, "--resume", os.path.join(tmp_path, "full", "checkpoints", "epoch_1"))
    )
    assert {s: explicit[s] for s in range(9, 17)} == pytest.approx({s: full[s] for s in range(9, 17)}, rel=1e-6)


def test_nonfinite_loss_is_reported_and_not_trained_on(tmp_path, monkeypatch, caplog):
    real_build = train.build_loss_fn
    calls = {"n": 0}

    def poisoned(cfg, world):
        loss_fn = real_build(cfg, world)

        def wrapped(*args):
            calls["n"] += 1
            out = loss_fn(*args)
            return out * float("nan") if calls["n"] == 3 else out

        return wrapped

    monkeypatch.setattr(train, "build_loss_fn", poisoned)
    run_dir = run(tmp_path, "nan", "--epochs", "1")
    records = read_metrics(run_dir)
    assert any(r.get("nonfinite_loss") == 1 and r["step"] == 2 for r in records)
    assert all(r["loss"] == r["loss"] for r in records if "loss" in r)  # no NaN was logged as a loss
    assert "step 2: non-finite loss; step skipped" in open(os.path.join(run_dir, "out.log")).read()


def test_save_most_recent_and_delete_previous(tmp_path):
    run_dir = run(tmp_path, "retention", "--epochs", "3", "--save-most-recent", "--delete-previous-checkpoint")
    names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert names == ["epoch_3", "epoch_latest"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--siglip", "--lock-image"],
        [
            "--opt",
            "timm/sgd",
            "--momentum",
            "0.9",
            "--grad-clip-norm",
            "1.0",
            "--lr-scheduler",
            "const-cooldown",
            "--epochs-cooldown",
            "1",
        ],
        ["--precision", "amp_bf16", "--grad-checkpointing", "--force-patch-dropout", "0.25"],
        ["--precision", "bf16", "--lock-text", "--lock-text-unlocked-layers", "1"],
    ],
    ids=["siglip-lock-image", "timm-sgd-cooldown", "amp-bf16-checkpointing", "pure-bf16-lock-text"],
)
def test_flag_combinations_train(tmp_path, flags):
    run_dir = run(tmp_path, "combo", "--epochs", "1", *flags)
    losses = step_losses(run_dir)
    assert len(losses) == 8 and all(v == v for v in losses.values())
