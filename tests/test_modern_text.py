"""OpenCLIP main's modern text tower (moderntext-ViT-B-32-256) in bigclip, against OpenCLIP main's own code: its
ModernTextTransformer, CLIPTextCfg and TikTokenTokenizer copied byte for byte into tests/openclip_main_modern_text.py
(OpenCLIP main is not installable; the copy is checked here against the hashes of the commit's lines).

The oracle's model is what main's CustomTextCLIP holds for these configs: OpenCLIP's VisionTransformer (open_clip
3.3's `_build_vision_tower`, which main keeps: names bigclip already maps), the modern text tower under `text.`, and
a 0-dim logit_scale. tiktoken's encodings are downloaded on first use, which no test here can do: a tiny stand-in
r50k_base (its byte-level pattern, 256 bytes and a few merges, its end-of-text at 50256, so the control ids are
r50k_base's: eot 50257, pad 50258, bos 50259) is put where tiktoken keeps the encodings it has loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import open_clip
import openclip_main_modern_text as main
import pytest
import tiktoken
import tiktoken.registry
import torch
from safetensors.torch import save_file
from test_engine_multiprocess import DS, FP32_RTOL, assert_same_run, run_worker
from tiktoken_ext.openai_public import r50k_pat_str
from torch import nn

from bigclip import cli
from bigclip.errors import UserError
from bigclip.memory.size import model_facts
from bigclip.memory.traced import trace_activations
from bigclip.model import bigclip_to_openclip, create_model, get_model_config, get_tokenizer
from bigclip.model.towers import text_tower

NAME = "moderntext-ViT-B-32-256"
ORACLE = os.path.join(os.path.dirname(__file__), "openclip_main_modern_text.py")
# (first line, number of lines, sha256) of each span copied from OpenCLIP main at 89fb801 (model.py 79-150,
# transformer.py 957-1576 and 2034-2053, tokenizer.py 704-804, open_clip_train/naflex_data.py 157-193), hashed from
# the repository's files
SPANS = [
    ("@dataclass\nclass CLIPTextCfg:", 72, "c8c84a7a1c4d7ac25ae035b3d5379e8e0cf50af1c476d157035e41610a3c0c95"),
    ("class SwiGLU(nn.Module):", 620, "da9cf2c096ddef736162e4083aa89de2d37a56de1ad98b9ae0cf3890f06a55d9"),
    ("def _set_group_requires_grad(", 20, "e295b2162bb24645b48eacdf6e12993d2a2b0c9cd05d9fa0f37b5485e074c361"),
    ("class TikTokenTokenizer:", 101, "d3b05ce36cb6d78b10cf7acca13af483b8cbcfff13c71ecac75716064b198548"),
    ("def collate_variable_text(", 37, "928ade94b28c793f92a72d428f8df9d16821638deae0fa5077847d5df0eea274"),
]
VIT = {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8}
# the moderntext-ViT-B-32-256 text_cfg's flags at tiny widths (ids of the byte-level stand-in's r50k_base)
TINY_TEXT = {**get_model_config(NAME)["text_cfg"], "context_length": 16, "width": 32, "heads": 2, "layers": 2}
# the other switches of main's tower: bidirectional, MAP pooling with qk-norm, LayerNorm, GELU MLP, biases, layer
# scale, the embedding pre-norm, sandwich norms, register tokens, a projection bias
OTHER_TEXT = {
    **TINY_TEXT, "attention_mode": "bidirectional", "pool_type": "map", "qk_norm": True, "norm_type": "layernorm",
    "mlp_type": "mlp", "attention_bias": True, "mlp_bias": True, "ls_init_value": 0.5, "pre_norm": True,
    "norm_placement": "sandwich", "reg_tokens": 2, "proj_bias": True, "attn_gated": False, "pos_embed": "none",
}  # fmt: skip
MEAN_TEXT = {**TINY_TEXT, "pool_type": "mean", "mlp_type": "relu2", "attn_gated": True, "gate_bias": True}
CONFIGS = {"moderntext": TINY_TEXT, "other": OTHER_TEXT, "mean": MEAN_TEXT}
TOL = 1e-5


def test_the_oracle_is_openclip_mains_code_byte_for_byte():
    lines = open(ORACLE).read().split("\n")
    for first, count, digest in SPANS:
        start = next(i for i in range(len(lines)) if "\n".join(lines[i:]).startswith(first))
        assert hashlib.sha256("\n".join(lines[start : start + count]).encode()).hexdigest() == digest, first


class OracleCLIP(nn.Module):
    """What OpenCLIP main's CustomTextCLIP holds (its __init__: visual, text, logit_scale) and how it encodes."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.visual = open_clip.model._build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
        self.text = main.ModernTextTransformer(main.CLIPTextCfg(**cfg["text_cfg"]), output_dim=cfg["embed_dim"])
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_text(self, tokens, normalize=False):
        features = self.text(tokens)
        return nn.functional.normalize(features, dim=-1) if normalize else features


