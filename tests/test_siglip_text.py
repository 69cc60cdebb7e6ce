"""OpenCLIP's text-tower variants (SigLIP/SigLIP 2, CLIPA, the worldwide models, MobileCLIP) against OpenCLIP, the
oracle.

Tiny configs in OpenCLIP's layout of each family (the keys its configs set: no_causal_mask, pool_type last/eos with
eos_id, proj_bias, proj_type none, act_kwargs, norm_kwargs, custom_text, init_logit_bias; CLIPA's ViT keys
no_ln_pre, pool_type avg, final_ln_after_pool), saved as OpenCLIP's local-dir: models with random weights OpenCLIP
drew: bigclip loads them with OpenCLIP's text and image features (1e-5), and its export loads back into OpenCLIP
strictly with the same features. Tokenizers: SigLIP's, CLIPA's and the worldwide models' are Hugging Face
tokenizers on the hub, which these machines do not reach: tiny stand-ins made here are put in a hub cache built
by hand (and served by a fake hub for `bigclip fetch`), and bigclip's tokenizer of each name gives exactly
open_clip.get_tokenizer's ids; without them, a run stops in one line naming what to fetch. The engines: a tiny
SigLIP-style model trains alike on one process and on 2 gloo ranks (DDP, FSDP2, ZeRO-3).
"""

from __future__ import annotations

import json
import os

import open_clip
import pytest
import torch
from fake_hub import FakeHub
from safetensors.torch import save_file
from test_engine_multiprocess import DS, FP32_RTOL, assert_same_run, run_worker
from test_hub_fetch import bigclip_child
from test_model_sources import hub_cache, offline  # noqa: F401

from bigclip import cli
from bigclip.config import resolve
from bigclip.errors import UserError
from bigclip.model import bigclip_to_openclip, create_model, get_tokenizer
from bigclip.model.text import TextTransformer

TOL = 1e-5
VIT = {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8}
TEXT = {"context_length": 12, "vocab_size": 64, "width": 32, "heads": 2, "layers": 2}
# Each family's keys as OpenCLIP's own configs of it set them (model_configs/<name>.json), at tiny widths.
FAMILIES = {
    "siglip2": {  # ViT-B-16-SigLIP2: a timm tower with a MAP pooler, bidirectional text pooled at its last position
        "embed_dim": 96,
        "init_logit_bias": -10,
        "custom_text": True,
        "vision_cfg": {
            "image_size": 160,
            "timm_model_name": "test_vit3",
            "timm_model_pretrained": False,
            "timm_pool": "map",
            "timm_proj": "none",
        },
        "text_cfg": {
            **TEXT,
            "hf_tokenizer_name": "timm/ViT-B-16-SigLIP2",
            "tokenizer_kwargs": {"clean": "canonicalize"},
            "no_causal_mask": True,
            "proj_bias": True,
            "pool_type": "last",
            "norm_kwargs": {"eps": 1e-6},
            "act_kwargs": {"approximate": "tanh"},
        },
    },  # fmt: skip
    "siglip_i18n": {  # ViT-SO400M-16-SigLIP-i18n-256: no text projection (the text's width is the embedding's)
        "embed_dim": 32,
        "init_logit_bias": -10,
        "custom_text": True,
        "vision_cfg": {**VIT, "width": 32, "head_width": 16},
        "text_cfg": {
            "hf_tokenizer_name": "timm/ViT-B-16-SigLIP-i18n-256",
            **TEXT,
            "no_causal_mask": True,
            "pool_type": "last",
            "proj_type": "none",
            "norm_kwargs": {"eps": 1e-6},
            "act_kwargs": {"approximate": "tanh"},
        },
    },  # fmt: skip
    "mobileclip": {  # MobileCLIP-S1: a timm tower with its own head, bidirectional text pooled at the largest id
        "embed_dim": 32,
        "custom_text": True,
        "vision_cfg": {
            "image_size": 32,
            "timm_model_name": "test_convnext",
            "timm_model_pretrained": False,
            "timm_pool": "avg",
            "timm_proj": None,
            "timm_drop": 0.0,
            "timm_drop_path": 0.0,
        },
        "text_cfg": {**TEXT, "vocab_size": 49408, "no_causal_mask": True},
    },  # fmt: skip
    "clipa": {  # ViT-L-14-CLIPA: no ln_pre, mean-pooled patches normalised after pooling; not custom_text
        "embed_dim": 32,
        "vision_cfg": {**VIT, "no_ln_pre": True, "pool_type": "avg", "final_ln_after_pool": True},
        "text_cfg": {
            **TEXT,
            "hf_tokenizer_name": "bert-base-uncased",
            "tokenizer_kwargs": {"strip_sep_token": True},
            "pool_type": "last",
            "no_causal_mask": True,
        },
    },  # fmt: skip
    "worldwide": {  # ViT-H-14-worldwide: causal text pooled at its first eos_id, QuickGELU
        "embed_dim": 32,
        "quick_gelu": True,
        "vision_cfg": VIT,
        "text_cfg": {**TEXT, "hf_tokenizer_name": "facebook/xlm-v-base", "pool_type": "eos", "eos_id": 2},
    },
}


