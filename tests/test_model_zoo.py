"""OpenCLIP's model zoo by name: every architecture open_clip_torch lists builds in bigclip by that name (OpenCLIP's
own config files, read from the installed package) with exactly OpenCLIP's parameter names (through bigclip's
export mapping) and shapes: all 144 of open_clip_torch 3.3's but the one NOT_EQUAL names with its reason, so a
change that breaks a built one fails here. The Hugging Face text towers' hub repositories (roberta-base,
xlm-roberta-*, google/mt5-*, facebook/nllb-*) are tiny stand-in configs made here and served by a hub on 127.0.0.1:
both libraries download them as a user's would."""

from __future__ import annotations

import json
import subprocess
import sys

import open_clip
import pytest
from fake_hub import FakeHub
from helpers import REPO, subprocess_env
from test_model_sources import offline  # noqa: F401

from bigclip import cli
from bigclip.model import list_models

# The stand-ins' vocabulary (a Hugging Face tower's embedding and anything sized by it)
STAND_IN_VOCAB = 100
# What cannot be equal, each with OpenCLIP's and bigclip's shapes and why in one line
NOT_EQUAL = {
    "coca_roberta-ViT-B-32": (
        {"text_decoder.text_projection": [[768, 49408], [768, STAND_IN_VOCAB]]},
        "OpenCLIP 3.3 sizes this CoCa's caption decoder by CLIPTextCfg's default vocab_size (49408, the config names "
        "none), not by its RoBERTa tower's vocabulary, whose token ids (roberta-base: 50265) overflow it: bigclip "
        "sizes it by the tower's (bigclip/model/coca.py), so captions of any RoBERTa id train",
    ),
}


def _hub_text_repos() -> dict[str, int | None]:
    """The hub repositories OpenCLIP's Hugging Face text towers name (hf_model_name), each with the text width an
    OpenCLIP config pins for it (coca_roberta-ViT-B-32's text_cfg width: its decoder reads the tower's states)."""
    repos: dict[str, int | None] = {}
    for name in open_clip.list_models():
        text = open_clip.get_model_config(name)["text_cfg"]
        if "hf_model_name" in text:
            repos[text["hf_model_name"]] = text.get("width") or repos.get(text["hf_model_name"])
    return repos


def _stand_in(repo: str, width: int | None):
    """A tiny config of the repository's architecture (its model_type, the pad id and the fields OpenCLIP's
    arch_dict reads), made with transformers' own config class: two layers, a vocabulary of STAND_IN_VOCAB."""
    from transformers import M2M100Config, MT5Config, RobertaConfig, XLMRobertaConfig

    width = width or 48  # unpinned: unlike any embed_dim, so the projection's shapes are compared too
    bert_like = {"vocab_size": STAND_IN_VOCAB, "hidden_size": width, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "intermediate_size": 2 * width, "max_position_embeddings": 80}  # fmt: skip
    if repo.startswith("xlm-roberta"):
        return XLMRobertaConfig(**bert_like)
    if repo.startswith("roberta"):
        return RobertaConfig(**bert_like)
    if repo.startswith("google/mt5"):  # OpenCLIP keeps the encoder
        return MT5Config(vocab_size=STAND_IN_VOCAB, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=2,
                         num_decoder_layers=1, num_heads=2)  # fmt: skip
    if repo.startswith("facebook/nllb"):  # NLLB is M2M100's architecture; OpenCLIP keeps the encoder
        return M2M100Config(vocab_size=STAND_IN_VOCAB, d_model=width, encoder_layers=2, decoder_layers=1,
                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * width,
                            decoder_ffn_dim=2 * width, max_position_embeddings=80)  # fmt: skip
    raise AssertionError(f"{repo}: an OpenCLIP text tower this test has no stand-in for")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    repos = {}
    for repo, width in _hub_text_repos().items():
        folder = tmp_path_factory.mktemp("stand_in")
        _stand_in(repo, width).save_pretrained(folder)  # config.json, as the repository holds it
        repos[repo] = {"config.json": (folder / "config.json").read_bytes()}
    hub = FakeHub(repos)
    try:
        # huggingface_hub and transformers read HF_ENDPOINT and HF_HOME when imported: a process of its own
        proc = subprocess.run(
            [sys.executable, "tests/zoo_walk.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            env=subprocess_env(
                HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path_factory.mktemp("hf_home"))
            ),
        )
    finally:
        hub.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), repos, hub.requests


