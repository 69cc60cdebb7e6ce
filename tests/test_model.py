"""Model package: architectures, towers, tokenizer, pretrained loading, OpenCLIP conversion."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bigclip.errors import UserError
from bigclip.loss import LOSSES
from bigclip.model import (
    ByteTokenizer,
    bigclip_to_openclip,
    create_model,
    get_model_config,
    get_tokenizer,
    list_models,
    openclip_to_bigclip,
    preprocess_cfg,
)
from bigclip.model.tokenizer import EOT_ID, SOT_ID, clean_text

TINY = "test-tiny"
SIGLIP = LOSSES.get("siglip")  # the SigLIP family starts the model with its logit scale and bias


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning
    # OpenMP threads slow them down 10x when other jobs run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**kwargs):
    torch.manual_seed(0)
    return create_model(TINY, **kwargs)


def batch(model, n=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    height, width = model.visual.image_size
    images = torch.randn(n, 3, height, width, generator=gen)
    tokens = get_tokenizer(TINY)([f"digit {i} of {n}" for i in range(n)])
    return images, tokens


# --- architectures -------------------------------------------------------------------------

# OpenCLIP's published parameter counts (millions).
OPENCLIP_PARAMS_M = {
    "ViT-B-32": 151.28,
    "ViT-B-16": 149.62,
    "ViT-L-14": 427.62,
    "ViT-H-14": 986.11,
    "ViT-bigG-14": 2539.57,
}


@pytest.mark.parametrize("name", list(OPENCLIP_PARAMS_M))
def test_param_counts_match_openclip_on_meta(name):
    model = create_model(name, device="meta")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)  # nothing allocated: even ViT-bigG-14 costs no memory
    count = sum(p.numel() for p in params) / 1e6
    assert count == pytest.approx(OPENCLIP_PARAMS_M[name], rel=0.005)


def test_big_configs_dimensions():
    big_g = get_model_config("ViT-bigG-14")
    model = create_model("ViT-bigG-14", device="meta")
    block = model.visual.blocks[0]
    assert block.mlp.fc1.out_features == 8192  # 1664 * 64/13
    assert block.attn.num_heads == 1664 // 104
    assert len(model.visual.blocks) == 48 and len(model.text.blocks) == 32
    assert model.text.text_projection.shape == (1280, big_g["embed_dim"])
    assert model.visual.image_size == (224, 224)
    assert set(list_models()) >= {*OPENCLIP_PARAMS_M, TINY}


def test_openclips_hugging_face_and_coca_configs_are_built_in_as_openclip_writes_them():
    """Every OpenCLIP config with a Hugging Face text tower (RoBERTa, XLM-RoBERTa, mT5, NLLB) and every CoCa config:
    bigclip's copy is OpenCLIP's, with the image normalisation OpenCLIP applies by default written out."""
    import open_clip

    names = [n for n in open_clip.list_models() if "hf_model_name" in open_clip.get_model_config(n)["text_cfg"]]
    names += [n for n in open_clip.list_models() if n.startswith("coca")]
    assert {"nllb-clip-base", "nllb-clip-large-siglip", "coca_base", "coca_roberta-ViT-B-32"} <= set(names)
    for name in names:
        theirs = open_clip.get_model_config(name)
        ours = get_model_config(name)
        vision = {k: v for k, v in ours["vision_cfg"].items() if k not in ("image_mean", "image_std")}
        ours = {k: v for k, v in ours.items() if k in theirs or k == "quick_gelu" and v}  # False: the default
        assert {**ours, "vision_cfg": vision} == theirs, name
        assert tuple(ours["vision_cfg"]["image_mean"]) == open_clip.OPENAI_DATASET_MEAN, name
    assert set(names) <= set(list_models())


def test_unknown_model_is_one_short_line_with_close_names():
    """The zoo holds ~180 names: the line names the flag, the name, a few close ones and where the rest are."""
    with pytest.raises(UserError) as err:
        create_model("vit-b-32")
    line = str(err.value)
    assert line.startswith("--model vit-b-32: unknown architecture; did you mean ViT-B-32, "), line
    assert line.endswith("`bigclip models` lists them all (or local-dir:DIR / hf-hub:ORG/NAME)"), line
    assert "\n" not in line and len(line) < 200 and line.count("ViT-") <= 3, line
    with pytest.raises(UserError) as err:
        create_model("EVA02-E14")
    assert "did you mean EVA02-E-14" in str(err.value) and len(str(err.value)) < 200
    with pytest.raises(UserError, match=r"^--model zzz: unknown architecture; `bigclip models` lists them all"):
        create_model("zzz")  # nothing close: no guesses


def test_overrides_and_preprocess_cfg():
    model = create_model(TINY, image_size=24, context_length=8, dtype=torch.bfloat16)
    assert model.visual.image_size == (24, 24)
    assert model.visual.trunk.pos_embed.shape == (1, (24 // 4) ** 2 + 1, 64)
    assert model.text.positional_embedding.shape == (8, 64)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    cfg = preprocess_cfg(TINY)
    assert cfg["size"] == (16, 16) and cfg["interpolation"] == "bicubic" and cfg["resize_mode"] == "shortest"
    assert cfg["mean"] == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert cfg["std"] == pytest.approx((0.26862954, 0.26130258, 0.27577711))
    assert preprocess_cfg("ViT-L-14", image_size=336)["size"] == (336, 336)


# --- forward ---------------------------------------------------------------------------------


def test_forward_shapes_and_normalisation():
    model = tiny()
    images, tokens = batch(model)
    out = model(images, tokens)
    assert out["image_features"].shape == (4, 32) and out["text_features"].shape == (4, 32)
    torch.testing.assert_close(out["image_features"].norm(dim=-1), torch.ones(4))
    torch.testing.assert_close(out["text_features"].norm(dim=-1), torch.ones(4))
    assert "logit_bias" not in out
    raw = model.encode_image(images)
    torch.testing.assert_close(F.normalize(raw, dim=-1), model.encode_image(images, normalize=True))
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(4))
    only_text = model(texts=tokens)
    assert only_text["image_features"] is None
    torch.testing.assert_close(only_text["text_features"], out["text_features"])
    assert model(images=images)["text_features"] is None


def test_logit_scale_init_and_clamp():
    model = tiny()
    assert model.logit_scale.shape == (1,)
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert model(texts=batch(model)[1])["logit_scale"].item() == pytest.approx(1 / 0.07, rel=1e-5)
    with torch.no_grad():
        model.logit_scale.fill_(7.0)
    model.clamp_logit_scale_(100.0)
    assert model.logit_scale.item() == pytest.approx(math.log(100.0))
    with torch.no_grad():
        model.logit_scale.fill_(-3.0)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == 0.0
    assert model.logit_scale.requires_grad


def test_siglip_init():
    model = tiny(**SIGLIP.model_init)
    assert model.logit_scale.shape == (1,) and model.logit_bias.shape == (1,)
    assert model.logit_scale.item() == pytest.approx(math.log(10.0))
    assert model.logit_bias.item() == -10.0
    out = model(*batch(model))
    assert out["logit_bias"].item() == -10.0
    assert out["logit_scale"].item() == pytest.approx(10.0)


def test_text_init_follows_openclip_stds():
    model = tiny()
    text = model.text
    assert text.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert text.positional_embedding.std().item() == pytest.approx(0.01, rel=0.2)
    assert text.blocks[0].attn.in_proj_weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    assert torch.all(text.blocks[0].attn.in_proj_bias == 0)


def test_text_attention_matches_multihead_attention():
    model = tiny().double()
    attn = model.text.blocks[0].attn
    reference = nn.MultiheadAttention(64, 4, batch_first=True).double()
    reference.load_state_dict(attn.state_dict())
    x = torch.randn(3, 10, 64, dtype=torch.float64)
    mask = torch.triu(torch.full((10, 10), float("-inf"), dtype=torch.float64), diagonal=1)
    expected, _ = reference(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(attn(x), expected)


def test_text_pools_at_eot_and_is_causal():
    model = tiny().eval()
    tokens = get_tokenizer(TINY)(["ab", "ab"])
    tokens[1, 4:] = 7  # changes after eot (position 3) must not reach the pooled feature
    features = model.encode_text(tokens)
    torch.testing.assert_close(features[0], features[1])
    tokens[1, 1] = 50  # a change before eot must
    assert not torch.allclose(model.encode_text(tokens)[0], model.encode_text(tokens)[1])


# --- grad checkpointing, locking, activations ------------------------------------------------


def grads(model, images, tokens):
    model.zero_grad(set_to_none=True)
    out = model(images, tokens)
    loss = (out["image_features"] @ out["text_features"].T * out["logit_scale"]).logsumexp(dim=1).sum()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("every", [1, 2])
def test_grad_checkpointing_gives_identical_gradients(every):
    model = tiny()
    images, tokens = batch(model)
    plain = grads(model, images, tokens)

    calls = []
    # Pre-hooks: recomputation stops early, so post-forward hooks would not see it.
    hooks = [
        b.register_forward_pre_hook(lambda m, i, k=k: calls.append(k)) for k, b in enumerate(model.transformer_blocks())
    ]
    model.set_grad_checkpointing(True, every=every)
    calls.clear()
    checkpointed = grads(model, images, tokens)
    for hook in hooks:
        hook.remove()

    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0, msg=name)
    # Recomputed blocks run forward twice: all of them for every=1, the 2nd of each tower for every=2.
    blocks = len(model.transformer_blocks())
    recomputed = len(calls) - blocks
    assert recomputed == (blocks if every == 1 else blocks // 2)
    model.set_grad_checkpointing(False)
    calls.clear()


def test_every_module_owning_parameters_runs_its_own_forward():
    # Engines that gather sharded parameters in per-module forward hooks (ZeRO-3) rely on this.
    model = tiny()
    owners = {name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    called = set()
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, i, name=name: called.add(name))
    model(*batch(model))
    assert owners <= called, owners - called


def test_transformer_blocks_cover_both_towers():
    model = tiny()
    blocks = model.transformer_blocks()
    assert blocks == [*model.visual.trunk.blocks, *model.text.transformer.resblocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in in_blocks]
    assert all(".blocks." not in n and ".resblocks." not in n for n in outside)


def trainable(model, prefix):
    return {n for n, p in model.named_parameters() if p.requires_grad and n.startswith(prefix)}


def test_lock_image_tower():
    model = tiny()
    model.lock_image_tower()
    assert trainable(model, "visual.") == set()
    assert trainable(model, "text.") == {n for n, _ in model.named_parameters() if n.startswith("text.")}

    model = tiny()
    model.lock_image_tower(unlocked_groups=2)
    assert trainable(model, "visual.") == {
        "visual.trunk.norm.weight",
        "visual.trunk.norm.bias",
        "visual.proj",
        *{f"visual.trunk.blocks.1.{n}" for n, _ in model.visual.blocks[1].named_parameters()},
    }
    model = tiny()
    model.lock_image_tower(unlocked_groups=100)
    assert len(trainable(model, "visual.")) == len(list(model.visual.parameters()))


def test_lock_text_tower():
    model = tiny()
    model.lock_text_tower()
    assert trainable(model, "text.") == set()
    assert len(trainable(model, "visual.")) == len(list(model.visual.parameters()))

    model = tiny()
    model.lock_text_tower(unlocked_layers=2)
    last_block = {f"text.transformer.resblocks.1.{n}" for n, _ in model.text.blocks[1].named_parameters()}
    head = {"text.ln_final.weight", "text.ln_final.bias", "text.text_projection"}
    assert trainable(model, "text.") == last_block | head

    model = tiny()
    model.lock_text_tower(unlocked_layers=1, freeze_layer_norm=False)
    first_block_norms = {
        f"text.transformer.resblocks.0.{ln}.{w}" for ln in ("ln_1", "ln_2") for w in ("weight", "bias")
    }
    assert trainable(model, "text.transformer.resblocks.0.") == first_block_norms
    assert "text.token_embedding.weight" not in trainable(model, "text.")
    assert head <= trainable(model, "text.")


def test_quick_gelu_changes_outputs():
    images, tokens = batch(tiny())
    plain = tiny()
    quick = tiny(quick_gelu=True)
    quick.load_state_dict(plain.state_dict())
    assert type(quick.visual.blocks[0].mlp.act).__name__ == "QuickGELU"
    assert type(create_model(TINY + "-quickgelu").text.blocks[0].mlp.gelu).__name__ == "QuickGELU"
    x = torch.linspace(-4, 4, 9)
    torch.testing.assert_close(quick.text.blocks[0].mlp.gelu(x), x * torch.sigmoid(1.702 * x))
    assert not torch.allclose(plain.encode_image(images), quick.encode_image(images))
    assert not torch.allclose(plain.encode_text(tokens), quick.encode_text(tokens))


def test_patch_dropout_only_in_train_mode():
    plain = tiny().eval()
    dropped = tiny(patch_dropout=0.5)
    dropped.load_state_dict(plain.state_dict())
    images, _ = batch(plain)
    dropped.eval()
    torch.testing.assert_close(dropped.encode_image(images), plain.encode_image(images))
    dropped.train()
    torch.manual_seed(3)
    first = dropped.encode_image(images)
    second = dropped.encode_image(images)
    assert not torch.allclose(first, plain.encode_image(images))
    assert not torch.allclose(first, second)
    with pytest.raises(UserError, match="--force-patch-dropout"):
        create_model(TINY, patch_dropout=1.0)


# --- meta device and init ------------------------------------------------------------------------


def test_to_empty_then_init_weights_from_meta():
    model = create_model(TINY, device="meta", **SIGLIP.model_init)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(0)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    out = model(*batch(model))
    assert torch.isfinite(out["image_features"]).all() and torch.isfinite(out["text_features"]).all()
    assert model.logit_bias.item() == -10.0
    # Same seed, same init as a model built directly.
    reference = tiny(**SIGLIP.model_init)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_layout_and_truncation():
    tok = get_tokenizer(TINY)
    assert tok.context_length == 32 and tok.vocab_size <= get_model_config(TINY)["text_cfg"]["vocab_size"]
    ids = tok("  Hi\n THERE ")
    assert ids.dtype == torch.long and ids.shape == (1, 32)
    assert ids[0, :10].tolist() == [SOT_ID, *[b + 1 for b in b"hi there"], EOT_ID]
    assert ids[0, 10:].eq(0).all()
    long = tok(["x" * 40, "é"])
    assert long.shape == (2, 32)
    assert long[0, 0] == SOT_ID and long[0, -1] == EOT_ID and long[0, 1:-1].eq(ord("x") + 1).all()
    assert long[1, :4].tolist() == [SOT_ID, 0xC3 + 1, 0xA9 + 1, EOT_ID]
    assert get_tokenizer("ViT-B-32").context_length == 77
    assert get_tokenizer(TINY, context_length=5)("abcdef").tolist() == [[SOT_ID, 98, 99, 100, EOT_ID]]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.integers(min_value=2, max_value=24))
def test_tokenizer_eot_is_argmax_and_decodes(text, context_length):
    ids = ByteTokenizer(context_length)(text)[0]
    expected = clean_text(text).encode("utf-8")[: context_length - 2]
    eot = int(ids.argmax())
    assert ids[0] == SOT_ID and ids[eot] == EOT_ID and eot == len(expected) + 1
    assert ids[eot + 1 :].eq(0).all()
    assert ByteTokenizer(context_length).decode(ids) == expected.decode("utf-8", errors="replace")


# --- pretrained and OpenCLIP conversion ---------------------------------------------------------


def openclip_reference(sd, images, tokens, patch, vision_heads, text_heads):
    """OpenCLIP's CLIP forward written out naively from an OpenCLIP-layout state dict."""

    def ln(x, prefix):
        return F.layer_norm(x, x.shape[-1:], sd[prefix + ".weight"], sd[prefix + ".bias"], eps=1e-5)

    def block(x, prefix, heads, causal):
        y = ln(x, prefix + ".ln_1")
        qkv = F.linear(y, sd[prefix + ".attn.in_proj_weight"], sd[prefix + ".attn.in_proj_bias"])
        q, k, v = qkv.chunk(3, -1)
        n, length, width = q.shape
        q, k, v = (t.reshape(n, length, heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
        if causal:
            scores = scores.masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, length, width)
        x = x + F.linear(y, sd[prefix + ".attn.out_proj.weight"], sd[prefix + ".attn.out_proj.bias"])
        y = F.linear(ln(x, prefix + ".ln_2"), sd[prefix + ".mlp.c_fc.weight"], sd[prefix + ".mlp.c_fc.bias"])
        y = F.linear(F.gelu(y), sd[prefix + ".mlp.c_proj.weight"], sd[prefix + ".mlp.c_proj.bias"])
        return x + y

    def depth(prefix):
        return len({k.split(".")[len(prefix.split("."))] for k in sd if k.startswith(prefix + ".")})

    x = F.conv2d(images, sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = ln(torch.cat([cls, x], 1) + sd["visual.positional_embedding"], "visual.ln_pre")
    for i in range(depth("visual.transformer.resblocks")):
        x = block(x, f"visual.transformer.resblocks.{i}", vision_heads, causal=False)
    image = ln(x[:, 0], "visual.ln_post") @ sd["visual.proj"]

    x = sd["token_embedding.weight"][tokens] + sd["positional_embedding"][: tokens.shape[1]]
    for i in range(depth("transformer.resblocks")):
        x = block(x, f"transformer.resblocks.{i}", text_heads, causal=True)
    x = ln(x, "ln_final")
    text = x[torch.arange(len(tokens)), tokens.argmax(-1)] @ sd["text_projection"]
    return image, text


def test_openclip_conversion_round_trip_and_reference_forward():
    model = tiny().double().eval()
    images, tokens = batch(model)
    images = images.double()
    ours = model.state_dict()
    openclip = bigclip_to_openclip(ours)
    assert openclip["logit_scale"].shape == () and openclip["visual.class_embedding"].shape == (64,)
    assert "visual.transformer.resblocks.1.attn.in_proj_weight" in openclip
    assert "token_embedding.weight" in openclip and "text_projection" in openclip

    image_ref, text_ref = openclip_reference(openclip, images, tokens, patch=4, vision_heads=4, text_heads=4)
    torch.testing.assert_close(model.encode_image(images), image_ref)
    torch.testing.assert_close(model.encode_text(tokens), text_ref)

    back = openclip_to_bigclip(openclip)
    assert back.keys() == ours.keys()
    for name in ours:
        assert torch.equal(back[name], ours[name]), name
    reloaded = tiny().double().eval()
    reloaded.load_state_dict(back)
    torch.testing.assert_close(reloaded.encode_image(images), model.encode_image(images), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["bigclip.pt", "openclip.pt", "bigclip.safetensors", "wrapped.pt"])
def test_pretrained_loads_every_layout(tmp_path, layout):
    source = tiny().eval()
    state = source.state_dict()
    path = tmp_path / layout
    if layout == "openclip.pt":
        torch.save(bigclip_to_openclip(state), path)
    elif layout == "bigclip.safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    elif layout == "wrapped.pt":  # OpenCLIP training checkpoint under DDP
        torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in state.items()}}, path)
    else:
        torch.save(state, path)
    torch.manual_seed(123)  # a different init must be fully overwritten
    loaded = create_model(TINY, pretrained=path).eval()
    images, tokens = batch(source)
    torch.testing.assert_close(loaded.encode_image(images), source.encode_image(images), rtol=0, atol=0)
    torch.testing.assert_close(loaded.encode_text(tokens), source.encode_text(tokens), rtol=0, atol=0)


