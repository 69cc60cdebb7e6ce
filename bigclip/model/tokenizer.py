"""Byte-level tokenizer that needs no vocabulary file: for architectures whose config asks for it.

OpenCLIP architectures use OpenCLIP's own BPE tokenizer (model/factory.py:get_tokenizer). This one is
for small models trained from scratch, such as `test-tiny` and the embedded demo, where a 259-id
vocabulary keeps the embedding tiny. Text is cleaned (HTML entities unescaped, whitespace collapsed,
lower-cased) and encoded as UTF-8 bytes:

    0        padding
    1..256   byte value + 1
    257      start of text (sot)
    258      end of text (eot) -- the largest id, so `argmax(tokens)` finds it for pooling

The vocabulary therefore has 259 ids.
"""

from __future__ import annotations

import html
import re

import torch

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