def save_local_dir(directory, model_cfg: dict, seed: int = 0):
    """OpenCLIP's model of `model_cfg` as a local-dir: folder, every tensor drawn at random by OpenCLIP's model (not
    only what its init sets: biases and norms too), its weights saved beside the config. Returns (name, model)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": {}}, f)
    name = f"local-dir:{directory}"
    theirs = open_clip.create_model(name).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.1)
    save_file(
        {k: v.contiguous() for k, v in theirs.state_dict().items()},
        os.path.join(directory, "open_clip_model.safetensors"),
    )
    return name, theirs


def tokens_with_padding(text_cfg: dict, n: int = 4) -> torch.Tensor:
    """Token ids as the families' tokenizers lay them out: text, an end token, then padding (id 0), of several
    lengths (one row full, one with an early eos_id), so the pooling's choice of position matters."""
    g = torch.Generator().manual_seed(3)
    length, vocab = text_cfg["context_length"], text_cfg["vocab_size"]
    tokens = torch.randint(3, min(vocab, 60), (n, length), generator=g)
    for row, used in enumerate([length, 7, 4, 2][:n]):
        tokens[row, used:] = 0
        tokens[row, used - 1] = vocab - 1 if text_cfg.get("pool_type", "argmax") == "argmax" else 2  # end of text
    tokens[0, 3] = 2  # an eos_id before the end: eos pooling takes the first
    return tokens


def features(model, tokens: torch.Tensor, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.encode_text(tokens, normalize=True), model.encode_image(images, normalize=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_openclip_weights_give_openclips_features_and_the_export_loads_back(family, tmp_path):
    cfg = FAMILIES[family]
    name, theirs = save_local_dir(str(tmp_path / family), cfg)
    ours = create_model(name).eval()  # the folder's weights, OpenCLIP's layout, loaded strictly
    assert ours.openclip_separate_text == bool(cfg.get("custom_text"))
    tokens = tokens_with_padding(cfg["text_cfg"])
    size = cfg["vision_cfg"]["image_size"]  # (test_vit3's own: OpenCLIP builds a timm trunk at its default size)
    images = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(4))
    expected = features(theirs, tokens, images)
    got = features(ours, tokens, images)
    for what, a, b in zip(("text", "image"), got, expected):
        assert a.shape == b.shape, what
        assert (a - b).abs().max().item() <= TOL, (what, (a - b).abs().max().item())
    assert (ours.logit_bias is not None) == ("init_logit_bias" in cfg)
    # bigclip's export (its names through the export mapping) is OpenCLIP's model of the config, strictly
    exported = bigclip_to_openclip(ours.state_dict(), ours.openclip_separate_text)
    reference = theirs.state_dict()
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k].reshape(reference[k].shape), reference[k]) for k in reference)
    fresh = open_clip.create_model(name, load_weights=False).eval()
    fresh.load_state_dict(exported, strict=True)
    for a, b in zip(features(fresh, tokens, images), expected):
        assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("family, unlocked", [("siglip2", 0), ("siglip2", 1), ("siglip_i18n", 2), ("clipa", 3)])
