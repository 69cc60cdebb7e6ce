"""Distillation (--distill-model / --distill-pretrained) against OpenCLIP's DistillClipLoss, the oracle.

- the loss (CLIP loss + distillation term): values and gradients equal to open_clip's on 1 process and on
  2 gloo ranks, for every --local-loss / --gather-with-grad combination, with the naive and the fused CLIP loss;
- OpenCLIP's accumulation with a teacher: accum 4 x batch 8 gives the batch-32 gradient (OpenCLIP refuses
  --accum-freq with distillation; bigclip's feature cache makes it exact);
- a run with a teacher: it is frozen, in eval mode, not saved in the checkpoint; flags that cannot work are one
  line. The engine matrix (DDP, FSDP2, ZeRO-1/2/3, sharded teachers) is in test_engine_multiprocess.py.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
from helpers import fork_ranks, free_port, read_metrics
from open_clip.loss import DistillClipLoss as OpenCLIPDistillClipLoss
from test_loss_chunked import LargestTensor
from test_loss_reference import unit_features

from bigclip import cli, loop
from bigclip.build import build_teacher
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.engine import build_engine
from bigclip.loss import ClipLoss, DistillClipLoss, TeacherOutputs, distill
from bigclip.model import create_model

BATCH, DIM = 6, 8
FLAGS = [(False, False), (True, False), (False, True), (True, True)]
# float64 features: the naive path computes in float64; the fused CLIP loss accumulates in float32
TOL = {"naive": 1e-10, "chunked": 1e-6}


def _features(world: int):
    image, text = unit_features(world * BATCH, DIM, seed=3, dtype=torch.float64)
    t_image, t_text = unit_features(world * BATCH, DIM, seed=4, dtype=torch.float64)
    return image, text, t_image, t_text


def _ours_and_theirs(impl, local_loss, gather_with_grad, rank, world, image, text, teacher):
    """(loss, d image, d text, d scale) of bigclip's and of OpenCLIP's loss on the same features."""
    out = []
    for which in ("ours", "theirs"):
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
        if which == "ours":
            contrastive = ClipLoss(local_loss, gather_with_grad, rank, world, impl=impl)
            loss = DistillClipLoss(contrastive, local_loss, gather_with_grad, rank, world, impl=impl)(
                x, y, scale, teacher=TeacherOutputs(*teacher)
            )
        else:
            oc = OpenCLIPDistillClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world)
            loss = sum(oc(x, y, scale, *teacher))
        loss.backward()
        out.append((loss.detach(), x.grad, y.grad, scale.grad))
    return out


@pytest.fixture(autouse=True)
def small_row_blocks(monkeypatch):
    """A few rows per block, so the blocked distillation term really runs block by block at these sizes."""
    monkeypatch.setattr(distill, "ROW_BLOCK_ELEMENTS", 20)


@pytest.mark.parametrize("impl", ["naive", "chunked"])
def test_loss_and_gradients_equal_openclips_distill_clip_loss(impl):
    image, text, t_image, t_text = _features(1)
    teacher = (t_image, t_text, torch.tensor(30.0, dtype=torch.float64))
    ours, theirs = _ours_and_theirs(impl, False, False, 0, 1, image, text, teacher)
    tol = TOL[impl]
    for a, b, what in zip(ours, theirs, ("loss", "d image", "d text", "d scale")):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=what)
    # the distillation term is really there: it moves the loss away from the CLIP loss alone
    clip_alone = ClipLoss(impl=impl)(image, text, torch.tensor(12.0, dtype=torch.float64))
    assert ours[0] - clip_alone > 0.1


def _two_rank_worker(rank: int, world: int, port: int, result_dir: str) -> None:
    distill.ROW_BLOCK_ELEMENTS = 20  # each rank sets it: the fixture patches the test process alone
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )  # fmt: skip
    try:
        image, text, t_image, t_text = _features(world)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        teacher = (t_image[mine], t_text[mine], torch.tensor(30.0, dtype=torch.float64))
        errors = {}
        for impl in ("naive", "chunked"):
            for flags in FLAGS:
                ours, theirs = _ours_and_theirs(impl, *flags, rank, world, image[mine], text[mine], teacher)
                for i, what in enumerate(("loss", "d image", "d text", "d scale")):
                    a, b = ours[i], theirs[i]
                    if i == 3 and impl != "naive":
                        # bigclip's fused losses give every rank the mean of OpenCLIP's per-rank scale gradients
                        # (only that mean reaches the weights once DDP averages); the distillation term is naive
                        b = b.clone()
                        dist.all_reduce(b)
                        b /= world
                        a = a.clone()
                        dist.all_reduce(a)
                        a /= world
                    errors[f"{impl} local={flags[0]} gwg={flags[1]} {what}"] = float((a - b).abs().max())
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(errors, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_loss_and_gradients_equal_openclips_on_two_ranks(tmp_path):
    fork_ranks(_two_rank_worker, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(errors) == 2 * len(FLAGS) * 4
        worst = {k: v for k, v in errors.items() if v > TOL[k.split()[0]]}
        assert not worst, (rank, worst)


@pytest.mark.slow
def test_the_blocked_term_never_holds_the_logit_matrix(monkeypatch):
    """Forward and backward at N = 4096: every tensor any operator creates is at most one block of rows (the naive
    term needs the N x N logits of both models)."""
    monkeypatch.setattr(distill, "ROW_BLOCK_ELEMENTS", 256 * 4096)
    n = 4096
    image, text = (t.requires_grad_() for t in unit_features(n, 16, seed=0))
    t_image, t_text = unit_features(n, 16, seed=1)
    scale = torch.tensor(10.0, requires_grad=True)
    teacher = TeacherOutputs(t_image, t_text, torch.tensor(20.0))
    with LargestTensor() as probe:
        distill.distill_term_blocked(image, text, scale, teacher).backward()
    assert probe.largest <= 256 * 4096, f"a tensor of {probe.largest} elements appeared (N^2 = {n * n})"
    with LargestTensor() as probe:
        distill.distill_term(image, text, scale, teacher).backward()
    assert probe.largest == n * n  # the probe sees the naive term's matrices


def test_autocast_does_not_lower_the_blocked_terms_precision():
    image, text, t_image, t_text = (t.float() for t in _features(1))
    teacher = TeacherOutputs(t_image, t_text, torch.tensor(30.0))
    scale = torch.tensor(12.0)
    plain = distill.distill_term_blocked(image, text, scale, teacher)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = distill.distill_term_blocked(image, text, scale, teacher)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, plain)


def _engine_and_teacher(tmp_path):
    torch.manual_seed(3)
    torch.save(create_model("test-tiny").state_dict(), tmp_path / "teacher.pt")
    cfg = resolve(
        dict(model="test-tiny", dataset_type="synthetic", precision="fp32", distill_model="test-tiny",
             distill_pretrained=str(tmp_path / "teacher.pt"))
    )  # fmt: skip
    torch.manual_seed(0)
    engine = build_engine(cfg.sections.engine, create_model("test-tiny"), World())
    return cfg, engine, build_teacher(cfg.sections.model, cfg.sections.engine, World(), engine)


@pytest.mark.slow
def test_accumulation_with_a_teacher_gives_the_big_batch_gradient(tmp_path):
    cfg, big, teacher = _engine_and_teacher(tmp_path)
    _, accum, _ = _engine_and_teacher(tmp_path)
    accum.model.load_state_dict(big.model.state_dict())
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    torch.manual_seed(1)
    images, texts = torch.randn(32, 3, 16, 16), torch.randint(1, 250, (32, 32))
    loss_fn = DistillClipLoss(ClipLoss(), False, False, 0, 1)
    loss_big, _ = loop.forward_backward(big, loss_fn, [(images, texts)], World(), teacher=teacher)
    micro = [(images[i : i + 8], texts[i : i + 8]) for i in range(0, 32, 8)]
    loss_acc, _ = loop.forward_backward(accum, loss_fn, micro, World(), teacher=teacher)
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    for (name, p), q in zip(big.model.named_parameters(), accum.model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    plain, _ = loop.forward_backward(big, ClipLoss(), [(images, texts)], World())
    assert loss_big > plain + 0.1  # the teacher's term is in it


RUN = ["--model", "test-tiny", "--dataset-type", "synthetic", "--train-num-samples", "32", "--batch-size", "8",
       "--epochs", "1", "--precision", "fp32", "--workers", "0", "--lr", "1e-3"]  # fmt: skip


@pytest.mark.slow
def test_a_run_with_a_teacher_saves_only_the_student(tmp_path):
    torch.manual_seed(3)
    torch.save(create_model("test-tiny").state_dict(), tmp_path / "teacher.pt")
    flags = ["--distill-model", "test-tiny", "--distill-pretrained", str(tmp_path / "teacher.pt")]
    assert cli.main([*RUN, "--logs", str(tmp_path), "--name", "plain"]) == 0
    assert cli.main([*RUN, "--logs", str(tmp_path), "--name", "taught", *flags]) == 0
    from bigclip.ckpt.dcp_layout import DCPLayout

    plain = DCPLayout.read_model_state(str(tmp_path / "plain" / "checkpoints" / "epoch_1"))
    taught = DCPLayout.read_model_state(str(tmp_path / "taught" / "checkpoints" / "epoch_1"))
    assert taught.keys() == plain.keys()  # the student's weights only
    assert any(not torch.equal(taught[k], plain[k]) for k in plain)  # the teacher changed what was learnt
    # the two terms are logged and recorded beside the loss, as OpenCLIP logs them
    records = [r for r in read_metrics(str(tmp_path / "taught")) if "loss" in r]
    assert records and all(
        r["contrastive_loss"] + r["distill_loss"] == pytest.approx(r["loss"], rel=1e-6) for r in records
    )
    assert "Contrastive_loss: " in (tmp_path / "taught" / "out.log").read_text()
    assert all("distill_loss" not in r for r in read_metrics(str(tmp_path / "plain")))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--distill-model", "test-tiny"], "--distill-model: distillation needs the teacher's --distill-pretrained"),
        (["--distill-pretrained", "x.pt"], "--distill-pretrained: distillation needs the teacher's --distill-model"),
        (["--distill-model", "nope", "--distill-pretrained", "x.pt"], "--distill-model 'nope': unknown architecture"),
        (["--distill-model", "test-tiny", "--distill-pretrained", "/no/such.pt"], "--distill-pretrained '/no/such.pt'"),
        (["--distill-model", "test-tiny", "--distill-pretrained", "t.pt", "--siglip"], "not to the SigLIP loss"),
        (
            ["--model", "test-tiny-coca", "--distill-model", "test-tiny", "--distill-pretrained", "t.pt"],
            "--distill-model: distillation is for CLIP models; a CoCa model trains with its own loss",
        ),
    ],
)
def test_distillation_flags_that_cannot_work_fail_in_one_line(tmp_path, capfd, monkeypatch, flags, message):
    (tmp_path / "t.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert cli.main([*RUN, "--logs", str(tmp_path / "logs"), *flags]) == 2
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not (tmp_path / "logs").exists()


def test_dry_run_counts_the_teachers_weights_where_the_engine_places_them(tmp_path):
    """--dry-run adds the teacher's weights per GPU: whole under DDP and ZeRO-1/2, over the ranks under FSDP2 and
    ZeRO-3, in the dtype each engine stores."""
    from bigclip import dry_run
    from bigclip.engine import frozen_bytes
    from bigclip.memory import model_facts

    (tmp_path / "t.pt").write_bytes(b"")
    teacher = model_facts("ViT-L-14").params
    world = World(world_size=4)
    ds = os.path.join(os.path.dirname(os.path.dirname(__file__)), "ds_configs")
    expected = {
        "ddp": ({"engine": "ddp"}, 4 * teacher),
        "fsdp": ({"engine": "fsdp"}, 4 * teacher / 4),
        "zero2": ({"ds_config": os.path.join(ds, "zero2.json"), "precision": "amp_bf16"}, 2 * teacher),
        "zero3": ({"ds_config": os.path.join(ds, "zero3.json"), "precision": "amp_bf16"}, 2 * teacher / 4),
    }
    for name, (flags, per_gpu) in expected.items():
        cfg = resolve({"model": "ViT-B-32", "dataset_type": "synthetic", "precision": "fp32", **flags,
                       "distill_model": "ViT-L-14", "distill_pretrained": str(tmp_path / "t.pt")})  # fmt: skip
        assert frozen_bytes(cfg.sections.engine, world, teacher) == per_gpu, name
    lines = dry_run.report(cfg.sections.model, cfg.sections.engine, World())
    assert any(line.startswith("teacher ViT-L-14: 427.6M parameters") for line in lines), lines
    assert "+ the teacher's weights 0.8 GiB" in lines[-1], lines[-1]  # ZeRO-3 bf16 on one rank: 2 bytes each