def test_every_openclip_name_is_known_by_name():
    assert set(open_clip.list_models()) <= set(list_models())


@pytest.mark.slow
@pytest.mark.xdist_group("model-zoo")  # one test process: the walk (~60 s) runs once
def test_each_builds_with_openclips_names_and_shapes(zoo):
    zoo, _, _ = zoo
    assert set(zoo) == set(open_clip.list_models())
    # all of 3.3's 144 but NOT_EQUAL: the ViT, ResNet, ConvNeXt, EVA, CoCa, ViTamin, SigLIP/SigLIP 2, CLIPA,
    # worldwide, MobileCLIP and other timm families, and the Hugging Face text towers (RoBERTa, XLM-RoBERTa, mT5, NLLB)
    # from the stand-ins
    unequal = {name: entry for name, entry in zoo.items() if entry[0] != "equal"}
    expected = {n: ["differ", {"missing": [], "extra": [], "shapes": shapes}] for n, (shapes, _) in NOT_EQUAL.items()}
    assert unequal == expected, unequal
    assert all("\n" not in why for _, why in NOT_EQUAL.values())
    for name in ("ViT-g-14", "ViT-e-14", "convnext_xxlarge", "ViT-H-14-378", "ViTamin-XL-384", "coca_ViT-L-14",
                 "EVA02-E-14", "EVA01-g-14", "MobileCLIP-B", "ViT-SO400M-14-SigLIP", "ViT-gopt-16-SigLIP2-384",
                 "ViT-B-16-SigLIP-i18n-256", "ViT-bigG-14-CLIPA-336", "ViT-bigG-14-worldwide-378", "MobileCLIP2-S4",
                 "MobileCLIP-S1", "roberta-ViT-B-32", "xlm-roberta-large-ViT-H-14", "mt5-xl-ViT-H-14",
                 "nllb-clip-large-siglip"):  # fmt: skip
        assert zoo[name][0] == "equal", name


@pytest.mark.slow
@pytest.mark.xdist_group("model-zoo")  # one test process: the walk (~60 s) runs once
def test_the_hugging_face_text_towers_are_built_from_the_hubs_config_alone(zoo):
    """Each of the 10 names with a Hugging Face text tower (7 repositories) downloads its repository's config.json
    through huggingface_hub and nothing else: building on meta reads no weights."""
    zoo, repos, requests = zoo
    hub_names = [n for n in open_clip.list_models() if "hf_model_name" in open_clip.get_model_config(n)["text_cfg"]]
    assert len(hub_names) == 10 and len(repos) == 7, (hub_names, sorted(repos))
    assert [n for n in hub_names if zoo[n][0] != "equal"] == list(NOT_EQUAL)
    files = {(path.split("/resolve/")[0].lstrip("/"), path.rsplit("/", 1)[1]) for path in
             (r.split(" ", 1)[1] for r in requests) if "/resolve/" in path}  # fmt: skip
    assert files == {(repo, "config.json") for repo in repos}, sorted(files)


def test_a_refused_architecture_is_one_line_at_the_command_line(capsys, tmp_path, offline):
    """A Hugging Face text tower whose files the cache lacks, downloads off: one line, before any work."""
    code = cli.main(["--model", "roberta-ViT-B-32", "--dataset-type", "synthetic", "--logs", str(tmp_path),
                     "--cache-dir", str(tmp_path / "hub")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("bigclip: error:") and "\n" not in err, err
    assert "roberta-base" in err
