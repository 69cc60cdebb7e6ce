"""Tokenizers: which one an architecture gets (OpenCLIP's get_tokenizer rule), and bigclip's byte tokenizer.

The choice (`tokenizer_kind`, `openclip_tokenizer`) is OpenCLIP's for the same config:

    text_cfg hf_tokenizer_name   a Hugging Face tokenizer (OpenCLIP's HFTokenizer with the text_cfg's
                                 tokenizer_mode and tokenizer_kwargs: SigLIP's sentencepiece vocabularies, CLIPA's
                                 BERT, the worldwide models' XLM-V), fetched into the hub cache (--cache-dir)
    a built-in name with siglip  OpenCLIP's SigLipTokenizer (its T5/Gemma sentencepiece files)
    text_cfg tokenizer_type      OpenCLIP main's tiktoken tokenizer (its tiktoken_name encoding, control ids above
      "tiktoken"                 it: tiktoken_tokenizer.py), before an hf_tokenizer_name as main does
    otherwise                    OpenCLIP's BPE tokenizer (SimpleTokenizer, 49,408 ids, tokenizer_kwargs)

and a tokenizer that is not at hand (offline, unreachable hub) is one line naming what to fetch.

The byte tokenizer needs no vocabulary file: for architectures whose config asks for it ("tokenizer": "byte"),
small models trained from scratch such as `test-tiny` and the embedded demo, where a 259-id vocabulary keeps the
embedding tiny. Text is cleaned (HTML entities unescaped, whitespace collapsed, lower-cased) and encoded as UTF-8
bytes:

    0        padding
    1..256   byte value + 1
    257      start of text (sot)
    258      end of text (eot) -- the largest id, so `argmax(tokens)` finds it for pooling

The vocabulary therefore has 259 ids.
"""

from __future__ import annotations

import html
import os
import re
from contextlib import contextmanager

import torch

from bigclip.errors import UserError, first_line
from bigclip.model.registry import hub_cache_dir, parse_model_name
from bigclip.model.tiktoken_tokenizer import tiktoken_tokenizer

# text_cfg keys that describe the tokenizer, not the tower (OpenCLIP's CLIPTextCfg)
TOKENIZER_KEYS = ("hf_tokenizer_name", "tokenizer_mode", "tokenizer_kwargs", "tokenizer_type", "tiktoken_name")
DEFAULT_CONTEXT_LENGTH = 77  # OpenCLIP's, where a text_cfg names none
# OpenCLIP's BPE vocabulary: 49,152 merges + 256 bytes + start/end of text.
OPENCLIP_VOCAB_SIZE = 49408

PAD_ID = 0
BYTE_OFFSET = 1
SOT_ID = 257
EOT_ID = 258
VOCAB_SIZE = 259

_WHITESPACE = re.compile(r"\s+")


def clean_text(text: str) -> str:
    # Unescape twice: captions scraped from the web are often double-escaped ("&amp;amp;").
    text = html.unescape(html.unescape(text))
    return _WHITESPACE.sub(" ", text).strip().lower()