def test_pretrained_resamples_positions_for_a_new_image_size(tmp_path):
    source = tiny()
    path = tmp_path / "tiny16.pt"
    torch.save(bigclip_to_openclip(source.state_dict()), path)
    loaded = create_model(TINY, image_size=32, pretrained=path)
    pos = loaded.visual.trunk.pos_embed
    assert pos.shape == (1, 8 * 8 + 1, 64)
    old = source.visual.trunk.pos_embed
    torch.testing.assert_close(pos[:, 0], old[:, 0])  # class token position is kept
    grid = old[0, 1:].reshape(4, 4, 64).permute(2, 0, 1)[None]
    expected = F.interpolate(grid, size=(8, 8), mode="bicubic", antialias=True, align_corners=False)
    torch.testing.assert_close(pos[0, 1:], expected[0].permute(1, 2, 0).reshape(64, 64))
    assert torch.isfinite(loaded.encode_image(torch.randn(2, 3, 32, 32))).all()


def test_pretrained_errors_name_the_file(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"--pretrained .*garbage\.pt: unreadable"):
        create_model(TINY, pretrained=garbage)
    with pytest.raises(UserError, match=r"--pretrained .*absent\.pt: no such file"):
        create_model(TINY, pretrained=tmp_path / "absent.pt")

    state = tiny().state_dict()
    partial = tmp_path / "partial.pt"
    torch.save({k: v for k, v in state.items() if k != "text.ln_final.bias"}, partial)
    with pytest.raises(UserError, match=r"partial\.pt: keys do not match .*missing text\.ln_final\.bias"):
        create_model(TINY, pretrained=partial)

    short = tmp_path / "short_context.pt"
    torch.save(create_model(TINY, context_length=8).state_dict(), short)
    with pytest.raises(UserError, match=r"short_context\.pt: shape mismatch for text\.positional_embedding"):
        create_model(TINY, pretrained=short)
