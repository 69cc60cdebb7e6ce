"""Every OpenCLIP architecture tokenizes exactly as OpenCLIP does; the byte tokenizer only where a config asks.

OpenCLIP (`open_clip_torch`) is the oracle: the same strings through bigclip's get_tokenizer (what the data
pipeline and zero-shot use) and through open_clip.get_tokenizer give the same token ids.
"""

import random

import open_clip
import pytest
import torch

from bigclip.build import build_data
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.model import ByteTokenizer, get_tokenizer
from bigclip.model.factory import uses_byte_tokenizer

HAND_PICKED = [
    "",
    " ",
    "a photo of a dog",
    "A PHOTO OF A DOG.",
    "a  photo\tof\n\na   dog",
    "&amp;amp; &lt;b&gt;bold&lt;/b&gt; caf&eacute;",
    "naïve café — déjà vu, Ünïcödé",
    "北京的天气很好 🌞🌧️ emoji 👩‍👩‍👧‍👦",
    "Привет, мир! Γειά σου Κόσμε",
    "!!!???...,,,;;;:::---___***",
    "don't won't it's I'm we've they'd",
    "http://example.com/path?q=1&r=2#frag",
    "1234567890 3.14159 1e-10 $100 50% #hashtag @user",
    "word " * 200,  # far past the context length: truncated with the end token kept last
    "x" * 500,
    "ÀÉÎÕÜ àéîõü ß Æ Ø Å",
    "tab\tseparated\tvalues",
    "<|startoftext|> <|endoftext|>",
]


def varied_strings(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = (
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-()[]{}<>/\\@#$%^&*_+=~`|"
        "éèêëàâäôöûüçñßøåæœ日本語中文한국어😀🎉\t\n"
    )
    out = list(HAND_PICKED)
    while len(out) < n:
        length = rng.choice([0, 1, 3, 10, 40, 120, 400])
        out.append("".join(rng.choice(alphabet) for _ in range(length)))
    return out


@pytest.mark.parametrize("model", ["ViT-B-32", "ViT-B-16-quickgelu", "ViT-L-14", "ViT-H-14", "ViT-bigG-14"])
@pytest.mark.parametrize("context_length", [None, 16])
def test_same_token_ids_as_open_clip(model, context_length):
    texts = varied_strings()
    ours = get_tokenizer(model, context_length=context_length)(texts)
    theirs = open_clip.get_tokenizer(model, context_length=context_length)(texts)
    assert ours.dtype == torch.long and ours.shape == (len(texts), context_length or 77)
    assert torch.equal(ours, theirs)
    assert ours.max() == 49407  # OpenCLIP's end-of-text id, not a byte id


def test_training_data_uses_open_clip_token_ids_with_force_context_length():
    """What the run builds (build.build_data), not just the factory: --force-context-length reaches the
    tokenizer, and the token ids are OpenCLIP's."""
    cfg = resolve(
        {"model": "ViT-B-32", "dataset_type": "synthetic", "force_context_length": 24, "batch_size": 2,
         "train_num_samples": 4, "workers": 0}
    )  # fmt: skip
    _, tokenizer = build_data(cfg.sections.model, cfg.sections.data, World(), epoch=0)
    texts = varied_strings(40, seed=1)
    assert torch.equal(tokenizer(texts), open_clip.get_tokenizer("ViT-B-32", context_length=24)(texts))


def test_byte_tokenizer_only_where_the_config_asks():
    assert uses_byte_tokenizer("test-tiny") and isinstance(get_tokenizer("test-tiny"), ByteTokenizer)
    for model in ("ViT-B-32", "ViT-L-14", "ViT-bigG-14"):
        assert not uses_byte_tokenizer(model) and not isinstance(get_tokenizer(model), ByteTokenizer)