def test_moderntext_by_name_has_openclip_mains_names_and_shapes():
    """create_model by name on meta; its export: every name and shape of main's CustomTextCLIP of that config."""
    ours = create_model(NAME, device="meta")
    assert ours.openclip_separate_text  # main builds modern / variable text as CustomTextCLIP
    exported = {k: tuple(v.shape) for k, v in bigclip_to_openclip(ours.state_dict(), True).items()}
    with torch.device("meta"):
        theirs = OracleCLIP(get_model_config(NAME))
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert exported == expected
    assert any(k.startswith("text.blocks.11.attn.gate") for k in expected)  # the gated attention is there
    n = sum(p.numel() for p in theirs.parameters())
    assert sum(p.numel() for p in ours.parameters()) == n == 154_757_121
    assert model_facts(NAME).params == n  # what `bigclip plan` counts


def save_local_dir(directory, text_cfg: dict, seed: int = 0):
    """The oracle's model of a tiny config, every tensor drawn at random, as OpenCLIP saves a model (local-dir:)."""
    cfg = {"embed_dim": 24, "vision_cfg": VIT, "text_cfg": text_cfg}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": cfg, "preprocess_cfg": {}}, f)
    theirs = OracleCLIP(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, f"{directory}/open_clip_model.safetensors")
    return f"local-dir:{directory}", theirs


def captions(text_cfg: dict, length: int) -> torch.Tensor:
    """Token ids as main's tokenizer lays them out, `length` wide: bos, text, eos, then pad; one row cut (no eos: the
    last real token pools), one with an eos inside, one all padding but its bos."""
    bos, eos, pad = text_cfg["bos_id"], text_cfg["eos_id"], text_cfg["pad_id"]
    g = torch.Generator().manual_seed(5)
    rows = []
    for used in (length, 9, 5, 1):
        row = torch.randint(0, 50000, (length,), generator=g)
        row[0], row[used:] = bos, pad
        if 1 < used < length:
            row[used - 1] = eos
        rows.append(row)
    rows[2][2] = eos  # the first eos pools
    return torch.stack(rows)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_openclip_mains_weights_give_its_features_and_the_export_loads_back(config, tmp_path):
    text_cfg = CONFIGS[config]
    name, theirs = save_local_dir(str(tmp_path / config), text_cfg)
    ours = create_model(name).eval()  # the folder's weights through bigclip's import, loaded strictly
    theirs, ours = theirs.double(), ours.double()
    for length in (16, 11):  # the context length, and a shorter batch (variable_text: padded to its longest)
        tokens = captions(text_cfg, length)
        with torch.no_grad():
            expected, got = theirs.encode_text(tokens), ours.encode_text(tokens)
        assert got.shape == expected.shape == (4, 24)
        assert (got - expected).abs().max().item() <= TOL * expected.abs().max().item()
    exported = bigclip_to_openclip(ours.state_dict(), ours.openclip_separate_text)
    fresh = OracleCLIP(json.load(open(tmp_path / config / "open_clip_config.json"))["model_cfg"]).double().eval()
    fresh.load_state_dict(exported, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh.encode_text(tokens), theirs.encode_text(tokens))


