"""Builds OpenCLIP main's gte-modernbert-base-ViT-B-32-256 by name in bigclip against a hub that serves a tiny stand-in
of Alibaba-NLP/gte-modernbert-base (HF_ENDPOINT: tests/test_openclip_main.py's FakeHub; HF_HOME: an empty cache), and
prints one JSON object of what the test checks: every name of configs/openclip_main/ built on meta or refused; the
text features against transformers' own ModernBERT with OpenCLIP main's cls pooling and linear projection computed
here; the exported names; the tokenizer's ids; a meta build."""

from __future__ import annotations

import json
import sys
import warnings

import torch
import transformers

from bigclip.errors import UserError
from bigclip.model import bigclip_to_openclip, create_model, get_tokenizer
from bigclip.model.hf_text import HFTextTower
from bigclip.model.registry import MAIN_CONFIG_DIR

NAME, REPO = "gte-modernbert-base-ViT-B-32-256", "Alibaba-NLP/gte-modernbert-base"
TEXTS = ["a photo of a cat", "two dogs playing on a beach at sunset", "a red car"]


def walk() -> dict[str, list]:
    """Every name of configs/openclip_main/ built on meta: ["built", parameters] or ["refused", the error line]."""
    out = {}
    for path in sorted(MAIN_CONFIG_DIR.glob("*.json")):
        try:
            model = create_model(path.stem, device="meta")
        except UserError as e:
            out[path.stem] = ["refused", str(e)]
            continue
        out[path.stem] = ["built", sum(p.numel() for p in model.parameters())]
    return out


def main() -> dict:
    out = {"walk": walk()}
    torch.manual_seed(0)
    ours = create_model(NAME).eval()
    assert isinstance(ours.text, HFTextTower)
    tokens = get_tokenizer(NAME)(TEXTS)
    out["tokens"] = tokens[:, :10].tolist()
    out["tokens_shape"] = list(tokens.shape)
    out["dtypes"] = sorted({str(p.dtype) for p in ours.parameters()})
    out["max_position_embeddings"] = ours.text.config.max_position_embeddings
    # OpenCLIP main's HFTextEncoder, computed here from its parts: transformers' model of the same repository (its
    # config with main's override), the token states at the cls position (cls_pooler: ModernBERT has no pooler
    # output), the linear projection (hf_proj_type linear, no bias); the mask from the pad id
    config = transformers.AutoConfig.from_pretrained(REPO, max_position_embeddings=256)
    reference = transformers.AutoModel.from_pretrained(REPO, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        states = reference(input_ids=tokens, attention_mask=(tokens != config.pad_token_id).long()).last_hidden_state
        expected = states[:, 0] @ ours.text.proj.weight.T
        got = ours.encode_text(tokens)
    out["text_features_max_diff"] = (got - expected).abs().max().item()
    out["text_features_norm"] = expected.norm().item()
    exported = bigclip_to_openclip(ours.state_dict())
    out["text_names"] = sorted(k for k in exported if k.startswith("text."))
    out["reference_names"] = sorted(f"text.transformer.{k}" for k in reference.state_dict())
    weights = {f"text.transformer.{k}": v for k, v in reference.state_dict().items()}
    out["hub_weights_loaded"] = all(torch.equal(exported[k], v) for k, v in weights.items())
    # built on meta, materialised as sharding engines do: the hub's weights again, buffers restored
    meta = create_model(NAME, device="meta")
    out["meta_params"] = sum(p.numel() for p in meta.parameters())
    out["params"] = sum(p.numel() for p in ours.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights()
    text = meta.text.transformer.state_dict()
    out["meta_init_equal"] = all(torch.equal(text[k], v) for k, v in reference.state_dict().items())
    return out


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    json.dump(main(), sys.stdout)
