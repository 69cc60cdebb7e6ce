"""hf-hub: models without side effects at validation, fetched where the model is built or by `bigclip fetch`.

Flag validation reads an hf-hub: config from the hub cache only (no network, nothing written): a cached config is
checked in full there, an uncached one only by its name's form, and the same checks run at the model's build once
it is fetched. `bigclip fetch` downloads what a run reads from the hub ahead of it: it runs in a child process
against a hub served from memory on 127.0.0.1 (HF_ENDPOINT; these machines reach no real hub), which answers the
requests huggingface_hub makes for a file (HEAD for its metadata, GET for its bytes).
"""

import json
import os
import subprocess
import sys

import huggingface_hub
import huggingface_hub.file_download
import pytest
import torch
from fake_hub import FakeHub
from helpers import subprocess_env
from safetensors.torch import load_file
from test_model_sources import REPO_ID, VIT_CFG, hub_cache, offline, vit_dir  # noqa: F401

from bigclip import cli
from bigclip.build import build_model, run_sections
from bigclip.commands import commands_help
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.errors import UserError
from bigclip.model import bigclip_to_openclip, get_model_config

NAME = f"hf-hub:{REPO_ID}"
FLAGS = {"model": NAME, "dataset_type": "synthetic", "precision": "fp32"}


def tree(path) -> list[str]:
    """Every file and folder under `path` (what a write would change)."""
    return sorted(os.path.join(root, name) for root, dirs, files in os.walk(path) for name in dirs + files)


