"""ResNet image towers (RN50, RN101, RN50x4, RN50x16, RN50x64): timm's ByobNet with OpenCLIP's names on the
state-dict boundary. OpenCLIP (open_clip_torch) is the oracle: fp32 on CPU, embeddings within 1e-5.

- OpenCLIP -> bigclip: random OpenCLIP RN50 weights (BatchNorm statistics randomised too) load with
  --pretrained FILE and give the same embeddings; so does a state dict of frozen-BatchNorm OpenCLIP.
- bigclip -> OpenCLIP: bigclip_to_openclip of a bigclip RN50 loads into open_clip.create_model(strict), and a
  one-step training run's `bigclip export` does too, with the same embeddings.
- every variant's names and shapes convert both ways against OpenCLIP's own tower (built on meta).
- lock, frozen BatchNorm statistics, activation checkpointing and init on a small tower.
"""

import os

import open_clip
import pytest
import torch
from open_clip.model import _build_vision_tower
from safetensors.torch import save_file
from torch import nn

from bigclip import cli
from bigclip.ckpt.dcp_layout import DCPLayout
from bigclip.errors import UserError
from bigclip.model import bigclip_to_openclip, create_model, get_model_config, openclip_to_bigclip
from bigclip.model.clip import vision_tower
from bigclip.model.convert import plan_bigclip_to_openclip, plan_openclip_to_bigclip
from bigclip.model.rename import apply_plan
from bigclip.model.resnet import ResNetTower

TOL = 1e-5
VARIANTS = ["RN50", "RN101", "RN50x4", "RN50x16", "RN50x64"]
# A small ResNet in OpenCLIP's vision_cfg terms; head_width 32 (not timm's 64) exercises the head rebuild.
SMALL = {"image_size": 64, "layers": [1, 2, 1, 1], "width": 16, "head_width": 32, "patch_size": None}
SMALL_EMBED = 24


def embeddings(model, name: str = "RN50", seed: int = 1):
    torch.manual_seed(seed)
    images = torch.randn(2, 3, 224, 224)
    texts = open_clip.get_tokenizer(name)(["a photo of a cat", "two dogs playing on a beach at sunset!"])
    with torch.no_grad():
        return model.encode_image(images, normalize=True), model.encode_text(texts, normalize=True)


def assert_close(ours, theirs, tol=TOL):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= tol


@torch.no_grad()
def randomise_batch_norms(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial BatchNorm weights and statistics (an init has ones, zeros and zero-initialised last BNs)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.num_batches_tracked.fill_(int(torch.randint(1, 1000, (), generator=g)))


@pytest.mark.slow
def test_openclip_rn50_weights_load_into_bigclip_with_the_same_embeddings(tmp_path):
    torch.manual_seed(0)
    reference = open_clip.create_model("RN50")
    randomise_batch_norms(reference)
    reference.eval()
    path = str(tmp_path / "openclip.pt")
    torch.save(reference.state_dict(), path)
    ours = create_model("RN50", pretrained=path).eval()
    assert type(ours.visual) is ResNetTower
    expected = embeddings(reference)
    assert_close(embeddings(ours), expected)
    # The BatchNorm buffers came across too (a wrong running_var would still give finite embeddings).
    theirs = reference.state_dict()
    mine = ours.state_dict()
    ours_var, theirs_var = "visual.resnet.stages.2.5.conv3_1x1.bn.running_var", "visual.layer3.5.bn3.running_var"
    assert torch.equal(mine[ours_var], theirs[theirs_var])
    assert torch.equal(
        mine["visual.resnet.stages.1.0.shortcut.conv.bn.num_batches_tracked"],
        theirs["visual.layer2.0.downsample.1.num_batches_tracked"],
    )

    # OpenCLIP locked with frozen BatchNorm statistics (FrozenBatchNorm2d: no num_batches_tracked) loads too.
    reference.lock_image_tower(freeze_bn_stats=True)
    frozen = reference.state_dict()
    assert not any(k.endswith("num_batches_tracked") for k in frozen)
    path = str(tmp_path / "openclip-frozen-bn.pt")
    torch.save(frozen, path)
    again = create_model("RN50", pretrained=path).state_dict()
    assert again.keys() == mine.keys()
    for name, value in again.items():  # the same model (so the same embeddings), batch counts starting at 0
        count = name.endswith("num_batches_tracked")
        assert torch.equal(value, torch.zeros_like(value) if count else mine[name]), name


@pytest.mark.slow
def test_bigclip_rn50_converts_to_openclip_safetensors_with_the_same_embeddings(tmp_path):
    torch.manual_seed(0)
    ours = create_model("RN50")
    randomise_batch_norms(ours)
    ours.eval()
    state = bigclip_to_openclip(ours.state_dict())
    path = str(tmp_path / "bigclip-rn50.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    theirs = open_clip.create_model("RN50", pretrained=path).eval()  # strict: every key of OpenCLIP's model
    assert_close(embeddings(ours), embeddings(theirs))
    # and back: exactly the tensors we started from
    back = openclip_to_bigclip(theirs.state_dict())
    original = ours.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)


@pytest.mark.extended  # a full-size RN50 trained (1.5 min); in CI its weights both ways (above)
@pytest.mark.slow  # an end-to-end run, ~25 s on 2 cores (kept in CI)
def test_rn50_trains_through_the_cli_and_its_export_loads_into_open_clip(tmp_path):
    """One training step (grad checkpointing on, BatchNorm in training mode), checkpoint, `bigclip export`."""
    args = ["--model", "RN50", "--dataset-type", "synthetic", "--train-num-samples", "2", "--batch-size", "2",
            "--epochs", "1", "--precision", "fp32", "--workers", "0", "--lr", "1e-3", "--warmup", "1",
            "--grad-checkpointing", "--logs", str(tmp_path), "--name", "run"]  # fmt: skip
    assert cli.main(args) == 0
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "epoch_1")
    out = str(tmp_path / "exported.safetensors")
    assert cli.main(["export", ckpt, out]) == 0

    ours = create_model("RN50", init=False).eval()
    weights = DCPLayout.read_model_state(ckpt)
    ours.load_state_dict(weights)  # strict: the checkpoint holds every parameter and BatchNorm buffer
    # one step in training mode moved the running statistics (and counted the batch once, not twice)
    assert int(weights["visual.resnet.stem.conv1.bn.num_batches_tracked"]) == 1
    assert int(weights["visual.resnet.stages.3.2.conv3_1x1.bn.num_batches_tracked"]) == 1
    assert not torch.equal(weights["visual.resnet.stem.conv1.bn.running_mean"], torch.zeros(32))
    theirs = open_clip.create_model("RN50", pretrained=out).eval()
    assert_close(embeddings(ours), embeddings(theirs))


