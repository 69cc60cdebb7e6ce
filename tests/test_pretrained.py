"""--pretrained TAG: OpenCLIP's registry, weights from a Hugging Face hub cache, hash checked, offline.

These machines reach no hub. The download path runs against a stand-in for the hub's two file requests
(HEAD, GET) on 127.0.0.1 (HF_ENDPOINT), the offline path against the cache that download left behind, and
the model test against the hub's cache layout (blobs named by SHA-256, refs/main, snapshots/<commit>/<file>)
built from random OpenCLIP weights. OpenCLIP's model with the same weights is the oracle for the embeddings.
"""

import hashlib
import os
import subprocess
import sys

import huggingface_hub
import open_clip
import pytest
import torch
from fake_hub import FakeHub
from helpers import subprocess_env
from safetensors.torch import save

from bigclip import cli
from bigclip.build import build_model
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.errors import UserError
from bigclip.model.pretrained import resolve_pretrained

TAG, REPO_ID = "laion2b_s34b_b79k", "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"


def build_hub_cache(cache: str, repo_id: str, filename: str, data: bytes) -> str:
    """The layout huggingface_hub writes when it downloads `filename` of `repo_id` at revision main."""
    sha = hashlib.sha256(data).hexdigest()
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    root = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(root, "blobs"))
    os.makedirs(os.path.join(root, "refs"))
    os.makedirs(os.path.join(root, "snapshots", commit))
    with open(os.path.join(root, "blobs", sha), "wb") as f:
        f.write(data)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(commit)
    os.symlink(os.path.join("..", "..", "blobs", sha), os.path.join(root, "snapshots", commit, filename))
    return os.path.join(root, "blobs", sha)


@pytest.fixture(scope="module")
def openclip_vit_b_32(tmp_path_factory):
    """A randomly initialised OpenCLIP ViT-B-32 and a hub cache holding its weights under the tag's repo."""
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32").eval()
    cache = str(tmp_path_factory.mktemp("hub"))
    data = save({k: v.contiguous() for k, v in model.state_dict().items()})
    blob = build_hub_cache(cache, REPO_ID, "open_clip_model.safetensors", data)
    return model, cache, blob


@pytest.mark.slow
def test_tag_loads_from_the_hub_cache_offline_and_matches_open_clip(openclip_vit_b_32, monkeypatch):
    reference, cache, _ = openclip_vit_b_32
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = resolve(
        {"model": "ViT-B-32", "pretrained": TAG, "cache_dir": cache, "dataset_type": "synthetic", "precision": "fp32"}
    )
    model = build_model(cfg.sections.model, cfg.sections.engine, World()).eval()
    torch.manual_seed(1)
    images = torch.randn(2, 3, 224, 224)
    texts = open_clip.get_tokenizer("ViT-B-32")(["a photo of a cat", "two dogs on the beach at sunset"])
    with torch.no_grad():
        ours = model(images=images, texts=texts)
        theirs_img = reference.encode_image(images, normalize=True)
        theirs_txt = reference.encode_text(texts, normalize=True)
    assert (ours["image_features"] - theirs_img).abs().max() <= 1e-5
    assert (ours["text_features"] - theirs_txt).abs().max() <= 1e-5


def test_unknown_tag_names_the_model_and_its_tags(capsys):
    code = cli.main(["--model", "ViT-B-32", "--pretrained", "laion9b_nonsense", "--dataset-type", "synthetic"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--pretrained 'laion9b_nonsense'" in err and "ViT-B-32" in err and TAG in err


def test_offline_with_an_empty_cache_fails_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub reads the variable once, at import (a user sets it before starting the run); this process
    # imported it long ago.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        resolve_pretrained("ViT-B-32", TAG, str(tmp_path / "empty"))
    message = str(e.value)
    assert "\n" not in message
    assert TAG in message and "ViT-B-32" in message and str(tmp_path / "empty") in message
    assert "HF_HUB_OFFLINE" in message


@pytest.mark.slow
def test_a_corrupt_cache_entry_is_refused(openclip_vit_b_32, monkeypatch, tmp_path):
    _, cache, blob = openclip_vit_b_32
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_pretrained("ViT-B-32", TAG, cache)  # verifies: the blob's bytes hash to its name
    assert os.path.realpath(path) == os.path.realpath(blob)
    copy = tmp_path / "hub"
    with open(blob, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
    bad = build_hub_cache(str(copy), REPO_ID, "open_clip_model.safetensors", bytes(data))
    os.rename(bad, os.path.join(os.path.dirname(bad), hashlib.sha256(b"not these bytes").hexdigest()))
    snapshot = os.path.join(os.path.dirname(os.path.dirname(bad)), "snapshots")
    link = os.path.join(snapshot, os.listdir(snapshot)[0], "open_clip_model.safetensors")
    os.remove(link)
    os.symlink(os.path.join("..", "..", "blobs", hashlib.sha256(b"not these bytes").hexdigest()), link)
    with pytest.raises(UserError, match="does not match its SHA-256"):
        resolve_pretrained("ViT-B-32", TAG, str(copy))


def resolve_in_child(cache: str, **env: str) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_ENDPOINT when it is imported: a fresh interpreter per setting.
    code = (
        "from bigclip.model.pretrained import resolve_pretrained; "
        f"print(resolve_pretrained('ViT-B-32', {TAG!r}, {cache!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=subprocess_env(**env)
    )


@pytest.mark.slow
def test_tag_is_downloaded_into_the_cache_then_used_offline(tmp_path):
    data = os.urandom(1 << 20)
    hub = FakeHub({REPO_ID: {"open_clip_model.safetensors": data}})
    cache = str(tmp_path / "hub")
    try:
        first = resolve_in_child(cache, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")
    finally:
        hub.close()
    assert first.returncode == 0, first.stderr[-2000:]
    path = first.stdout.strip().splitlines()[-1]
    assert path.startswith(cache) and open(path, "rb").read() == data
    assert os.path.basename(os.path.realpath(path)) == hashlib.sha256(data).hexdigest()  # the hub's blob layout
    # The hub is gone; offline, the same tag resolves from the cache.
    second = resolve_in_child(cache, HF_HUB_OFFLINE="1")
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.strip().splitlines()[-1] == path


@pytest.mark.slow
def test_a_download_that_does_not_match_its_hash_is_refused(tmp_path):
    data = os.urandom(1 << 16)
    hub = FakeHub(
        {REPO_ID: {"open_clip_model.safetensors": data}},
        etags={"open_clip_model.safetensors": hashlib.sha256(b"other bytes").hexdigest()},
    )
    try:
        child = resolve_in_child(str(tmp_path / "hub"), HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")
    finally:
        hub.close()
    assert child.returncode != 0
    last = child.stderr.strip().splitlines()[-1]
    assert "UserError" in last and TAG in last and "does not match its SHA-256" in last