def test_fresh_init_is_openclip_mains():
    """init_weights draws what main's init_parameters draws (per tensor: std, zero rows, biases, norms at one)."""
    cfg = {**TINY_TEXT, "width": 64, "layers": 4, "heads": 4}
    torch.manual_seed(0)
    theirs = main.ModernTextTransformer(main.CLIPTextCfg(**cfg), output_dim=32)
    ours = text_tower(32, cfg, quick_gelu=False)
    ours.init_weights()
    mine, ref = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == ref.keys()
    for k, v in ref.items():
        assert mine[k].shape == v.shape, k
        if v.numel() > 1000:  # the spread of a large tensor (its std within 5%)
            assert mine[k].std().item() == pytest.approx(v.std().item(), rel=0.05), k
        else:
            assert torch.equal(mine[k], v), k  # norms at one, no biases here
    assert not mine["token_embedding.weight"][cfg["pad_id"]].any()


@pytest.mark.parametrize("config, unlocked", [("moderntext", 0), ("moderntext", 2), ("other", 1), ("other", 3)])
def test_lock_text_freezes_what_openclip_main_freezes(config, unlocked):
    """main's groups: embeddings (registers, pre-norm), each block (the last with ln_final), the pool and the
    projection; main's lock freezes the norms too (it refuses otherwise): bigclip's then keeps them training."""
    cfg = {**CONFIGS[config], "layers": 3}
    theirs = main.ModernTextTransformer(main.CLIPTextCfg(**cfg), output_dim=24)
    ours = text_tower(24, cfg, quick_gelu=False)
    theirs.lock(unlocked, freeze_layer_norm=True)
    ours.lock(unlocked, freeze_layer_norm=True)
    expected = {n: p.requires_grad for n, p in theirs.named_parameters()}
    assert {n: p.requires_grad for n, p in ours.named_parameters()} == expected
    assert any(expected.values()) == bool(unlocked) and not all(expected.values())
    ours.lock(0, freeze_layer_norm=False)
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all("norm" in n.split(".")[-2] or n.startswith("ln_final") for n in trainable), trainable


