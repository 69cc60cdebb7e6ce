"""CoCa against OpenCLIP's own CoCa and CoCaLoss (open_clip_torch is the oracle), fp32 on CPU.

- the model: OpenCLIP's CoCa weights (random, every tensor non-trivial) load into bigclip and give the same image
  and text features, caption logits and labels, on texts with padding (OpenCLIP's legacy pad mask); bigclip's
  state dict converts back to exactly OpenCLIP's names; coca_ViT-B-32 from an OpenCLIP state dict file
  (--pretrained) gives OpenCLIP's outputs; `bigclip export` of a trained checkpoint loads into OpenCLIP's CoCa;
- the loss: values and gradients equal to open_clip's CoCaLoss, with both weight flags (and a zero contrastive
  weight), and OpenCLIP's accumulation (the caption logits cached across micro-batches) gives the big batch's
  gradient;
- the decoder's blocks are among the blocks engines shard and checkpoint, and are recomputed in backward.
The engine matrix (DDP, FSDP2, ZeRO-1/2/3, checkpointing, accumulation) is in test_engine_multiprocess.py.
"""

from __future__ import annotations

import json
import os

import open_clip
import pytest
import torch
from open_clip.loss import CoCaLoss as OpenCLIPCoCaLoss
from safetensors.torch import load_file

from bigclip import cli, loop
from bigclip.dist import World
from bigclip.engine import EngineConfig, build_engine
from bigclip.loss import CaptionLoss, ClipLoss
from bigclip.model import bigclip_to_openclip, captioning, create_model, get_model_config, openclip_to_bigclip
from bigclip.model.coca import CoCa

TINY = "test-tiny-coca"
TOL = 1e-5