def test_lock_text_freezes_what_openclip_freezes(family, unlocked, tmp_path):
    """OpenCLIP's groups of these towers: embeddings, each block (the last with ln_final), the projection (an
    nn.Linear with its bias; none without a projection)."""
    name, theirs = save_local_dir(str(tmp_path / family), FAMILIES[family])
    ours = create_model(name)
    theirs.lock_text_tower(unlocked)
    ours.lock_text_tower(unlocked)
    names = {v: k for k, v in ours.openclip_names().items()}  # OpenCLIP's name -> bigclip's
    expected = {n: p.requires_grad for n, p in theirs.named_parameters() if not n.startswith(("visual.", "logit"))}
    got = dict(ours.named_parameters())
    assert {n: got[names.get(n, n)].requires_grad for n in expected} == expected
    assert any(expected.values()) == bool(unlocked)


def test_pooling_and_masking_are_what_the_config_says():
    """The OpenCLIP configs' keys reach the tower; and with the same weights, a token after the first eos_id leaves a
    causal eos-pooled feature unchanged but changes the bidirectional one."""
    bidirectional = create_model("ViT-B-16-SigLIP", device="meta").text
    assert not bidirectional.causal and bidirectional.pool_type == "last"
    assert isinstance(bidirectional.text_projection, torch.nn.Linear)
    assert bidirectional.ln_final.eps == 1e-6
    siglip2 = create_model("ViT-B-16-SigLIP2", device="meta").text
    assert siglip2.blocks[0].mlp.gelu.approximate == "tanh"
    worldwide = create_model("ViT-H-14-worldwide", device="meta").text
    assert worldwide.causal and worldwide.pool_type == "eos" and worldwide.eos_id == 2
    assert create_model("ViT-SO400M-16-SigLIP-i18n-256", device="meta").text.text_projection is None
    text_cfg = {k: v for k, v in FAMILIES["worldwide"]["text_cfg"].items() if k != "hf_tokenizer_name"}
    torch.manual_seed(0)
    causal = TextTransformer(embed_dim=32, **text_cfg).eval()
    causal.init_weights()  # (built on the default device: init_weights fills it)
    both = TextTransformer(embed_dim=32, **{**text_cfg, "no_causal_mask": True}).eval()
    both.load_state_dict(causal.state_dict())  # the same weights, only the mask differs
    tokens = torch.tensor([[5, 6, 2, 7, 8, 0, 0, 0, 0, 0, 0, 0]])
    later = tokens.clone()
    later[0, 4] = 9  # after the first eos_id (position 2)
    with torch.no_grad():
        assert torch.equal(causal(tokens), causal(later))
        assert not torch.allclose(both(tokens), both(later))


# ------------------------------------------------------------------------------------------------- tokenizers
CAPTIONS = [
    "A photo of a CAT!",
    "two dogs playing on a beach at sunset",
    "a red car, a red car & a cat",
    "",
    "unknown words here " * 6,
]
WORDS = ["a", "photo", "of", "cat", "two", "dogs", "playing", "on", "beach", "at", "sunset", "red", "car"]