# ------------------------------------------------------------------------------------------------- tokenizer
def stand_in_r50k() -> tiktoken.Encoding:
    """A tiny tiktoken encoding with r50k_base's name, pattern and end-of-text id: every byte, and the merges that
    spell " cat", " dog" and "photo" (their own ids)."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b" cat", b" dog", b"photo"):
        for end in range(2, len(word) + 1):
            ranks.setdefault(word[:end], len(ranks))
    eot = {"<|endoftext|>": 50256}
    return tiktoken.Encoding("r50k_base", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=eot)


@pytest.fixture
def r50k(monkeypatch):
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "r50k_base", stand_in_r50k())


SAMPLES = ["a photo of a cat", "A dog, two dogs & a cat!", "", "photo " * 300, "unicode: café ☕"]


def test_moderntext_tokenizes_as_openclip_mains_tiktoken_tokenizer(r50k):
    ours = get_tokenizer(NAME)
    theirs = main.TikTokenTokenizer("r50k_base", context_length=256)
    cfg = get_model_config(NAME)["text_cfg"]
    assert (ours.eot_token_id, ours.pad_token_id, ours.bos_token_id) == (cfg["eos_id"], cfg["pad_id"], cfg["bos_id"])
    assert ours.vocab_size == theirs.vocab_size == cfg["vocab_size"]
    tokens = ours(SAMPLES)
    assert tokens.shape == (5, 256) and torch.equal(tokens, theirs(SAMPLES))
    assert tokens[3, -1] == cfg["eos_id"] and tokens[2, :3].tolist() == [cfg["bos_id"], cfg["eos_id"], cfg["pad_id"]]
    assert torch.equal(ours(SAMPLES, context_length=8), theirs(SAMPLES, context_length=8))
    # variable-length text: each caption unpadded, cut at the context length with eos last
    for a, b in zip(ours(SAMPLES, pad=False), theirs(SAMPLES, pad=False)):
        assert torch.equal(a, b) and len(a) <= 256
    assert ours.decode(tokens[0]) == "a photo of a cat"


def test_a_missing_tiktoken_encoding_is_one_line_naming_what_to_fetch_and_where(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
    with pytest.raises(UserError) as err:
        get_tokenizer(NAME)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--model {NAME}: tiktoken encoding r50k_base")
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    assert f"where {url} is reachable, or save that file as " in line
    assert line.endswith(os.path.join(str(tmp_path), hashlib.sha1(url.encode()).hexdigest()))


@pytest.fixture
def served_r50k(monkeypatch):
    """The stand-in r50k_base as a .tiktoken file served over HTTP on 127.0.0.1, in tiktoken's registry as the
    encoding r50k_base (its constructor reads that URL with its SHA-256, as tiktoken_ext reads OpenAI's): tiktoken's
    own download and cache path. Yields (url, file bytes, the server)."""
    import base64
    import http.server
    import threading

    from tiktoken.load import load_tiktoken_bpe

    ranks = stand_in_r50k()._mergeable_ranks
    data = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/r50k_base.tiktoken"

    def constructor():
        mergeable = load_tiktoken_bpe(url, expected_hash=hashlib.sha256(data).hexdigest())
        return {"name": "r50k_base", "pat_str": r50k_pat_str, "mergeable_ranks": mergeable,
                "special_tokens": {"<|endoftext|>": 50256}}  # fmt: skip

    tiktoken.registry.list_encoding_names()  # tiktoken finds its plugins' constructors once
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, "r50k_base", constructor)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(variable, raising=False)
    try:
        yield url, data, server
    finally:
        server.shutdown()
        server.server_close()
        tiktoken.registry.ENCODINGS.pop("r50k_base", None)


def test_bigclip_fetch_puts_the_tiktoken_encoding_where_a_run_without_network_reads_it(served_r50k, tmp_path, capsys):
    """`bigclip fetch --model M --cache-dir D` downloads M's tiktoken encoding into D/tiktoken (tiktoken's own
    download, hash check and file name); then, the server gone, a run's tokenizer with the same --cache-dir reads it
    from there; with another --cache-dir it is one line naming the command and the file."""
    url, data, server = served_r50k
    cache = tmp_path / "cache"
    assert cli.main(["fetch", "--model", NAME, "--cache-dir", str(cache)]) == 0
    saved = cache / "tiktoken" / hashlib.sha1(url.encode()).hexdigest()
    assert saved.read_bytes() == data
    # (the line names the file of OpenAI's URL, which tiktoken's own r50k_base reads)
    official = hashlib.sha1(b"https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken").hexdigest()
    assert f"--model {NAME}: tiktoken encoding r50k_base {cache / 'tiktoken' / official}" in capsys.readouterr().out
    assert "TIKTOKEN_CACHE_DIR" not in os.environ  # set for the load only

    server.shutdown()
    server.server_close()  # connections refused from here (a listening socket nobody serves would hang them)
    tiktoken.registry.ENCODINGS.pop("r50k_base")
    tokens = get_tokenizer(NAME, cache_dir=str(cache))(["a photo of a cat"])[0].tolist()
    ids = stand_in_r50k().encode_ordinary("a photo of a cat")
    assert tokens[1 : 1 + len(ids)] == ids and len(ids) < 16  # after bos: the served encoding's merges
    tiktoken.registry.ENCODINGS.pop("r50k_base")
    with pytest.raises(UserError) as err:
        get_tokenizer(NAME, cache_dir=str(tmp_path / "elsewhere"))
    line = str(err.value)
    assert "\n" not in line and f"run `bigclip fetch --model {NAME}` with the same --cache-dir" in line, line


def test_a_config_whose_ids_are_not_the_tokenizers_is_refused(r50k, tmp_path):
    cfg = {**get_model_config(NAME), "text_cfg": {**get_model_config(NAME)["text_cfg"], "pad_id": 0}}
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    with pytest.raises(UserError, match="text_cfg pad_id 0 is not tiktoken r50k_base's \\(50258\\)"):
        get_tokenizer(f"local-dir:{tmp_path}")


def test_variable_text_batches_are_mains_each_caption_unpadded_then_padded_to_the_batchs_longest(r50k, tmp_path):
    """main's variable_text data path (TokenizeText(variable=True): each caption tokenized unpadded; its
    collate_variable_text: a batch padded to its longest caption) and bigclip's (fixed-length ids, each batch cut
    to its longest caption) give the same batches: a CSV dataset of captions of many lengths, one over the context
    length."""
    from PIL import Image

    from bigclip.data import DataConfig, get_data, image_transform
    from bigclip.model.tokenizer import variable_text_pad_id

    texts = ["a cat", "photo", "a photo of a dog and a cat " * 3, "cat", "dog " * 400, "a dog", "cat cat", "photo of"]
    rows = []
    for i, text in enumerate(texts):
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(tmp_path / f"{i}.png")
        rows.append(f"{tmp_path / f'{i}.png'}\t{text}")
    (tmp_path / "data.csv").write_text("filepath\ttitle\n" + "\n".join(rows) + "\n")
    ours = get_tokenizer(NAME)
    pad = variable_text_pad_id(NAME, get_model_config(NAME), ours)
    assert pad == 50258 and variable_text_pad_id("ViT-B-32", get_model_config("ViT-B-32"), ours) is None
    cfg = DataConfig(val_data=str(tmp_path / "data.csv"), batch_size=2, workers=0)
    size = {"size": (8, 8), "mean": (0.5,) * 3, "std": (0.5,) * 3}
    transform = image_transform(8, False, (0.5,) * 3, (0.5,) * 3)
    val = get_data(cfg, transform, transform, ours, preprocess_cfg=size, text_pad_id=pad)["val"]
    batches = [tokens for _, tokens in val.dataloader]
    theirs = main.TikTokenTokenizer("r50k_base", context_length=256)
    expected = [main.collate_variable_text(theirs(texts[i : i + 2], pad=False), pad)[0] for i in range(0, 8, 2)]
    assert [b.shape[1] for b in batches] == [b.shape[1] for b in expected] and len({b.shape[1] for b in batches}) > 2
    assert all(torch.equal(a, b) for a, b in zip(batches, expected))


# ------------------------------------------------------------------------------------------------- plan, engines
def test_the_plans_activation_formula_is_what_a_meta_trace_of_the_tower_saves():
    """The memory plan's block formula, (8 + 2 x ratio) x tokens x width values per block, with the tower's
    activation_shape, against what autograd keeps for the backward in each block (traced on meta)."""
    ours = create_model(NAME, device="meta")
    layers, tokens, width, ratio = ours.text.activation_shape()
    assert (layers, tokens, width) == (12, 256, 512)
    ids = torch.zeros(2, tokens, dtype=torch.long, device="meta")
    traced = trace_activations(ours.text, None, list(ours.text.blocks), inputs=ids)
    formula = tokens * width * (8 + 2 * ratio)
    for block in traced.blocks:
        assert block.values == pytest.approx(formula, rel=0.05)


# A tiny moderntext model whose token ids the engine worker draws itself (below 250: no padding, id 249 is the end
# of text where drawn, else the last token pools)
TINY = {"embed_dim": 24, "vision_cfg": VIT, "tokenizer": "byte",
        "text_cfg": {**TINY_TEXT, "vocab_size": 259, "pad_id": 0, "eos_id": 249, "bos_id": 257}}  # fmt: skip


@pytest.mark.slow
def test_a_tiny_moderntext_model_trains_alike_on_one_process_and_under_ddp_fsdp2_and_zero3(tmp_path):
    """2 ranks x batch 4 == one process x batch 8, step by step (losses and gradient norms), the CLIP loss on
    gathered features; FSDP2 (a shard unit and a checkpoint per block) and ZeRO-3 give DDP's."""
    tiny = {"model": "tiny-moderntext", "batch_size": 4, "gather_with_grad": True}

    def run(name, steps=4, **config):
        return {"name": name, "steps": steps, "arch": TINY, "config": {**tiny, **config}}

    two = run_worker(tmp_path, [
        run("ddp"), run("fsdp", engine="fsdp", grad_checkpointing=True), run("zero3", ds_config=DS[3]),
    ], name="two")  # fmt: skip
    one = run_worker(tmp_path, [{**run("single", batch_size=8), "ranks_emulated": 2}], name="one", nproc=1)
    assert two["ddp"]["losses"][-1] < two["ddp"]["losses"][0]
    assert_same_run(one["single"], two["ddp"], FP32_RTOL)
    for name in ("fsdp", "zero3"):
        assert_same_run(two[name], two["ddp"], FP32_RTOL)
    with torch.device("meta"):
        reference = OracleCLIP({k: v for k, v in TINY.items() if k != "tokenizer"})
    assert two["ddp"]["num_params"] == sum(p.numel() for p in reference.parameters())
