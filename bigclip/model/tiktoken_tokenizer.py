"""OpenCLIP main's tiktoken tokenizer (text_cfg tokenizer_type "tiktoken", its TikTokenTokenizer), for its modern
text models: an OpenAI BPE encoding (`tiktoken_name`, default cl100k_base) for the caption, and three control ids
reserved above the encoding's vocabulary, so they never collide with a caption's tokens:

    n_vocab       end of text (eot_token_id, the config's eos_id)
    n_vocab + 1   padding (pad_token_id, the config's pad_id)
    n_vocab + 2   start of text (bos_token_id, the config's bos_id)

A caption is [bos] + its tokens (encode_ordinary: no special-token markup) + [eot], cut to the context length with
eot kept last, then right-padded with the pad id; `pad=False` gives each caption unpadded, for variable-length
batches (data/ pads a batch to its longest caption). tiktoken downloads an encoding's file on first use into its
cache: TIKTOKEN_CACHE_DIR where set, else the run's --cache-dir's `tiktoken/` folder (so that `bigclip fetch` with
the job's --cache-dir prepares a node without network), else its own folder in the temporary directory; where it
cannot, loading is one line naming the file and where it goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator

import torch

from bigclip.errors import UserError, first_line

# Where tiktoken's own encodings are read from (its tiktoken_ext.openai_public), for the missing-file line
OPENAI_ENCODINGS = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


# Where tiktoken reads its cache folder from, in its order ("" turns its cache off); set, they win over --cache-dir
TIKTOKEN_CACHE_VARIABLES = ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")


def _user_cache_variable() -> str | None:
    return next((v for v in TIKTOKEN_CACHE_VARIABLES if v in os.environ), None)


def tiktoken_cache_dir(cache_dir: str | None = None) -> str:
    """The folder tiktoken keeps downloaded encodings in for a run with --cache-dir `cache_dir`."""
    if variable := _user_cache_variable():
        return os.environ[variable]
    return os.path.join(cache_dir, "tiktoken") if cache_dir else os.path.join(tempfile.gettempdir(), "data-gym-cache")


def cache_path(name: str, cache_dir: str | None = None) -> str:
    """The file tiktoken reads encoding `name` from before downloading it (its load.read_file_cached)."""
    return os.path.join(tiktoken_cache_dir(cache_dir), hashlib.sha1(OPENAI_ENCODINGS.format(name).encode()).hexdigest())


@contextlib.contextmanager
def _tiktoken_cache(cache_dir: str | None) -> Iterator[None]:
    """tiktoken reads its cache folder from the environment when it loads a file: --cache-dir's folder is set there
    for the load only (and only where the user set none)."""
    if not cache_dir or _user_cache_variable():
        yield
        return
    os.environ["TIKTOKEN_CACHE_DIR"] = tiktoken_cache_dir(cache_dir)
    try:
        yield
    finally:
        del os.environ["TIKTOKEN_CACHE_DIR"]


def load_encoding(name: str, model: str, cache_dir: str | None = None):
    """tiktoken's encoding `name`, downloaded on first use into tiktoken_cache_dir(cache_dir); one line
    (UserError) naming what to fetch where it cannot be had."""
    try:
        import tiktoken
    except ImportError:
        raise UserError(f"--model {model}: its tokenizer needs tiktoken; pip install 'bigclip[tiktoken]'") from None
    try:
        with _tiktoken_cache(cache_dir):
            return tiktoken.get_encoding(name)
    except (OSError, ValueError) as err:  # no network (requests' errors are OSErrors), an unknown name
        raise UserError(
            f"--model {model}: tiktoken encoding {name} (text_cfg tiktoken_name) could not be loaded "
            f"({first_line(err)}); run `bigclip fetch --model {model}` with the same --cache-dir where "
            f"{OPENAI_ENCODINGS.format(name)} is reachable, or save that file as {cache_path(name, cache_dir)}"
        ) from None


class TikTokenTokenizer:
    def __init__(self, encoding, context_length: int | None = 256, add_bos: bool = True, add_eos: bool = True):
        self.enc = encoding
        self.context_length, self.add_bos, self.add_eos = context_length, add_bos, add_eos
        base = encoding.n_vocab
        self.eot_token_id, self.pad_token_id, self.bos_token_id = base, base + 1, base + 2
        self.sot_token_id = self.bos_token_id
        self.all_special_ids = [self.eot_token_id, self.pad_token_id, self.bos_token_id]
        self.vocab_size = base + 3

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, tokens) -> str:
        return self.enc.decode([int(t) for t in tokens if int(t) < self.enc.n_vocab])

    def _ids(self, text: str, length: int | None) -> list[int]:
        ids = [self.bos_token_id] * self.add_bos + self.encode(text) + [self.eot_token_id] * self.add_eos
        if length is not None and len(ids) > length:
            ids = ids[:length]
            if self.add_eos:  # pooling reads the end of text: keep it last
                ids[-1] = self.eot_token_id
        return ids

    def __call__(self, texts: str | list[str], context_length: int | None = None, pad: bool = True):
        """(N, context_length) ids right-padded with the pad id; pad=False: a list of N unpadded 1-D tensors."""
        texts = [texts] if isinstance(texts, str) else texts
        length = context_length or self.context_length
        rows = [self._ids(text, length) for text in texts]
        if not pad:
            return [torch.tensor(ids, dtype=torch.long) for ids in rows]
        if not length:
            raise ValueError("a context length is needed for padded tokenization")
        out = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        for i, ids in enumerate(rows):
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


def tiktoken_tokenizer(
    name: str, text_cfg: dict, context_length: int, cache_dir: str | None = None
) -> TikTokenTokenizer:
    """What OpenCLIP main's get_tokenizer gives architecture `name`: its text_cfg's encoding, add_bos/add_eos from
    its tokenizer_kwargs, and, as main checks, the text_cfg's eos_id (where pooling reads it) and pad_id the
    tokenizer's (pooling and the pad mask would read the wrong positions otherwise). cache_dir: the run's
    --cache-dir (where the encoding is downloaded)."""
    if (text_cfg.get("tokenizer_kwargs") or {}).get("clean"):
        raise UserError(f"--model {name}: text_cfg tokenizer_kwargs clean is not built for tiktoken tokenizers yet")
    kwargs = {k: v for k, v in (text_cfg.get("tokenizer_kwargs") or {}).items() if k in ("add_bos", "add_eos")}
    encoding = load_encoding(text_cfg.get("tiktoken_name", "cl100k_base"), name, cache_dir)
    tokenizer = TikTokenTokenizer(encoding, context_length=context_length, **kwargs)
    pool = text_cfg.get("pool_type", "argmax")
    uses_eos = pool == "eos" or (text_cfg.get("text_arch") == "modern" and pool == "argmax")
    checks = [("eos_id", tokenizer.eot_token_id)] * uses_eos + [("pad_id", tokenizer.pad_token_id)]
    for key, theirs in checks:
        ours = text_cfg.get(key)
        if ours is not None and int(ours) != theirs:
            raise UserError(
                f"--model {name}: text_cfg {key} {ours} is not tiktoken {encoding.name}'s ({theirs}); fix its config"
            )
    return tokenizer
