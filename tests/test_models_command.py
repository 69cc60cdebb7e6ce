"""`bigclip models`: every name --model takes, listed once, with the parameter count OpenCLIP's own model of that name
has (open_clip built on the meta device, the oracle), its tower family read from the config, and why a name is not
built; the counts kept in a cache under XDG_CACHE_HOME that is read only while the model code it was made with is
unchanged."""

from __future__ import annotations

import json
import re

import open_clip
import pytest
import torch

from bigclip import cli
from bigclip.commands import models
from bigclip.model import list_models
from bigclip.model.registry import MAIN_CONFIG_DIR

# A sample across families: (name, family as listed)
SAMPLE = {
    "ViT-B-32": "ViT",
    "RN50": "ResNet",
    "coca_ViT-B-32": "CoCa ViT",
    "ViT-H-14-378": "ViT",
    "ViT-e-14": "ViT",
    "convnext_base": "timm:convnext",
    "EVA02-B-16": "timm:eva",
    "EVA02-E-14": "timm:eva",
    "ViTamin-S": "timm:vitamin",
    "PE-Core-S-16-384": "timm:eva",
    "MobileCLIP-B": "timm:vision_transformer_hybrid",
    "swin_base_patch4_window7_224": "timm:swin_transformer",
}
ROW = re.compile(r"^(\S+)\s+([\d,]+|-)\s+(.+?)\s{2,}(bigclip|open_clip_torch|OpenCLIP main)(?:\s{2,}(.*))?$")

# The tests that read the listing run in one test process (pytest-xdist's loadgroup), which counts every model once
# (~1 min) for all of them: the fixture lives as long as the process (a module's would be made again after another
# module's tests ran in between).
LISTING = pytest.mark.xdist_group("models-listing")


@pytest.fixture(scope="session")
def listing(tmp_path_factory):
    """`bigclip models` run twice on an empty cache: the first counts every model, the second reads the cache."""
    cache = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        first = models.entries()
        stored = json.loads(models.cache_file().read_text())
        second = models.entries()
    return first, second, stored


def _openclip_params(name: str) -> int:
    with torch.device("meta"):
        model = open_clip.create_model(name, pretrained=None, device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@LISTING
def test_every_name_is_listed_once(listing):
    first, _, _ = listing
    names = [name for name, *_ in first]
    assert names == list_models() and len(set(names)) == len(names)
    main_only = {p.stem for p in MAIN_CONFIG_DIR.glob("*.json")}
    assert set(open_clip.list_models()) | main_only | {"test-tiny", "ViT-B-32"} <= set(names)


@pytest.mark.slow
@LISTING
def test_listed_counts_are_openclips_own_and_families_are_read_from_the_configs(listing):
    rows = {name: (params, family) for name, params, family, _ in listing[0]}
    for name, family in SAMPLE.items():
        params, listed_family = rows[name]
        assert params == _openclip_params(name), name
        assert listed_family == family, name
    assert rows["roberta-ViT-B-32"][1] == "ViT + HF text: roberta-base"
    assert rows["nllb-clip-base-siglip"][1] == "timm:vision_transformer + HF text: nllb-200-distilled-600M"
    assert rows["CLAP-HTSAT-base"] == ("audio (CLAP) models are not built by bigclip yet", "audio: HTSAT-base")
    # OpenCLIP main's modern text tower: built, counted as main's CustomTextCLIP (tests/test_modern_text.py)
    assert rows["moderntext-ViT-B-32-256"] == (154_757_121, "ViT + modern text")
    assert rows["moderntext-naflex_ViT-B-16"][0] == "NaFlex image towers are not built by bigclip yet"
    # offline with an empty hub cache: a Hugging Face text tower says what to download, nothing is fetched
    assert rows["roberta-ViT-B-32"][0] == "hub config not cached: huggingface-cli download roberta-base"


@pytest.mark.slow
@LISTING
def test_the_second_listing_reads_the_cache_and_a_changed_code_digest_counts_again(listing, tmp_path, monkeypatch):
    first, second, stored = listing
    assert second == first
    assert stored["code"] == models.code_digest()
    # the cache is what the second listing read: a count planted in it under the current digest is listed ...
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = models.config_key(models.get_model_config("RN50"))
    planted = {"code": stored["code"], "counts": {**stored["counts"], key: 12345}}
    models.cache_file().parent.mkdir(parents=True)
    models.cache_file().write_text(json.dumps(planted))
    assert models.entries(["RN50", "ViT-B-32"])[0][1] == 12345
    # ... and under another digest (other model code or libraries) it is not: RN50 is counted again, and the cache
    # starts over with the new digest
    models.cache_file().write_text(json.dumps({**planted, "code": "other"}))
    assert models.entries(["RN50"])[0][1] == _openclip_params("RN50")
    assert json.loads(models.cache_file().read_text()) == {
        "code": stored["code"],
        "counts": {key: stored["counts"][key]},
    }
    # --no-cache counts again and keeps what it counted
    models.cache_file().write_text(json.dumps(planted))
    assert models.entries(["RN50"], use_cache=False)[0][1] == _openclip_params("RN50")
    assert json.loads(models.cache_file().read_text())["counts"] == stored["counts"]


@pytest.mark.slow
@LISTING
def test_the_table_at_the_command_line(listing, tmp_path, monkeypatch, capsys):
    _, _, stored = listing
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    models.cache_file().parent.mkdir(parents=True)
    models.cache_file().write_text(json.dumps(stored))  # the listing's counts: the table is not counted again
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {m.group(1): m.groups()[1:] for m in map(ROW.match, lines[1:-1])}
    assert len(rows) == len(lines) - 2 == len(list_models())
    assert rows["ViT-B-32"] == ("151,277,313", "ViT", "bigclip", None)
    assert rows["EVA02-E-14"][:3] == (f"{_openclip_params('EVA02-E-14'):,}", "timm:eva", "open_clip_torch")
    params, _, source, why = rows["naflex_ViT-B-16"]
    assert (params, source, why) == ("-", "OpenCLIP main", "NaFlex image towers are not built by bigclip yet")
    assert all(why is None or len(why) <= models.WHY_WIDTH for *_, why in rows.values())
    assert lines[-1].startswith(f"{len(rows)} names, ")
    # a few names, as asked; an unknown one is one line
    assert cli.main(["models", "ViT-e-14", "convnext_xxlarge"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[1:-1]] == [
        ["ViT-e-14", "4,581,086,465"],
        ["convnext_xxlarge", "1,200,576,385"],
    ]
    assert cli.main(["models", "ViT-Q-99"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bigclip models ViT-Q-99: unknown architecture" in err, err
