"""OpenCLIP main's architectures that open_clip_torch 3.3 lacks (configs/openclip_main/, OpenCLIP's files verbatim):
each is known by name and either builds or is refused in one line naming what bigclip lacks (audio, generative,
NaFlex models), which is which pinned here. moderntext-ViT-B-32-256 (main's modern text tower) is built, tested
against main's own code in tests/test_modern_text.py. gte-modernbert-base-ViT-B-32-256 (a Hugging Face ModernBERT
text tower) is built by name against a hub served from memory that holds a tiny stand-in of
Alibaba-NLP/gte-modernbert-base made here (no real hub; OpenCLIP main is not installable, so the oracle is
transformers' own ModernBERT with main's pooling and projection computed in tests/modernbert_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import open_clip
import pytest
import torch
from fake_hub import FakeHub
from helpers import REPO, subprocess_env

from bigclip import cli
from bigclip.model import list_models
from bigclip.model.registry import MAIN_CONFIG_DIR, config_source, get_model_config

# The 37 names of OpenCLIP main (commit 89fb801) that open_clip_torch 3.3 does not list
CLAP = [f"CLAP-{n}" for n in ("HTSAT-base", "HTSAT-base-Roberta-base", "HTSAT-large", "HTSAT-tiny",
        "HTSAT-tiny-Roberta-base", "HTSAT-tiny-Roberta-base-fused", "Whisper-base-Roberta-base",
        "Whisper-small-Roberta-base", "Whisper-tiny-Roberta-base")]  # fmt: skip
NAFLEX_CLAP = [f"naflexclap_{n}" for n in ("base_pf4_pt20_moderntextp", "base_pf8_pt16_moderntext",
               "base_pf8_pt16_moderntextp", "base_pf8_pt20_moderntextp", "little", "little_roberta", "mediumd",
               "mediumd_pf4_pt20_moderntextp", "mediumd_roberta", "test")]  # fmt: skip
GENLAP = [f"naflexgenlap_{n}" for n in ("betwixt", "so150m2", "test_1d", "test_2d")]
GENLIP = [f"naflexgenlip_{n}" for n in ("b16", "so150m2", "so16", "test")]
NAFLEX = ["ViT-B-16-SigLIP2-naflex", "ViT-SO400M-16-SigLIP2-naflex", "naflex_ViT-B-16", "naflex_ViT-B-32"]
# NaFlex image towers with main's modern text tower: refused for their image tower (the text tower is built)
NAFLEX_MODERN_TEXT = [f"moderntext-naflex_ViT-{n}" for n in ("B-16", "B-32", "B-deep-16", "SO150M2-16")]
# (moderntext-ViT-B-32-256: main's modern text tower, tested against main's own code in tests/test_modern_text.py)
BUILT = ["gte-modernbert-base-ViT-B-32-256", "moderntext-ViT-B-32-256"]
# name -> what its one line says bigclip lacks
REFUSED = {
    **{n: "audio (CLAP) models are not built" for n in CLAP + NAFLEX_CLAP},
    **{n: "audio models are not built" for n in GENLAP},
    **{n: "GenLIP models are not built" for n in GENLIP},
    **{n: "NaFlex image towers are not built" for n in NAFLEX + NAFLEX_MODERN_TEXT},
}
HUB_REPO = "Alibaba-NLP/gte-modernbert-base"
# The special tokens' ids in gte-modernbert-base's tokenizer (its config's pad_id is 50283), and its vocabulary size
SPECIAL = {"[UNK]": 50280, "[CLS]": 50281, "[SEP]": 50282, "[PAD]": 50283, "[MASK]": 50284}
VOCAB = 50368
TEXTS = ["a photo of a cat", "two dogs playing on a beach at sunset", "a red car"]  # modernbert_worker.py's


def test_every_name_of_openclip_main_is_known_once_from_openclips_own_files():
    main_only = sorted(p.stem for p in MAIN_CONFIG_DIR.glob("*.json"))
    assert main_only == sorted([*BUILT, *REFUSED]) and len(main_only) == 37
    assert not set(main_only) & set(open_clip.list_models())  # only what 3.3 lacks is kept in bigclip
    names = list_models()
    assert len(names) == len(set(names)) and set(main_only) <= set(names)
    assert all(config_source(n) == "OpenCLIP main" for n in main_only)
    assert config_source("ViT-B-32") == "bigclip" and config_source("EVA02-E-14") == "open_clip_torch"
    for name in main_only:  # the file as OpenCLIP wrote it (read through the registry, a copy of it)
        assert get_model_config(name) == json.loads((MAIN_CONFIG_DIR / f"{name}.json").read_text())


def _tiny_gte_modernbert(directory) -> dict[str, bytes]:
    """The files of a tiny stand-in of Alibaba-NLP/gte-modernbert-base: its special token ids and vocabulary size,
    a word-level tokenizer ([CLS] text [SEP], right padding with [PAD]) and a 2-layer ModernBERT saved in float16
    with that dtype pinned in its config, as the real repository does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import ModernBertConfig, ModernBertModel, PreTrainedTokenizerFast

    words = sorted({w for t in TEXTS for w in t.split()})
    vocab = {**{w: i for i, w in enumerate(words)}, **SPECIAL}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", SPECIAL["[CLS]"]), ("[SEP]", SPECIAL["[SEP]"])]
    )
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
               "mask_token": "[MASK]"}  # fmt: skip
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(directory)
    config = ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=2, max_position_embeddings=512, pad_token_id=SPECIAL["[PAD]"],
                              cls_token_id=SPECIAL["[CLS]"], sep_token_id=SPECIAL["[SEP]"],
                              bos_token_id=SPECIAL["[CLS]"], eos_token_id=SPECIAL["[SEP]"], local_attention=16,
                              global_attn_every_n_layers=2)  # fmt: skip
    torch.manual_seed(0)
    model = ModernBertModel(config)
    with torch.no_grad():
        for p in model.parameters():  # every weight drawn, the norms' too (their init is ones)
            p.normal_(0, 0.2)
    model.half().save_pretrained(directory)
    pinned = json.loads((directory / "config.json").read_text())
    assert pinned.get("dtype", pinned.get("torch_dtype")) == "float16"
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def main_walk(tmp_path_factory):
    files = _tiny_gte_modernbert(tmp_path_factory.mktemp("gte"))
    hub = FakeHub({HUB_REPO: files})
    try:
        # huggingface_hub and transformers read HF_ENDPOINT and HF_HOME when imported: a fresh interpreter
        proc = subprocess.run(
            [sys.executable, "tests/modernbert_worker.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env=subprocess_env(
                HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path_factory.mktemp("hf_home"))
            ),
        )
    finally:
        hub.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.xdist_group("openclip-main-walk")  # one test process: the walk (~9 s) runs once