@pytest.mark.parametrize("name", VARIANTS)
def test_names_and_shapes_convert_both_ways_for_every_variant(name):
    cfg = open_clip.get_model_config(name)
    with torch.device("meta"):
        openclip_visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])  # OpenCLIP's own builder
    theirs = {"visual." + k: v for k, v in openclip_visual.state_dict().items()}
    model = create_model(name, device="meta")
    ours = {k: v for k, v in model.state_dict().items() if k.startswith("visual.")}
    assert len(model.visual.blocks) == sum(cfg["vision_cfg"]["layers"])
    assert model.visual.width == cfg["vision_cfg"]["width"]
    assert model.visual.image_size == (cfg["vision_cfg"]["image_size"],) * 2

    to_ours = apply_plan(plan_openclip_to_bigclip(theirs), theirs)
    assert to_ours.keys() == ours.keys()
    assert all(to_ours[k].shape == ours[k].shape for k in ours)
    to_theirs = apply_plan(plan_bigclip_to_openclip(ours), ours)
    assert to_theirs.keys() == theirs.keys()
    assert all(to_theirs[k].shape == theirs[k].shape for k in theirs)

    # Values: both round trips give back exactly what went in (small stand-in tensors, one per name).
    g = torch.Generator().manual_seed(0)
    fake = {k: torch.randn(3, generator=g) for k in theirs}
    back = apply_plan(plan_bigclip_to_openclip(to := apply_plan(plan_openclip_to_bigclip(fake), fake)), to)
    assert back.keys() == fake.keys() and all(torch.equal(back[k], fake[k]) for k in fake)
    fake = {k: torch.randn(3, generator=g) for k in ours}
    back = apply_plan(plan_openclip_to_bigclip(to := apply_plan(plan_bigclip_to_openclip(fake), fake)), to)
    assert back.keys() == fake.keys() and all(torch.equal(back[k], fake[k]) for k in fake)


def small_pair(seed: int = 0):
    """OpenCLIP's ModifiedResNet and bigclip's ResNetTower for SMALL, with the same random weights."""
    torch.manual_seed(seed)
    theirs = _build_vision_tower(SMALL_EMBED, SMALL)
    randomise_batch_norms(theirs, seed)
    ours = vision_tower(SMALL_EMBED, SMALL, quick_gelu=False)
    assert type(ours) is ResNetTower and ours.heads == 16 and ours.resnet.head.num_heads == 16
    state = openclip_to_bigclip({"visual." + k: v for k, v in theirs.state_dict().items()})
    ours.load_state_dict({k[len("visual.") :]: v for k, v in state.items()})
    return theirs, ours


