"""Hugging Face text towers (text_cfg with hf_model_name) against OpenCLIP's HFTextEncoder, the oracle.

Tiny RoBERTa and mT5 models and a word-level tokenizer are created here (helpers.tiny_hf_clip: no hub access);
OpenCLIP reads the same local-dir: model. Checked: the same image and text features on the same weights, names
converting both ways exactly; the Hugging Face weights (hf_model_pretrained) loaded as OpenCLIP loads them;
OpenCLIP's --lock-text (which parameters train); activation checkpointing (same gradients, layers recomputed);
a meta build materialised by init_weights (buffers restored). The engine matrix is in
test_engine_multiprocess.py; OpenCLIP's mT5 training flag list in test_openclip_training_simple.py.
"""

from __future__ import annotations

import open_clip
import pytest
import torch
from helpers import tiny_hf_clip

from bigclip.model import bigclip_to_openclip, create_model, get_tokenizer, openclip_to_bigclip
from bigclip.model.hf_text import HFTextTower

TEXTS = ["a photo of a cat", "two dogs playing on a beach at sunset", "a red car"]


@pytest.fixture(scope="module", params=["roberta", "mt5", "m2m_100"])
def hf_model(request, tmp_path_factory):
    return tiny_hf_clip(tmp_path_factory.mktemp(request.param), request.param)


def _openclip(name: str, seed: int = 0):
    """OpenCLIP's model of the same directory, every tensor drawn at random (not only the projection)."""
    theirs = open_clip.create_model(name).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.1)
    return theirs


def test_openclips_weights_give_openclips_features_and_convert_back_exactly(hf_model):
    theirs = _openclip(hf_model)
    ours = create_model(hf_model).eval()
    assert isinstance(ours.text, HFTextTower)
    ours.load_state_dict(openclip_to_bigclip(theirs.state_dict()))
    texts = get_tokenizer(hf_model)(TEXTS)
    assert (texts == 0).any()  # padding, which the pooler leaves out
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for encode, x in (("encode_text", texts), ("encode_image", images)):
            a, b = getattr(theirs, encode)(x, normalize=True), getattr(ours, encode)(x, normalize=True)
            assert (a - b).abs().max().item() <= 1e-5, encode
    back = bigclip_to_openclip(ours.state_dict())
    reference = theirs.state_dict()
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in reference)


def test_the_hugging_face_weights_load_as_openclip_loads_them(hf_model):
    theirs = open_clip.create_model(hf_model)  # hf_model_pretrained: the saved Hugging Face weights
    ours = create_model(hf_model)
    reference = theirs.text.transformer.state_dict()
    mine = ours.text.transformer.state_dict()
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    # built on meta and materialised the way sharding engines do: the same weights, the buffers restored
    meta = create_model(hf_model, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights()
    for (name, a), b in zip(meta.text.transformer.named_buffers(), ours.text.transformer.buffers()):
        assert torch.equal(a, b), name
    assert all(torch.equal(meta.text.transformer.state_dict()[k], reference[k]) for k in reference)
    texts = get_tokenizer(hf_model)(TEXTS)
    with torch.no_grad():
        ours.text.proj.load_state_dict(meta.text.proj.state_dict())
        torch.testing.assert_close(meta.eval().encode_text(texts), ours.eval().encode_text(texts))


@pytest.mark.parametrize("unlocked, freeze_layer_norm", [(0, True), (1, True), (2, False)])
def test_lock_text_freezes_what_openclip_freezes(hf_model, unlocked, freeze_layer_norm):
    theirs, ours = open_clip.create_model(hf_model), create_model(hf_model)
    ours.lock_text_tower(unlocked, freeze_layer_norm)
    got = {n: p.requires_grad for n, p in ours.named_parameters() if n.startswith("text.")}
    assert not all(got.values()) and any(got.values())  # the projection always trains
    if unlocked and ours.text.config.model_type == "m2m_100":
        # OpenCLIP's arch_dict does not say where NLLB's encoder keeps its layers: its lock fails there, bigclip's
        # freezes the embeddings and the bottom layers as for the other architectures
        with pytest.raises(KeyError, match="layer_attr"):
            theirs.lock_text_tower(unlocked, freeze_layer_norm)
        bottom = ("embed_tokens", "layers.0")[: 3 - unlocked]
        frozen = {n for n, trains in got.items() if not trains}
        assert frozen == {n for n in got if n.startswith(tuple(f"text.transformer.{m}." for m in bottom))}
        return
    theirs.lock_text_tower(unlocked, freeze_layer_norm)
    expected = {n: p.requires_grad for n, p in theirs.named_parameters() if n.startswith("text.")}
    assert got == expected


@pytest.mark.parametrize("kind", ["roberta", "m2m_100"])
def test_a_coca_with_a_hugging_face_text_tower_gives_openclips_outputs(tmp_path, kind):
    """OpenCLIP's coca_roberta layout (no attentional pooler: the ViT's own tokens; the Hugging Face model's token
    states, less the pooled one under a cls pooler): the features, caption logits and labels OpenCLIP's CoCa gives on
    the same weights, names converting both ways exactly."""
    from bigclip.model.coca import CoCa

    name = tiny_hf_clip(tmp_path, kind, coca=True)
    theirs = _openclip(name)
    ours = create_model(name).eval()
    assert isinstance(ours, CoCa) and isinstance(ours.text, HFTextTower)
    ours.load_state_dict(openclip_to_bigclip(theirs.state_dict()))
    texts = get_tokenizer(name)(TEXTS)
    assert texts.shape == (3, 12) and (texts == ours.text.config.pad_token_id).any()
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        a, b = theirs(images, texts), ours(images=images, texts=texts)
    for key in ("image_features", "text_features", "logits"):
        assert b[key].shape == a[key].shape, key
        assert (b[key] - a[key]).abs().max().item() <= 1e-5, key
    assert torch.equal(b["labels"], a["labels"])
    back = bigclip_to_openclip(ours.state_dict())
    reference = {k: v for k, v in theirs.state_dict().items() if k != "text_decoder.attn_mask"}
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in reference)


def test_activation_checkpointing_gives_the_same_gradients_and_saves_less(hf_model):
    model = create_model(hf_model).train()  # Hugging Face checkpoints in training mode only
    texts = get_tokenizer(hf_model)(TEXTS)
    saved = []

    def gradients():
        model.zero_grad(set_to_none=True)
        saved.clear()
        torch.manual_seed(0)  # the same dropout masks (a recomputed layer replays its random state)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model.encode_text(texts).square().sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(saved)

    plain, plain_saved = gradients()
    model.set_grad_checkpointing(True)
    checkpointed, checkpointed_saved = gradients()
    assert checkpointed_saved < 0.7 * plain_saved  # the layers' activations were not kept: they are recomputed
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