def test_each_main_name_builds_on_meta_or_is_refused_in_one_line_naming_what_is_missing(main_walk):
    walk = main_walk["walk"]
    assert sorted(walk) == sorted([*BUILT, *REFUSED])
    assert sorted(n for n, (outcome, _) in walk.items() if outcome == "built") == BUILT
    for name, missing in REFUSED.items():
        outcome, line = walk[name]
        assert outcome == "refused" and "\n" not in line, (name, line)
        assert line.startswith(f"--model {name}: ") and f"; {missing} by bigclip yet" in line, line
    # the stand-in's parameters: ViT-B-32 at 256 (OpenCLIP's ViT, here bigclip's), ModernBERT, the projection
    assert walk[BUILT[0]][1] == main_walk["params"] == main_walk["meta_params"]
    assert walk["moderntext-ViT-B-32-256"][1] == 154_757_121  # main's CustomTextCLIP's (tests/test_modern_text.py)


@pytest.mark.slow
@pytest.mark.xdist_group("openclip-main-walk")  # one test process: the walk (~9 s) runs once
def test_gte_modernbert_by_name_gives_modernberts_features_with_main_pooling_and_projection(main_walk):
    assert main_walk["text_features_max_diff"] <= 1e-5 * max(1.0, main_walk["text_features_norm"])
    assert main_walk["text_features_norm"] > 0.1  # not a trivial zero
    # the hub's float16 weights, read into a float32 tower (the pinned dtype cleared, as OpenCLIP main does)
    assert main_walk["dtypes"] == ["torch.float32"] and main_walk["hub_weights_loaded"]
    assert main_walk["max_position_embeddings"] == 256  # main's hf_model_config override of the hub's 512
    # exported as OpenCLIP main's CustomTextCLIP keeps it: the Hugging Face model under text.transformer, text.proj
    assert main_walk["text_names"] == sorted([*main_walk["reference_names"], "text.proj.weight"])
    assert main_walk["meta_init_equal"]


@pytest.mark.slow
@pytest.mark.xdist_group("openclip-main-walk")  # one test process: the walk (~9 s) runs once
def test_gte_modernbert_tokenizes_as_openclip_mains_hf_tokenizer_does(main_walk):
    """[CLS] words [SEP], right-padded with [PAD] to the config's context length (256)."""
    words = sorted({w for t in TEXTS for w in t.split()})
    cls, sep, pad = SPECIAL["[CLS]"], SPECIAL["[SEP]"], SPECIAL["[PAD]"]
    expected = [([cls] + [words.index(w) for w in t.split()] + [sep] + [pad] * 10)[:10] for t in TEXTS]
    assert main_walk["tokens_shape"] == [3, 256] and main_walk["tokens"] == expected


@pytest.mark.parametrize(
    "name", ["CLAP-HTSAT-base", "naflex_ViT-B-16", "moderntext-naflex_ViT-B-16", "naflexgenlip_b16"]
)
def test_a_refused_main_name_is_one_line_at_the_command_line_before_any_work(name, capsys, tmp_path):
    code = cli.main(["--model", name, "--dataset-type", "synthetic", "--logs", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and f"--model {name}: " in err and "not built by bigclip yet" in err, err
    assert not os.path.exists(tmp_path / "logs")