@pytest.fixture
def no_download(monkeypatch):
    """Any download (or cache-refreshing request) through huggingface_hub fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"hf_hub_download{args} called at flag validation")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(huggingface_hub.file_download, "hf_hub_download", refuse)


def config_bytes(model_cfg: dict) -> bytes:
    return json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}).encode()


def test_validation_of_an_uncached_hf_hub_model_reads_nothing_and_writes_nothing(tmp_path, offline, no_download):
    cache = tmp_path / "hub"
    cache.mkdir()
    cfg = resolve({**FLAGS, "cache_dir": str(cache)})  # no config at hand: the name's form only, no error
    assert tree(cache) == [] and not cfg.sections.loss.captioning
    absent = tmp_path / "absent"
    resolve({**FLAGS, "cache_dir": str(absent), "pretrained_image": True})  # its checks need the config: later
    assert not absent.exists()
    for bad in ("hf-hub:a/b/c", "hf-hub:a b"):
        with pytest.raises(UserError, match="not a Hugging Face hub repository name") as e:
            resolve({**FLAGS, "model": bad, "cache_dir": str(cache)})
        assert "\n" not in str(e.value)
    assert tree(cache) == []


def test_a_cached_hf_hub_config_is_checked_in_full_at_validation(tmp_path, offline, no_download):
    cache = str(tmp_path / "hub")
    hub_cache(cache, REPO_ID, {"open_clip_config.json": b'{"model_cfg": {"embed_dim": 32}}'})
    before = tree(cache)
    with pytest.raises(UserError, match="has no model_cfg with embed_dim, vision_cfg and text_cfg") as e:
        resolve({**FLAGS, "cache_dir": cache})
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--model {NAME}:")
    good = str(tmp_path / "good")
    hub_cache(good, REPO_ID, {"open_clip_config.json": config_bytes(VIT_CFG)})
    with pytest.raises(UserError, match="pretrained image towers currently only supported for timm models"):
        resolve({**FLAGS, "cache_dir": good, "pretrained_image": True})
    coca = str(tmp_path / "coca")
    hub_cache(coca, REPO_ID, {"open_clip_config.json": config_bytes(get_model_config("test-tiny-coca"))})
    assert resolve({**FLAGS, "cache_dir": coca}).sections.loss.captioning  # decided at validation
    with pytest.raises(UserError, match="CoCa's loss adds its caption term to the CLIP loss"):
        resolve({**FLAGS, "cache_dir": coca, "siglip": True})
    assert tree(cache) == before


def test_a_config_fetched_at_build_is_checked_there_in_one_line(tmp_path, offline):
    cache = str(tmp_path / "hub")
    cfg = resolve({**FLAGS, "cache_dir": cache})  # nothing cached: passes validation
    # What local rank 0 fetches at the build (offline: the hub cache answers; here a bad config).
    hub_cache(cache, REPO_ID, {"open_clip_config.json": b'{"model_cfg": {"embed_dim": 32}}'})
    with pytest.raises(UserError, match="has no model_cfg") as e:
        build_model(cfg.sections.model, cfg.sections.engine, World())
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--model {NAME}:")
    # The run's sections: what validation could not decide without the config (a CoCa captions) decided there.
    for flags in ({}, {"siglip": True}):
        coca = str(tmp_path / f"coca{len(flags)}")
        cfg = resolve({**FLAGS, **flags, "cache_dir": coca})
        assert not cfg.sections.loss.captioning
        hub_cache(coca, REPO_ID, {"open_clip_config.json": config_bytes(get_model_config("test-tiny-coca"))})
        if flags:
            with pytest.raises(UserError, match="CoCa's loss adds its caption term to the CLIP loss"):
                run_sections(cfg.sections, World())
        else:
            assert run_sections(cfg.sections, World()).loss.captioning


def test_an_uncached_config_with_downloads_off_stops_the_run_in_one_line_before_any_work(tmp_path, offline, capsys):
    logs = tmp_path / "logs"
    code = cli.main(["--model", NAME, "--dataset-type", "synthetic", "--cache-dir", str(tmp_path / "hub"),
                     "--logs", str(logs), "--name", "r"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--model {NAME}" in err and "HF_HUB_OFFLINE" in err and "bigclip fetch" in err
    assert not (logs / "r").exists()


def bigclip_child(args: list[str], **env: str) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported: a fresh interpreter per setting.
    return subprocess.run(
        [sys.executable, "-m", "bigclip", *args], capture_output=True, text=True, timeout=600, env=subprocess_env(**env)
    )


@pytest.mark.slow
def test_bigclip_fetch_downloads_config_and_weights_for_an_offline_run(vit_dir, tmp_path, offline):  # noqa: F811
    directory, _ = vit_dir
    files = {f: (directory / f).read_bytes() for f in ("open_clip_config.json", "open_clip_model.safetensors")}
    hub = FakeHub({REPO_ID: files})
    cache = str(tmp_path / "hub")
    try:
        fetched = bigclip_child(
            ["fetch", "--model", NAME, "--cache-dir", cache], HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0"
        )
        unknown = bigclip_child(
            ["fetch", "--model", "hf-hub:someone/nothing-here", "--cache-dir", cache],
            HF_ENDPOINT=hub.url,
            HF_HUB_OFFLINE="0",
        )
    finally:
        hub.close()
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    out = fetched.stdout
    assert "open_clip_config.json" in out and "open_clip_model.safetensors" in out and cache in out
    assert any("open_clip_config.json" in r for r in hub.requests)
    assert any("open_clip_model.safetensors" in r for r in hub.requests)
    # An unknown repository: one line naming --model and what to do, a non-zero exit.
    err = unknown.stderr.strip().splitlines()
    assert unknown.returncode == 2 and len(err) == 1, unknown.stderr[-3000:]
    assert "--model hf-hub:someone/nothing-here" in err[0] and "Check the name" in err[0]
    # The hub is gone and downloads are off: the run validates and builds from what fetch left in the cache.
    cfg = resolve({**FLAGS, "cache_dir": cache})
    ours = bigclip_to_openclip(build_model(cfg.sections.model, cfg.sections.engine, World()).state_dict())
    saved = load_file(str(directory / "open_clip_model.safetensors"))
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)
    # Offline, fetch checks that the cache holds it all (and says where), and refuses what it lacks in one line.
    assert cli.main(["fetch", "--model", NAME, "--cache-dir", cache]) == 0
    assert cli.main(["fetch", "--model", NAME, "--cache-dir", str(tmp_path / "empty")]) == 2
    assert not (tmp_path / "empty").exists() or tree(tmp_path / "empty") == []


def test_bigclip_fetch_refusals_are_one_line(tmp_path, offline, capsys):
    cases = [
        (["fetch", "--model", "ViT-B-32"], "reads nothing from the Hugging Face hub"),
        (["fetch", "--model", "ViT-B-32", "--pretrained", "no-such-tag"], "not a pretrained tag of --model ViT-B-32"),
        (["fetch", "--model", "hf-hub:a/b/c"], "not a Hugging Face hub repository name"),
        (["fetch", "--model", NAME, "--cache-dir", str(tmp_path / "hub")], "HF_HUB_OFFLINE"),
        (["fetch"], "--model"),
    ]
    for argv, expected in cases:
        code = cli.main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expected in err, (argv, err)
    assert "bigclip fetch" in commands_help()
