"""Model sources OpenCLIP users have: `local-dir:DIR`, `hf-hub:ORG/NAME`, timm image towers, --pretrained-image.

OpenCLIP is the oracle. Its own writer (open_clip.push_to_hf_hub.save_for_hf) saves a small model with random
weights and its open_clip_config.json; bigclip and open_clip.create_model read the same directory (or the same
files served from a Hugging Face hub cache built by hand in the hub's layout: these machines reach no hub) and
must give the same embeddings. timm's pretrained weights are random weights timm saved, served from the same
kind of cache under timm's repository name for the model.
"""

import hashlib
import json
import logging
import os
import shutil

import huggingface_hub.constants
import open_clip
import pytest
import timm
import torch
from open_clip.model import CLIP as OpenCLIPModel
from open_clip.model import set_model_preprocess_cfg
from open_clip.push_to_hf_hub import save_for_hf
from safetensors.torch import load_file, save_file

from bigclip import cli
from bigclip.build import build_model
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.errors import UserError
from bigclip.model import bigclip_to_openclip, create_model, get_model_config, get_tokenizer, preprocess_cfg
from bigclip.model.timm_tower import TimmVisionTower

TEXT_CFG = {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
VIT_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": TEXT_CFG,
}
# OpenCLIP's convnext_* layout (timm trunk, its default pooling, a linear projection) on a tiny timm model.
TIMM_CFG = {
    "embed_dim": 32,
    "vision_cfg": {
        "timm_model_name": "test_resnet",
        "timm_model_pretrained": False,
        "timm_pool": "",
        "timm_proj": "linear",
        "timm_drop": 0.0,
        "timm_drop_path": 0.1,
        "image_size": 64,
    },
    "text_cfg": TEXT_CFG,
}
# Not OpenCLIP's defaults, so that honouring the file's preprocess_cfg is visible.
PREPROCESS = {"mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3), "interpolation": "bilinear", "resize_mode": "squash"}
REPO_ID = "someone/tiny-clip"
TIMM_REPO = "timm/test_resnet.r160_in1k"  # timm's default tag of test_resnet
TEXTS = ["a photo of a cat", "", "two dogs playing on a beach at sunset!"]


class NoTokenizerFiles:
    """OpenCLIP's default tokenizer has no files to save; save_for_hf asks every tokenizer to save its own."""

    def save_pretrained(self, directory):
        pass


def save_openclip(model_cfg: dict, directory, seed: int = 0) -> OpenCLIPModel:
    """An OpenCLIP model with random weights, saved by OpenCLIP (config, .safetensors and .bin weights)."""
    torch.manual_seed(seed)
    model = OpenCLIPModel(**model_cfg).eval()
    set_model_preprocess_cfg(model, {**PREPROCESS, "size": model.visual.image_size})
    save_for_hf(model, NoTokenizerFiles(), model_config=model_cfg, save_directory=str(directory))
    return model


def hub_cache(cache, repo_id: str, files: dict[str, bytes]) -> None:
    """The layout huggingface_hub leaves when it downloads `files` of `repo_id` at revision main."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    root = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    for folder in ("blobs", "refs", os.path.join("snapshots", commit)):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(commit)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        with open(os.path.join(root, "blobs", sha), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", sha), os.path.join(root, "snapshots", commit, name))


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this test (huggingface_hub reads the variable once, at import: set both)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vit")
    return directory, save_openclip(VIT_CFG, directory)


@pytest.fixture(scope="module")
def timm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("timm")
    return directory, save_openclip(TIMM_CFG, directory, seed=1)


def embeddings(model, images, tokens):
    with torch.no_grad():
        return model.encode_image(images, normalize=True), model.encode_text(tokens, normalize=True)


def assert_same_embeddings(ours, theirs, image_size: int, name: str):
    torch.manual_seed(2)
    images = torch.randn(3, 3, image_size, image_size)
    tokens = open_clip.get_tokenizer(name)(TEXTS)
    for a, b in zip(embeddings(ours, images, tokens), embeddings(theirs, images, tokens)):
        assert (a - b).abs().max() <= 1e-5


@pytest.mark.parametrize("which", ["vit", "timm"])
def test_local_dir_round_trips_with_open_clip(which, vit_dir, timm_dir):
    directory, _ = vit_dir if which == "vit" else timm_dir
    name = f"local-dir:{directory}"
    size = (VIT_CFG if which == "vit" else TIMM_CFG)["vision_cfg"]["image_size"]
    theirs = open_clip.create_model(name).eval()  # the weights OpenCLIP finds beside the config
    ours = create_model(name).eval()  # the same, by default
    assert_same_embeddings(ours, theirs, size, name)
    # --pretrained FILE: OpenCLIP's other file (a torch pickle) through bigclip's streaming loader.
    explicit = create_model(name, pretrained=directory / "open_clip_pytorch_model.bin").eval()
    assert_same_embeddings(explicit, theirs, size, name)
    # Export: bigclip's weights in OpenCLIP's layout load strictly into OpenCLIP's model.
    exported = open_clip.create_model(name, load_weights=False).eval()
    exported.load_state_dict(bigclip_to_openclip(ours.state_dict()), strict=True)
    assert_same_embeddings(ours, exported, size, name)
    # The file's preprocess_cfg and OpenCLIP's tokenizer for the name.
    pp = preprocess_cfg(name)
    assert pp == {**PREPROCESS, "size": (size, size), "fill_color": 0}
    theirs_pp = theirs.visual.preprocess_cfg
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in theirs_pp.items() if k in PREPROCESS} == PREPROCESS
    assert torch.equal(get_tokenizer(name)(TEXTS), open_clip.get_tokenizer(name)(TEXTS))
    assert get_tokenizer(name, context_length=8)(TEXTS).shape == (3, 8)


def test_timm_tower_contract(timm_dir):
    directory, _ = timm_dir
    name = f"local-dir:{directory}"
    model = create_model(name)
    tower = model.visual
    assert isinstance(tower, TimmVisionTower) and tower.image_size == (64, 64) and tower.width == 96
    trunk = tower.trunk  # test_resnet: one block per stage, layer{1..4}.0, as timm groups them
    assert tower.blocks == [trunk.layer1[0], trunk.layer2[0], trunk.layer3[0], trunk.layer4[0]]
    assert all(any(b is t for t in model.transformer_blocks()) for b in tower.blocks)
    # init_weights re-initialises every parameter and buffer in place (after to_empty: garbage before).
    meta = create_model(name, device="meta", load_weights=False)
    meta.to_empty(device="cpu")
    for t in meta.visual.state_dict().values():
        t.fill_(float("nan") if t.is_floating_point() else -1)
    meta.visual.init_weights()
    for key, t in meta.visual.state_dict().items():
        assert (torch.isfinite(t) if t.is_floating_point() else t >= 0).all(), key
    bn = meta.visual.trunk.bn1
    assert torch.equal(bn.running_var, torch.ones_like(bn.running_var)) and not bn.running_mean.any()
    # Locking is OpenCLIP's TimmModel.lock: same trainable parameters, same frozen BatchNorms.
    theirs = open_clip.create_model(name, load_weights=False)
    model.lock_image_tower(unlocked_groups=2, freeze_bn_stats=True)
    theirs.lock_image_tower(unlocked_groups=2, freeze_bn_stats=True)
    trainable = {n for n, p in model.visual.named_parameters() if p.requires_grad}
    assert trainable == {
        n[len("visual.") :] for n, p in theirs.named_parameters() if n.startswith("visual.") and p.requires_grad
    }
    frozen = [n for n, m in model.visual.named_modules() if type(m).__name__ == "FrozenBatchNorm2d"]
    assert frozen and frozen == [n for n, m in theirs.visual.named_modules() if type(m).__name__ == "FrozenBatchNorm2d"]


def test_hf_hub_from_a_hand_built_cache_offline(vit_dir, tmp_path, offline):
    directory, _ = vit_dir
    cache = str(tmp_path / "hub")
    hub_cache(
        cache,
        REPO_ID,
        {f: (directory / f).read_bytes() for f in ("open_clip_config.json", "open_clip_model.safetensors")},
    )
    name = f"hf-hub:{REPO_ID}"
    theirs = open_clip.create_model(name, cache_dir=cache).eval()
    cfg = resolve({"model": name, "cache_dir": cache, "dataset_type": "synthetic", "precision": "fp32"})
    ours = build_model(cfg.sections.model, cfg.sections.engine, World()).eval()
    assert_same_embeddings(ours, theirs, 32, f"local-dir:{directory}")
    assert get_model_config(name, cache_dir=cache) == VIT_CFG
    assert preprocess_cfg(name, cache_dir=cache) == {**PREPROCESS, "size": (32, 32), "fill_color": 0}
    tokens = get_tokenizer(name, cache_dir=cache)(TEXTS)
    assert torch.equal(tokens, open_clip.get_tokenizer(name, cache_dir=cache)(TEXTS))
    # An empty cache with downloads off: validation reads only the cache (the name's form here); the build, which
    # fetches the config, stops in one line naming the repository and the cache.
    empty = str(tmp_path / "empty")
    cfg = resolve({"model": name, "cache_dir": empty, "dataset_type": "synthetic"})
    with pytest.raises(UserError) as e:
        build_model(cfg.sections.model, cfg.sections.engine, World())
    message = str(e.value)
    assert "\n" not in message and REPO_ID in message and empty in message and "HF_HUB_OFFLINE" in message


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: None, "no open_clip_config.json in"),
        (lambda d: (d / "open_clip_config.json").write_text('{"model_cfg": {"embed_dim": 3,'), "not valid JSON"),
        (lambda d: (d / "open_clip_config.json").write_text('{"embed_dim": 3}'), "has no model_cfg"),
    ],
)
def test_a_bad_local_dir_stops_with_one_line(make, expected, tmp_path, capsys):
    make(tmp_path)
    code = cli.main(["--model", f"local-dir:{tmp_path}", "--dataset-type", "synthetic", "--logs", str(tmp_path / "l")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err and str(tmp_path) in err


@pytest.fixture(scope="module")
def timm_weights():
    """Random weights saved by timm in the file its hub repository for the model holds."""
    torch.manual_seed(3)
    return {k: v.contiguous() for k, v in timm.create_model("test_resnet").state_dict().items()}


def test_pretrained_image_loads_timm_weights_from_the_hub_cache(timm_dir, timm_weights, tmp_path, offline, caplog):
    directory, _ = timm_dir
    config_only = tmp_path / "config-only"  # the timm config without CLIP weights beside it
    config_only.mkdir()
    shutil.copy(directory / "open_clip_config.json", config_only)
    weights_file = tmp_path / "model.safetensors"
    save_file(timm_weights, str(weights_file))
    cache = str(tmp_path / "hub")
    hub_cache(cache, TIMM_REPO, {"model.safetensors": weights_file.read_bytes()})
    flags = {"model": f"local-dir:{config_only}", "pretrained_image": True, "cache_dir": cache}
    cfg = resolve({**flags, "dataset_type": "synthetic", "precision": "fp32"})
    with caplog.at_level(logging.INFO, logger="bigclip"):
        model = build_model(cfg.sections.model, cfg.sections.engine, World())
    trunk = model.visual.trunk.state_dict()
    expected = load_file(str(weights_file))
    assert set(trunk) == set(expected) - {"fc.weight", "fc.bias"}  # the classifier is OpenCLIP's head's job
    assert all(torch.equal(trunk[k], expected[k]) for k in trunk)
    assert any(TIMM_REPO in r.getMessage() and "test_resnet" in r.getMessage() for r in caplog.records)
    # Whole-model weights (here: the local-dir's own) win, as in OpenCLIP.
    local = resolve({**flags, "model": f"local-dir:{directory}", "dataset_type": "synthetic"})
    clip_weights = build_model(local.sections.model, local.sections.engine, World())
    saved = load_file(str(directory / "open_clip_model.safetensors"))
    assert all(torch.equal(v, saved["visual.trunk." + k]) for k, v in clip_weights.visual.trunk.state_dict().items())
    # Not cached and downloads off: one line naming the timm model, its repository and the cache.
    empty = str(tmp_path / "empty")
    cfg = resolve({**flags, "cache_dir": empty, "dataset_type": "synthetic"})
    with pytest.raises(UserError) as e:
        build_model(cfg.sections.model, cfg.sections.engine, World())
    message = str(e.value)
    assert "\n" not in message and "test_resnet" in message and TIMM_REPO in message and empty in message


def test_pretrained_image_on_a_vit_stops_at_validation(vit_dir):
    directory, _ = vit_dir
    for model in ("test-tiny", f"local-dir:{directory}"):
        with pytest.raises(UserError, match="pretrained image towers currently only supported for timm models"):
            resolve({"model": model, "pretrained_image": True, "dataset_type": "synthetic"})


@pytest.mark.slow
def test_a_short_training_run_on_a_local_dir_timm_model(timm_dir, tmp_path):
    directory, _ = timm_dir
    code = cli.main(
        ["--model", f"local-dir:{directory}", "--dataset-type", "synthetic", "--train-num-samples", "16",
         "--batch-size", "8", "--epochs", "1", "--precision", "fp32", "--workers", "0", "--warmup", "1",
         "--lr", "1e-3", "--device", "cpu", "--grad-checkpointing", "--logs", str(tmp_path), "--name", "timm"]
    )  # fmt: skip
    assert code == 0
    params = json.dumps(open(tmp_path / "timm" / "params.yaml").read())
    assert "local-dir:" in params