def openclip_tiny_coca() -> torch.nn.Module:
    """OpenCLIP's CoCa built from test-tiny-coca's architecture, every tensor drawn at random."""
    cfg = get_model_config(TINY)
    vision = {k: v for k, v in cfg["vision_cfg"].items() if k not in ("image_mean", "image_std")}
    model = open_clip.CoCa(
        cfg["embed_dim"],
        cfg["multimodal_cfg"],
        {**cfg["text_cfg"], "output_tokens": True},
        {**vision, "output_tokens": True},
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def padded_texts(context: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """sot, tokens, eot, then padding, of several lengths (one fills the context)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in (3, 7, context):
        row = torch.zeros(context, dtype=torch.long)
        row[:length] = torch.randint(1, vocab - 2, (length,), generator=g)
        row[0], row[length - 1] = vocab - 2, vocab - 1
        rows.append(row)
    return torch.stack(rows)


def test_openclips_coca_weights_give_openclips_outputs_and_convert_back_exactly():
    theirs = openclip_tiny_coca()
    ours = create_model(TINY).eval()
    ours.load_state_dict(openclip_to_bigclip(theirs.state_dict()))
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    texts = padded_texts(31, 259)
    with torch.no_grad():
        a, b = theirs(images, texts), ours(images=images, texts=texts)
    for key in ("image_features", "text_features", "logits"):
        assert b[key].shape == a[key].shape, key
        assert (b[key] - a[key]).abs().max().item() <= TOL, key
    assert torch.equal(b["labels"], a["labels"])
    # the pad mask matters: the same texts without it would differ
    assert not torch.allclose(ours.text(texts)[0], ours.text(texts.masked_fill(texts == 0, 5))[0])
    back = bigclip_to_openclip(ours.state_dict())
    reference = theirs.state_dict()
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in reference)


def test_coca_architectures_match_openclips_on_meta():
    for name in ("coca_ViT-B-32", "coca_ViT-L-14", "coca_base"):  # coca_base: no attentional pooler
        cfg = {k: v for k, v in open_clip.get_model_config(name).items() if k != "custom_text"}
        with torch.device("meta"):
            theirs = open_clip.CoCa(**cfg)
        ours = create_model(name, device="meta")
        assert isinstance(ours, CoCa)
        reference = {k: v.shape for k, v in theirs.state_dict().items() if k != "text_decoder.attn_mask"}
        converted = bigclip_to_openclip(ours.state_dict())
        assert {k: v.shape for k, v in converted.items()} == reference, name


@pytest.mark.slow
def test_an_openclip_coca_state_dict_file_loads_with_openclips_outputs(tmp_path):
    name = "coca_ViT-B-32"
    torch.manual_seed(0)
    theirs = open_clip.create_model(name).eval()
    # OpenCLIP 3.3 never initialises its caption decoder's projection (torch.empty: zeros on fresh memory, any
    # bits on reused memory, where the logits compared below were once ~1e30 and differed by as much): draw it.
    projection = theirs.text_decoder.text_projection
    with torch.no_grad():
        projection.normal_(0, projection.shape[0] ** -0.5)
    path = str(tmp_path / "coca.pt")
    torch.save(theirs.state_dict(), path)  # what OpenCLIP users hold
    ours = create_model(name, pretrained=path).eval()
    images = torch.randn(2, 3, 224, 224)
    texts = open_clip.get_tokenizer(name)(["a photo of a cat", "two dogs playing on a beach at sunset!"])
    with torch.no_grad():
        a, b = theirs(images, texts), ours(images=images, texts=texts)
    assert a["logits"].abs().max() > 0.1  # the logits compared are real ones, not zeros
    for key in ("image_features", "text_features", "logits"):
        assert (b[key] - a[key]).abs().max().item() <= TOL, key


def test_openclips_saved_coca_directory_and_hub_repository_load_with_openclips_outputs(tmp_path, monkeypatch):
    """local-dir: and hf-hub: of a CoCa OpenCLIP saved (open_clip_config.json and its weights beside it)."""
    import huggingface_hub.constants
    from open_clip.model import set_model_preprocess_cfg
    from open_clip.push_to_hf_hub import save_for_hf
    from test_model_sources import PREPROCESS, NoTokenizerFiles, hub_cache

    theirs = openclip_tiny_coca()
    set_model_preprocess_cfg(theirs, {**PREPROCESS, "size": 16})
    cfg = get_model_config(TINY)
    model_cfg = {k: cfg[k] for k in ("embed_dim", "text_cfg", "multimodal_cfg", "tokenizer")}  # (bigclip's byte one)
    model_cfg["vision_cfg"] = {k: v for k, v in cfg["vision_cfg"].items() if k not in ("image_mean", "image_std")}
    save_for_hf(theirs, NoTokenizerFiles(), model_config=model_cfg, save_directory=str(tmp_path / "coca"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    files = {f: (tmp_path / "coca" / f).read_bytes() for f in ("open_clip_config.json", "open_clip_model.safetensors")}
    hub_cache(tmp_path / "hub", "someone/tiny-coca", files)
    images, texts = torch.randn(2, 3, 16, 16), padded_texts(31, 259)[:2]
    with torch.no_grad():
        a = theirs(images, texts)
        for name in (f"local-dir:{tmp_path / 'coca'}", "hf-hub:someone/tiny-coca"):
            ours = create_model(name, cache_dir=str(tmp_path / "hub")).eval()
            assert isinstance(ours, CoCa)
            b = ours(images=images, texts=texts)
            for key in ("image_features", "text_features", "logits"):
                assert (b[key] - a[key]).abs().max().item() <= TOL, (name, key)


def _losses(contrastive_weight: float, caption_weight: float):
    """(loss, d image, d text, d scale, d logits) of bigclip's and of OpenCLIP's loss on the same inputs."""
    g = torch.Generator().manual_seed(5)
    image = torch.nn.functional.normalize(torch.randn(6, 8, generator=g, dtype=torch.float64), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(6, 8, generator=g, dtype=torch.float64), dim=-1)
    logits = torch.randn(6, 10, 20, generator=g, dtype=torch.float64)
    labels = torch.randint(1, 20, (6, 10), generator=g)
    labels[::2, 6:] = 0  # padding: not counted
    out = []
    for which in ("ours", "theirs"):
        x, y, z = (t.clone().requires_grad_() for t in (image, text, logits))
        scale = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
        if which == "ours":
            loss = CaptionLoss(ClipLoss(impl="naive"), contrastive_weight, caption_weight)(
                x, y, scale, logits=z, labels=labels
            )
        else:
            loss = sum(OpenCLIPCoCaLoss(caption_weight, contrastive_weight)(x, y, z, labels, scale))
        loss.backward()
        out.append((loss.detach(), x.grad, y.grad, scale.grad, z.grad))
    return out


@pytest.mark.parametrize("weights", [(1.0, 2.0), (0.3, 1.7), (0.0, 2.0)])
def test_loss_and_gradients_equal_openclips_coca_loss(weights):
    ours, theirs = _losses(*weights)
    for a, b in zip(ours, theirs):
        if b is None:  # a zero contrastive weight: OpenCLIP's graph never reaches the features
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _engine(seed: int = 0):
    torch.manual_seed(seed)
    # float64: in float32 the gradients of a few LayerNorm biases (sums that nearly cancel) differ by 1-3% of their
    # largest value between the two summation orders
    engine = build_engine(EngineConfig(), create_model(TINY), World())
    engine.model.double()
    return engine


@pytest.mark.slow
def test_accumulation_gives_the_big_batch_gradient():
    """OpenCLIP's --accum-freq for CoCa: the caption logits and labels of every micro-batch are cached and
    concatenated like the features, so 4 x 8 gives the gradient of the batch of 32."""
    big, accum = _engine(), _engine()
    accum.model.load_state_dict(big.model.state_dict())
    torch.manual_seed(1)
    images, texts = torch.randn(32, 3, 16, 16, dtype=torch.float64), torch.randint(1, 250, (32, 31))
    texts[::3, 20:] = 0
    loss_fn = CaptionLoss(ClipLoss(impl="naive"), 1.0, 2.0)
    loss_big, _ = loop.forward_backward(big, loss_fn, [(images, texts)], World())
    micro = [(images[i : i + 8], texts[i : i + 8]) for i in range(0, 32, 8)]
    loss_acc, _ = loop.forward_backward(accum, loss_fn, micro, World())
    assert loss_acc == pytest.approx(loss_big, rel=1e-12)
    for (name, p), q in zip(big.model.named_parameters(), accum.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert big.model.text_decoder.text_projection.grad.abs().sum() > 0


def test_decoder_blocks_are_sharded_and_checkpointed_like_the_towers():
    model = create_model(TINY)
    decoder = model.text_decoder
    blocks = model.transformer_blocks()
    assert all(any(b is d for b in blocks) for d in [*decoder.resblocks, *decoder.cross_attn])
    images, texts = torch.randn(2, 3, 16, 16), torch.randint(1, 250, (2, 31))

    def gradients():
        model.zero_grad(set_to_none=True)
        model(images=images, texts=texts)["logits"].sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    calls = []
    # pre-hooks: a recomputation stops early, so post-forward hooks would not see it
    for block in decoder.blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    model.set_grad_checkpointing(True)
    checkpointed = gradients()
    assert len(calls) == 2 * len(decoder.blocks)  # each block ran again in backward
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0, msg=name)


def test_every_module_owning_parameters_runs_its_own_forward():
    """What ZeRO-3 relies on (it gathers a module's parameters in its forward hooks)."""
    model = create_model(TINY)
    owners = {name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    called = set()
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, i, name=name: called.add(name))
    model(images=torch.randn(2, 3, 16, 16), texts=torch.randint(1, 250, (2, 31)))
    assert owners - {""} <= called, owners - called


@pytest.mark.slow
def test_a_trained_coca_exports_to_openclips_coca(tmp_path):
    """Train test-tiny-coca (both loss terms logged), `bigclip export` its checkpoint; OpenCLIP's CoCa loads the
    file strictly and gives bigclip's outputs."""
    args = ["--model", TINY, "--dataset-type", "synthetic", "--train-num-samples", "32", "--batch-size", "8",
            "--epochs", "1", "--precision", "fp32", "--workers", "0", "--lr", "1e-3", "--warmup", "1",
            "--coca-contrastive-loss-weight", "0.5", "--coca-caption-loss-weight", "1.5",
            "--logs", str(tmp_path), "--name", "run", "--log-every-n-steps", "1",
            "--val-num-samples", "16"]  # fmt: skip
    assert cli.main(args) == 0
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert steps and all(r["contrastive_loss"] + r["caption_loss"] == pytest.approx(r["loss"], rel=1e-6) for r in steps)
    # validation also reports OpenCLIP's val_generative_loss (the caption loss over every token)
    assert any(r.get("eval/val_generative_loss", 0) > 0 for r in records)
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "epoch_1")
    out = str(tmp_path / "exported.safetensors")
    assert cli.main(["export", ckpt, out]) == 0
    from bigclip.ckpt.dcp_layout import DCPLayout

    ours = create_model(TINY, init=False).eval()
    ours.load_state_dict(DCPLayout.read_model_state(ckpt))
    theirs = openclip_tiny_coca()
    theirs.load_state_dict(load_file(out))  # strict: every key of OpenCLIP's CoCa
    images, texts = torch.randn(3, 3, 16, 16), padded_texts(31, 259)
    with torch.no_grad():
        a, b = theirs(images, texts), ours(images=images, texts=texts)
    for key in ("image_features", "text_features", "logits"):
        assert (b[key] - a[key]).abs().max().item() <= TOL, key


# --- captions (model/captioning.py, bigclip generate) --------------------------------------------------------------


def openclip_greedy(theirs, images, sot, eos, seq_len, min_seq_len):
    """Greedy decoding written plainly over OpenCLIP's own CoCa forward (the whole caption re-run every step)."""
    with torch.no_grad():
        captions = []
        for image in images:
            row = [sot]
            while len(row) < seq_len:
                logits = theirs(image[None], torch.tensor([row]), output_labels=False)["logits"][0, -1]
                log_probs = logits.log_softmax(-1)
                if len(row) < min_seq_len:
                    log_probs[eos] = -torch.inf
                token = eos if len(row) + 1 == seq_len else int(log_probs.argmax())
                row.append(token)
                if token == eos:
                    break
            captions.append(row)
    return captions


@pytest.mark.slow
def test_greedy_captions_equal_greedy_decoding_over_openclips_coca():
    theirs = openclip_tiny_coca()
    ours = create_model(TINY).eval()
    ours.load_state_dict(openclip_to_bigclip(theirs.state_dict()))
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    for seq_len, min_seq_len in ((12, 3), (6, 5)):
        got = captioning.greedy(ours, images, sot_id=257, eos_id=258, seq_len=seq_len, min_seq_len=min_seq_len)
        expected = openclip_greedy(theirs, images, 257, 258, seq_len, min_seq_len)
        assert [row[: row.index(258) + 1] for row in got.tolist()] == expected
        assert all(len(row) >= min_seq_len + 1 and row[-1] == 258 for row in expected)


def tiny_vocabulary_coca() -> CoCa:
    """A CoCa over 6 token ids (pad 0, words 1-3, sot 4, eos 5), with peaked random weights."""
    vision = {"image_size": 8, "patch_size": 4, "width": 16, "layers": 1, "head_width": 8, "attentional_pool": True,
              "attn_pooler_heads": 2, "attn_pooler_queries": 3}  # fmt: skip
    text = {"context_length": 8, "vocab_size": 6, "width": 16, "heads": 2, "layers": 1, "embed_cls": True}
    model = CoCa(16, vision, text, {"width": 16, "heads": 2, "layers": 1, "context_length": 8})
    torch.manual_seed(3)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def exhaustive_best(model, image, seq_len, min_seq_len, sot=4, eos=5, vocab=6):
    """The caption with the best length-normalised log-probability among every caption there is."""
    words = [t for t in range(vocab) if t != eos]
    candidates = [[]]
    best = None
    with torch.no_grad():
        image_tokens = model.visual(image[None])[1]
        for n in range(1, seq_len - 1):  # n tokens between sot and eos
            candidates = [c + [w] for c in candidates for w in words]
            if n + 1 < min_seq_len:
                continue
            texts = torch.tensor([[sot, *c] for c in candidates])
            log_probs = model.decode(image_tokens.expand(len(texts), -1, -1), texts).log_softmax(-1)
            targets = torch.cat([texts[:, 1:], torch.full((len(texts), 1), eos)], dim=1)
            scores = log_probs.gather(2, targets[..., None]).squeeze(-1).sum(1) / (n + 1)
            i = int(scores.argmax())
            if best is None or scores[i] > best[0]:
                best = (float(scores[i]), [sot, *candidates[i], eos])
    return best[1]


def test_beam_search_with_enough_beams_finds_the_best_caption_of_all():
    model = tiny_vocabulary_coca()
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    for min_seq_len in (2, 3):
        got = captioning.beam_search(
            model, images, sot_id=4, eos_id=5, seq_len=5, min_seq_len=min_seq_len, num_beams=125
        )
        for image, row in zip(images, got.tolist()):
            assert row[: row.index(5) + 1] == exhaustive_best(model, image, 5, min_seq_len)


def openclip_main_beam_search(model, images, sot, eos, pad, seq_len, min_seq_len, num_beams, vocab):
    """OpenCLIP main's CoCa.generate(generation_type="beam_search"): its MultimodalGenerationWrapper
    (src/open_clip/generation.py, condensed) over a CoCa with OpenCLIP's _encode_image/_encode_text/text_decoder,
    driven by transformers' generate with the GenerationConfig main builds (one beam group, no cache)."""
    from transformers import GenerationConfig
    from transformers.generation import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class Config:
        is_encoder_decoder, vocab_size, _attn_implementation = False, vocab, "eager"

        def get_text_config(self, decoder=False):
            return self

    class Wrapper(torch.nn.Module, GenerationMixin):
        main_input_name, _is_stateful = "input_ids", False

        def __init__(self, image_embs):
            super().__init__()
            self.register_buffer("_image_embs", image_embs)
            self.config = Config()
            self.generation_config = GenerationConfig(bos_token_id=sot, eos_token_id=eos, pad_token_id=pad)

        @property
        def device(self):
            return self._image_embs.device

        def prepare_inputs_for_generation(self, input_ids, image_embs=None, **kwargs):
            return {"input_ids": input_ids, "image_embs": image_embs if image_embs is not None else self._image_embs}

        def forward(self, input_ids, image_embs=None, **kwargs):
            logits = model.text_decoder(image_embs, model._encode_text(input_ids)[1])
            return CausalLMOutputWithPast(logits=logits, past_key_values=None)

    with torch.no_grad():
        image_embs = model._encode_image(images)[1]
        config = GenerationConfig(max_length=seq_len, min_length=min_seq_len, repetition_penalty=1.0,
                                  eos_token_id=eos, pad_token_id=pad, use_cache=False, num_beams=num_beams,
                                  num_beam_groups=1)  # fmt: skip
        start = torch.full((images.shape[0], 1), sot, dtype=torch.long)
        return Wrapper(image_embs).generate(start, generation_config=config, image_embs=image_embs)


def captions(ids: torch.Tensor, eos: int) -> list[list[int]]:
    """Each row up to its eos (what follows is filler: Hugging Face fills with eos where the pad id is 0)."""
    return [row[: row.index(eos) + 1] if eos in row else row for row in ids.tolist()]


class OpenCLIPMethods:
    """bigclip's CoCa seen through the three methods OpenCLIP's generate calls."""

    def __init__(self, model):
        self.text_decoder = model.text_decoder
        self._encode_image = lambda images: model.visual(images)
        self._encode_text = lambda texts: model.text(texts)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len, min_seq_len, num_beams", [(6, 2, 3), (7, 3, 4), (5, 4, 2)])
def test_beam_search_equals_openclip_mains_generate(seq_len, min_seq_len, num_beams):
    """OpenCLIP main's generate runs Hugging Face's beam search: bigclip's gives the same captions (some ending with
    eos, some at seq_len without it), on OpenCLIP's CoCa and on a small-vocabulary CoCa whose captions vary."""
    theirs = openclip_tiny_coca()
    ours = create_model(TINY).eval()
    ours.load_state_dict(openclip_to_bigclip(theirs.state_dict()))
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    options = {"sot_id": 257, "eos_id": 258, "pad_id": 0, "seq_len": seq_len, "min_seq_len": min_seq_len}
    got = captioning.beam_search(ours, images, num_beams=num_beams, **options)
    expected = openclip_main_beam_search(theirs, images, 257, 258, 0, seq_len, min_seq_len, num_beams, 259)
    assert got.shape == expected.shape and captions(got, 258) == captions(expected, 258)

    small = tiny_vocabulary_coca()
    with torch.no_grad():  # captions that depend on the image, and eos neither always nor never likely
        for block in small.text_decoder.cross_attn:
            block.attn.out_proj.weight.mul_(4)
        small.text_decoder.text_projection[:, 5] = 0
    images = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(8))
    images *= torch.linspace(0.1, 3, 16)[:, None, None, None]
    options = {"sot_id": 4, "eos_id": 5, "pad_id": 0, "seq_len": seq_len, "min_seq_len": min_seq_len}
    got = captioning.beam_search(small, images, num_beams=num_beams, **options)
    expected = openclip_main_beam_search(OpenCLIPMethods(small), images, 4, 5, 0, seq_len, min_seq_len, num_beams, 6)
    assert got.shape == expected.shape and captions(got, 5) == captions(expected, 5)
    ended = [5 in row for row in got.tolist()]
    assert any(ended) and not all(ended) and len({tuple(row) for row in got.tolist()}) > 2


@pytest.mark.slow
def test_bigclip_generate_writes_a_caption_per_image(tmp_path, capsys):
    from PIL import Image

    torch.manual_seed(0)
    weights = tmp_path / "coca.safetensors"
    from safetensors.torch import save_file

    save_file(bigclip_to_openclip(create_model(TINY).state_dict()), str(weights))  # OpenCLIP's layout
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        Image.fromarray((torch.rand(20, 24, 3) * 255).byte().numpy()).save(folder / f"{i}.png")
    args = ["generate", "--model", TINY, "--pretrained", str(weights), "--seq-len", "12", "--min-seq-len", "3"]
    assert cli.main([*args, "--generation-type", "greedy", str(folder)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["image"] for line in lines] == [str(folder / f"{i}.png") for i in range(3)]
    assert all(isinstance(line["caption"], str) for line in lines)
    # the same captions as decoding the images directly
    from bigclip.build import build_transforms
    from bigclip.data import DataConfig
    from bigclip.model import get_tokenizer
    from bigclip.model.config import ModelConfig

    _, preprocess, _ = build_transforms(ModelConfig(model=TINY), DataConfig())
    model = create_model(TINY, pretrained=str(weights)).eval()
    images = torch.stack([preprocess(Image.open(folder / f"{i}.png").convert("RGB")) for i in range(3)])
    ids = captioning.greedy(model, images, sot_id=257, eos_id=258, seq_len=12, min_seq_len=3)
    tokenizer = get_tokenizer(TINY)
    assert [line["caption"] for line in lines] == [tokenizer.decode(row).strip() for row in ids.tolist()]
    # beam search (the default) runs too
    assert cli.main([*args, str(folder / "0.png")]) == 0
    assert json.loads(capsys.readouterr().out)["image"] == str(folder / "0.png")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "test-tiny", "IMG"], "--model test-tiny: not a captioning model"),
        (["--model", TINY, "--min-seq-len", "30", "IMG"], "--min-seq-len 30: must be at least 1 and less than"),
        (["--model", TINY, "/no/such.png"], "/no/such.png: no such image file or directory"),
        (["--model", TINY, "BAD"], "not an image PIL can read"),
    ],
)
def test_generate_refuses_what_cannot_work_in_one_line(tmp_path, capfd, flags, message):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_text("not a png")
    flags = [{"IMG": str(tmp_path / "ok.png"), "BAD": str(tmp_path / "bad.png")}.get(f, f) for f in flags]
    assert cli.main(["generate", *flags]) == 2
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