def stand_in_tokenizer(kind: str) -> dict[str, bytes]:
    """The files of a tiny Hugging Face tokenizer laid out as the named family's (special tokens, what it adds
    around a text), made here: t5 (SigLIP: text then </s>, <pad> 0), gemma (SigLIP 2: text then <eos>), bert
    (CLIPA: [CLS] text [SEP], lower-cased), xlmr (worldwide: <s> text </s>, pad 1, eos 2). Plus the config.json the
    hub repositories hold (a timm or Hugging Face model's), which AutoTokenizer reads."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = {
        "t5": (["<pad>", "</s>", "<unk>"], {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}),
        "gemma": (["<pad>", "<eos>", "<bos>", "<unk>"], {"pad_token": "<pad>", "eos_token": "<eos>",
                                                        "bos_token": "<bos>", "unk_token": "<unk>"}),
        "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]"], {"pad_token": "[PAD]", "unk_token": "[UNK]",
                                                       "cls_token": "[CLS]", "sep_token": "[SEP]"}),
        "xlmr": (["<s>", "<pad>", "</s>", "<unk>"], {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>",
                                                    "unk_token": "<unk>"}),
    }[kind]  # fmt: skip
    vocab = {token: i for i, token in enumerate([*specials[0], *WORDS, ",", "&", "!"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token=specials[1]["unk_token"]))
    if kind == "bert":
        words.normalizer = normalizers.Lowercase()
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    template = {"t5": "$A </s>", "gemma": "$A <eos>", "bert": "[CLS] $A [SEP]", "xlmr": "<s> $A </s>"}[kind]
    used = [t for t in specials[0] if t in template]
    words.post_processor = processors.TemplateProcessing(single=template, special_tokens=[(t, vocab[t]) for t in used])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, **specials[1])
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"stand_in_{kind}_{os.getpid()}")
    tokenizer.save_pretrained(folder)
    files = {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}
    files["config.json"] = json.dumps({"architecture": f"stand-in-{kind}"}).encode()
    return files


# (an architecture of each family, the repository its text_cfg names, the stand-in's layout)
TOKENIZED = [
    ("ViT-B-16-SigLIP", "timm/ViT-B-16-SigLIP", "t5"),
    ("ViT-SO400M-14-SigLIP2", "timm/ViT-SO400M-14-SigLIP2", "gemma"),
    ("ViT-L-14-CLIPA", "bert-base-uncased", "bert"),
    ("ViT-H-14-worldwide", "facebook/xlm-v-base", "xlmr"),
]


@pytest.fixture(scope="module")
def stand_in_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hub"))
    for _, repo, kind in TOKENIZED:
        hub_cache(cache, repo, stand_in_tokenizer(kind))
    return cache


@pytest.mark.parametrize("name, repo, kind", TOKENIZED)
@pytest.mark.parametrize("context_length", [None, 6])
def test_each_familys_tokenizer_gives_open_clips_ids(name, repo, kind, context_length, stand_in_cache, offline):
    theirs = open_clip.get_tokenizer(name, context_length=context_length, cache_dir=stand_in_cache)(CAPTIONS)
    ours = get_tokenizer(name, context_length=context_length, cache_dir=stand_in_cache)(CAPTIONS)
    assert ours.dtype == torch.long and torch.equal(ours, theirs), (ours, theirs)
    assert ours.shape == (len(CAPTIONS), context_length or create_model(name, device="meta").text.context_length)
    assert ours.max() < 30  # the stand-in's ids, not OpenCLIP's BPE (whose end of text is 49407)
    if kind == "bert":  # CLIPA's strip_sep_token: the [SEP] (id 3) becomes padding
        assert not (ours == 3).any() and (ours[:, 0] == 2).all()
    if kind == "t5":  # SigLIP's canonicalize: lower-cased, punctuation gone ("!" is id 18 here), </s> (1) last
        assert not (ours == 18).any() and ours[0, :6].tolist() == [3, 4, 5, 3, 6, 1]


def test_a_missing_tokenizer_is_one_line_naming_what_to_fetch(tmp_path, offline, capsys):
    empty = str(tmp_path / "empty")
    with pytest.raises(UserError) as e:
        get_tokenizer("ViT-B-16-SigLIP", cache_dir=empty)
    line = str(e.value)
    assert "\n" not in line and "timm/ViT-B-16-SigLIP" in line and "`bigclip fetch --model ViT-B-16-SigLIP`" in line
    # a run with downloads off stops at validation, before the model is built
    logs = tmp_path / "logs"
    code = cli.main(["--model", "ViT-SO400M-14-SigLIP", "--dataset-type", "synthetic", "--cache-dir", empty,
                     "--logs", str(logs), "--name", "r"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "`bigclip fetch --model ViT-SO400M-14-SigLIP`" in err and "timm/ViT-B-16-SigLIP " in err  # (its config's)
    assert not (logs / "r").exists()


def test_validation_passes_where_the_cache_holds_the_tokenizer(stand_in_cache, offline):
    cfg = resolve({"model": "ViT-L-14-CLIPA", "dataset_type": "synthetic", "cache_dir": stand_in_cache})
    assert cfg.sections.model.model == "ViT-L-14-CLIPA"


# Extended tier: 1 min; in CI `bigclip fetch` by test_hub_fetch.py and the offline tokenizer from a cache (above)
@pytest.mark.extended
def test_bigclip_fetch_fetches_the_tokenizer_for_an_offline_run(tmp_path):
    hub = FakeHub({"timm/ViT-B-16-SigLIP": stand_in_tokenizer("t5")})
    cache = str(tmp_path / "hub")
    try:
        fetched = bigclip_child(["fetch", "--model", "ViT-B-16-SigLIP", "--cache-dir", cache],
                                HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0")  # fmt: skip
    finally:
        hub.close()
    assert fetched.returncode == 0, (fetched.stderr[-3000:], hub.requests)
    assert "tokenizer timm/ViT-B-16-SigLIP" in fetched.stdout and cache in fetched.stdout
    assert any("tokenizer.json" in r for r in hub.requests)
    # downloads off: fetch finds it all in the cache, and the run's tokenizer is read from there
    offline_fetch = bigclip_child(["fetch", "--model", "ViT-B-16-SigLIP", "--cache-dir", cache], HF_HUB_OFFLINE="1")
    assert offline_fetch.returncode == 0, offline_fetch.stderr[-3000:]
    empty = bigclip_child(["fetch", "--model", "ViT-B-16-SigLIP", "--cache-dir", str(tmp_path / "e")],
                          HF_HUB_OFFLINE="1")  # fmt: skip
    assert empty.returncode == 2 and len(empty.stderr.strip().splitlines()) == 1, empty.stderr[-3000:]
    assert "bigclip fetch --model ViT-B-16-SigLIP" in empty.stderr


# ------------------------------------------------------------------------------------------------- engines
# A tiny SigLIP 2 (bidirectional text, last-position pooling, projection with a bias, a timm MAP tower, a learned
# logit bias) whose token ids the engine worker draws itself (byte tokenizer: no hub).
TINY_SIGLIP = {**FAMILIES["siglip2"], "tokenizer": "byte"}
TINY_SIGLIP["text_cfg"] = {
    k: v for k, v in TINY_SIGLIP["text_cfg"].items() if k not in ("hf_tokenizer_name", "tokenizer_kwargs")
}
TINY_SIGLIP["text_cfg"]["vocab_size"] = 259


@pytest.mark.slow
def test_a_tiny_siglip_trains_alike_on_one_process_and_under_ddp_fsdp2_and_zero3(tmp_path):
    """2 ranks x batch 4 == one process x batch 8 on the same samples, step by step (losses and gradient norms):
    with the CLIP loss on gathered features (--gather-with-grad: each rank's loss is the global one) and with the
    SigLIP loss (each rank's loss is its images' share: their mean is the global one). FSDP2 (activation
    checkpointing per block) and ZeRO-3 give DDP's losses; the model has OpenCLIP's parameter count."""
    tiny = {"model": "tiny-siglip2", "batch_size": 4}

    def run(name, steps=4, **config):
        return {"name": name, "steps": steps, "arch": TINY_SIGLIP, "config": {**tiny, **config}}

    two = run_worker(tmp_path, [
        run("ddp"), {**run("ddp_siglip", siglip=True), "mean_loss": True},
        run("fsdp", engine="fsdp", grad_checkpointing=True), run("zero3", ds_config=DS[3]),
    ], name="two")  # fmt: skip
    one = run_worker(tmp_path, [
        {**run("single", batch_size=8), "ranks_emulated": 2},
        {**run("single_siglip", batch_size=8, siglip=True), "ranks_emulated": 2},
    ], name="one", nproc=1)  # fmt: skip
    assert two["ddp"]["losses"][-1] < two["ddp"]["losses"][0]
    assert_same_run(one["single"], two["ddp"], FP32_RTOL)
    assert_same_run(one["single_siglip"], two["ddp_siglip"], FP32_RTOL)
    assert two["ddp_siglip"]["losses"] != two["ddp"]["losses"]
    for name in ("fsdp", "zero3"):
        assert_same_run(two[name], two["ddp"], FP32_RTOL)
    assert two["ddp"]["num_params"] == sum(p.numel() for p in open_clip.create_model(_local(tmp_path)).parameters())


def _local(tmp_path) -> str:
    """TINY_SIGLIP as an OpenCLIP local-dir: (its parameter count, OpenCLIP's own)."""
    directory = tmp_path / "openclip"
    directory.mkdir(exist_ok=True)
    cfg = {k: v for k, v in TINY_SIGLIP.items() if k != "tokenizer"}
    (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    return f"local-dir:{directory}"