class ByteTokenizer:
    pad_token_id = PAD_ID
    sot_token_id = SOT_ID
    eot_token_id = EOT_ID
    vocab_size = VOCAB_SIZE

    def __init__(self, context_length: int = 77):
        if context_length < 2:
            raise ValueError(f"context length must be >= 2 (sot + eot), got {context_length}")
        self.context_length = context_length

    def encode(self, text: str) -> list[int]:
        """Token ids of one text without sot/eot or padding."""
        return [b + BYTE_OFFSET for b in clean_text(text).encode("utf-8")]

    def decode(self, ids) -> str:
        """Inverse of encode for byte ids; special and padding ids are dropped."""
        data = bytes(int(i) - BYTE_OFFSET for i in ids if BYTE_OFFSET <= int(i) < SOT_ID)
        return data.decode("utf-8", errors="replace")

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.LongTensor:
        if isinstance(texts, str):
            texts = [texts]
        length = context_length or self.context_length
        out = torch.full((len(texts), length), PAD_ID, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [SOT_ID, *self.encode(text), EOT_ID]
            if len(ids) > length:
                # Truncate but keep eot last: pooling reads the features at eot.
                ids = ids[:length]
                ids[-1] = EOT_ID
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


def tokenizer_kind(name: str, model_cfg: dict, schema: bool = False) -> str:
    """Which tokenizer architecture `name` (its config `model_cfg`) gets: "byte" (the config asks for bigclip's),
    "tiktoken" (text_cfg tokenizer_type: OpenCLIP main's, tiktoken_tokenizer.py), "hf" (text_cfg hf_tokenizer_name),
    "siglip" (OpenCLIP's rule for a built-in name that says siglip and names no
    tokenizer) or "bpe" (OpenCLIP's SimpleTokenizer). schema: a local-dir:/hf-hub: name (no rule by name)."""
    if model_cfg.get("tokenizer") == "byte":
        return "byte"
    if model_cfg.get("text_cfg", {}).get("tokenizer_type") == "tiktoken":  # OpenCLIP main's, before an HF name
        return "tiktoken"
    if model_cfg.get("text_cfg", {}).get("hf_tokenizer_name"):
        return "hf"
    return "siglip" if not schema and "siglip" in name.lower() else "bpe"


def hub_tokenizer(name: str, model_cfg: dict) -> str | None:
    """The Hugging Face hub repository architecture `name` reads its tokenizer from (its text_cfg hf_tokenizer_name,
    unless that is a local folder or the name a local-dir:, whose folder holds it), or None."""
    schema, _ = parse_model_name(name)
    if schema == "local-dir" or tokenizer_kind(name, model_cfg, schema is not None) != "hf":
        return None
    source = model_cfg["text_cfg"]["hf_tokenizer_name"]
    return None if os.path.isdir(source) else source


def tiktoken_encoding(name: str, model_cfg: dict) -> str | None:
    """The tiktoken encoding architecture `name` tokenizes with (its text_cfg tiktoken_name), or None."""
    schema, _ = parse_model_name(name)
    if tokenizer_kind(name, model_cfg, schema is not None) != "tiktoken":
        return None
    return model_cfg["text_cfg"].get("tiktoken_name", "cl100k_base")


def known_vocab_size(name: str, model_cfg: dict, schema: bool = False) -> int | None:
    """The number of token ids the architecture's tokenizer gives, where it is known without the hub."""
    kind = tokenizer_kind(name, model_cfg, schema)
    return {"byte": VOCAB_SIZE, "bpe": OPENCLIP_VOCAB_SIZE}.get(kind)


def openclip_tokenizer(name: str, model_cfg: dict, context_length: int | None = None, cache_dir: str | None = None):
    """What open_clip.get_tokenizer(name) gives for the built-in architecture `name` whose config is `model_cfg`
    (bigclip's copy of it: the same choice for bigclip's own configs), context_length overriding the text_cfg's;
    a Hugging Face tokenizer through the hub cache `cache_dir`. One line (UserError) where it cannot be had."""
    from open_clip import tokenizer as openclip  # seconds to import; only runs tokenizing with OpenCLIP's need it

    text_cfg = model_cfg.get("text_cfg", {})
    length = context_length or text_cfg.get("context_length", DEFAULT_CONTEXT_LENGTH)
    kwargs = dict(text_cfg.get("tokenizer_kwargs") or {})
    kind = tokenizer_kind(name, model_cfg)
    if kind == "tiktoken":
        return tiktoken_tokenizer(name, text_cfg, length, cache_dir)
    if kind == "bpe":
        return openclip.SimpleTokenizer(context_length=length, **kwargs)
    if kind == "siglip":  # OpenCLIP's variants by name: Gemma's for SigLIP 2, mC4's for i18n, else English C4
        variant = "gemma" if "siglip2" in name.lower() else "mc4" if "i18n" in name.lower() else "c4-en"
        url = openclip.SigLipTokenizer.VOCAB_FILES[variant]
        remedy = f"OpenCLIP reads it from {url}: run where that is reachable, or name a Hugging Face tokenizer in "
        remedy += "its text_cfg hf_tokenizer_name"
        with tokenizer_at_hand(name, f"OpenCLIP's SigLIP tokenizer {variant}", remedy):
            return openclip.SigLipTokenizer(variant, context_length=length)
    source = text_cfg["hf_tokenizer_name"]
    remedy = f"it is not in the Hugging Face cache {hub_cache_dir(cache_dir)}: fetch it where the hub is reachable, "
    remedy += f"`bigclip fetch --model {name}` (same --cache-dir), or allow downloads (HF_HUB_OFFLINE unset)"
    with tokenizer_at_hand(name, f"its tokenizer {source} (text_cfg hf_tokenizer_name)", remedy):
        tokenizer = openclip.HFTokenizer(
            source, context_length=length, cache_dir=cache_dir, tokenizer_mode=text_cfg.get("tokenizer_mode"), **kwargs
        )
    # a text_cfg pad_id that is not the tokenizer's is refused, as OpenCLIP main refuses it: the tower's pad mask
    # and pooling would disagree with the ids
    pad_id, theirs = text_cfg.get("pad_id"), getattr(tokenizer.tokenizer, "pad_token_id", None)
    if pad_id is not None and theirs is not None and pad_id != theirs:
        raise UserError(f"--model {name}: text_cfg pad_id {pad_id} is not tokenizer {source}'s pad id {theirs}")
    return tokenizer


@contextmanager
def tokenizer_at_hand(name: str, what: str, remedy: str):
    """A tokenizer whose files cannot be had (not cached and offline, an unreachable or unknown repository,
    transformers missing) is one line naming it and what to do, not transformers' traceback."""
    try:
        yield
    except ImportError as err:
        raise UserError(
            f"--model {name}: {what} needs transformers ({first_line(err)}); pip install 'bigclip[hf]'"
        ) from None
    except OSError as err:
        raise UserError(f"--model {name}: {what} could not be loaded ({first_line(err)}); {remedy}") from None


def variable_text_pad_id(name: str, model_cfg: dict, tokenizer) -> int | None:
    """The padding id variable-length batches are cut by (text_cfg variable_text: OpenCLIP main pads each batch to
    its longest caption), None for fixed-length text. As main, a tokenizer without a reserved padding id is refused
    (id 0 is a real token in most vocabularies)."""
    if not model_cfg.get("text_cfg", {}).get("variable_text"):
        return None
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else getattr(getattr(tokenizer, "tokenizer", None), "pad_token_id", None)
    if pad is None:
        raise UserError(f"--model {name}: text_cfg variable_text needs a tokenizer with a padding id; this has none")
    return int(pad)