def test_small_tower_with_other_head_width_matches_openclip():
    theirs, ours = small_pair()
    images = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        assert (ours.eval()(images) - theirs.eval()(images)).abs().max().item() <= TOL
        # training mode: batch statistics, and the running statistics move the same way
        assert (ours.train()(images) - theirs.train()(images)).abs().max().item() <= TOL
    assert torch.allclose(ours.resnet.stem.conv1.bn.running_mean, theirs.bn1.running_mean, atol=1e-6)


def test_lock_freezes_everything_and_refuses_partial_locking():
    _, ours = small_pair()
    with pytest.raises(UserError, match="^--lock-image-unlocked-groups 2: not supported for ResNet towers"):
        ours.lock(2)
    ours.lock()
    assert not any(p.requires_grad for p in ours.parameters())
    count = int(ours.resnet.stem.conv1.bn.num_batches_tracked)
    ours.train()(torch.randn(4, 3, 64, 64))
    assert int(ours.resnet.stem.conv1.bn.num_batches_tracked) == count + 1  # statistics still move: not frozen


def test_frozen_batch_norm_statistics_behave_like_openclip_in_training_mode():
    theirs, ours = small_pair()
    keys = set(ours.state_dict())
    theirs.lock(freeze_bn_stats=True)  # FrozenBatchNorm2d
    ours.lock(freeze_bn_stats=True)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.train()
    theirs.train()
    images = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        assert (ours(images) - theirs(images)).abs().max().item() <= TOL  # running statistics, not batch ones
    after = ours.state_dict()
    assert set(after) == keys  # same names and buffers as an unfrozen tower: checkpoints and export unchanged
    assert all(torch.equal(before[k], after[k]) for k in keys)
    assert ours.training and not ours.resnet.stem.conv1.bn.training


def test_grad_checkpointing_gives_the_same_gradients_and_statistics():
    images = torch.randn(4, 3, 64, 64)
    results = []
    for every in (0, 1, 2):
        _, ours = small_pair()
        counts = {n: int(b) for n, b in ours.named_buffers() if n.endswith("num_batches_tracked")}
        ours.train().set_grad_checkpointing(every)
        ours(images).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
        buffers = {n: b.clone() for n, b in ours.named_buffers()}
        results.append((grads, buffers))
    (grads, buffers), *others = results
    assert all(int(buffers[n]) == count + 1 for n, count in counts.items())  # one forward, counted once
    for other_grads, other_buffers in others:
        assert all(torch.allclose(grads[n], other_grads[n], rtol=0, atol=1e-6) for n in grads)
        # recomputation in backward does not update BatchNorm statistics a second time
        assert all(torch.equal(buffers[n], other_buffers[n]) for n in buffers)


def test_init_weights_sets_every_parameter_and_buffer():
    ours = vision_tower(SMALL_EMBED, SMALL, quick_gelu=False)
    with torch.no_grad():
        for t in [*ours.parameters(), *ours.buffers()]:
            t.fill_(-7 if t.dtype == torch.long else float("nan"))
    ours.init_weights()
    for name, t in [*ours.named_parameters(), *ours.named_buffers()]:
        assert torch.isfinite(t.float()).all() and not (t == -7).any(), name
    for block in ours.blocks:
        assert torch.equal(block.conv3_1x1.bn.weight, torch.zeros_like(block.conv3_1x1.bn.weight))
    bn = ours.resnet.stem.conv2.bn
    assert torch.equal(bn.running_var, torch.ones(8)) and int(bn.num_batches_tracked) == 0
    head = ours.resnet.head
    assert head.pos_embed.shape == (2 * 2 + 1, 512)
    assert head.q.weight.std().item() == pytest.approx(512**-0.5, rel=0.05)


def test_image_size_override_and_patch_dropout_refusal():
    model = create_model("RN50", image_size=160, device="meta")
    assert model.visual.image_size == (160, 160)
    assert model.visual.resnet.head.pos_embed.shape == (5 * 5 + 1, 2048)
    small = create_model("RN50", image_size=(64, 96))
    small.eval()
    with torch.no_grad():
        assert small.encode_image(torch.randn(1, 3, 64, 96)).shape == (1, 1024)
    with pytest.raises(UserError, match="^--force-patch-dropout: --model RN50 has a ResNet image tower"):
        create_model("RN50", patch_dropout=0.5, device="meta")
    assert "image_mean" in get_model_config("RN50x64")["vision_cfg"]
