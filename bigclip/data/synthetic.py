"""Random images and token sequences of the right shapes, for benchmarks and tests without data.

Every sample is a pure function of (seed, index): two runs, any number of workers, see the same data.
Images are made as normalised tensors directly (no PIL, no transform) so that the loader stays
far faster than any model, even at 224 px.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from bigclip.data.config import DataConfig
from bigclip.data.info import DataInfo
from bigclip.data.sources import (
    DATA_SOURCES,
    DataSource,
    LoaderContext,
    Split,
    batch_sampler,
    image_size,
    map_style_loader,
)

# OpenCLIP's BPE tokenizer, used when no tokenizer is given.
_DEFAULT_CONTEXT_LENGTH, _DEFAULT_SOT, _DEFAULT_EOT = 77, 49406, 49407


def token_layout(tokenizer) -> tuple[int, int, int, int]:
    """(context length, sot id, eot id, padding id), read off the tokenization of an empty text."""
    if tokenizer is None:
        return _DEFAULT_CONTEXT_LENGTH, _DEFAULT_SOT, _DEFAULT_EOT, 0
    empty = tokenizer([""])[0]
    return int(empty.shape[0]), int(empty[0]), int(empty[1]), int(empty[-1]) if len(empty) > 2 else 0


class SyntheticDataset(Dataset):
    def __init__(self, num_samples: int, image_size: tuple[int, int], tokenizer=None, seed: int = 0, stream: int = 0):
        self.num_samples = num_samples
        self.image_size = tuple(image_size)
        self.context_length, self.sot, self.eot, self.pad = token_layout(tokenizer)
        # Text ids below both specials: the eot stays the largest id, which argmax pooling relies on.
        self.max_text_id = max(2, min(self.sot, self.eot))
        self.seed = seed
        self.stream = stream  # 0 train, 1 val: different data from the same seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + index) << 1) + self.stream)
        image = torch.randn(3, *self.image_size, generator=g)
        # padded as the tokenizer pads (0 in OpenCLIP's BPE, a reserved id in main's tiktoken tokenizer)
        tokens = torch.full((self.context_length,), self.pad, dtype=torch.long)
        length = int(torch.randint(0, self.context_length - 1, (1,), generator=g))
        tokens[0] = self.sot
        tokens[1 : length + 1] = torch.randint(1, self.max_text_id, (length,), generator=g)
        tokens[length + 1] = self.eot
        return image, tokens


SYNTHETIC_DEFAULT_SAMPLES = 1000


def build_synthetic(cfg: DataConfig, split: Split, ctx: LoaderContext) -> DataInfo:
    num_samples = split.num_samples or SYNTHETIC_DEFAULT_SAMPLES
    size = image_size(ctx)
    dataset = SyntheticDataset(num_samples, size, ctx.tokenizer, seed=cfg.seed, stream=0 if split.train else 1)
    flag = "--train-num-samples" if split.train else "--val-num-samples"
    return map_style_loader(
        dataset, batch_sampler(cfg, num_samples, split.train, ctx), cfg.workers, None, flag, cfg, ctx
    )


DATA_SOURCES.register(
    "synthetic",
    DataSource(build_synthetic, needs_path=False, flags=("train_num_samples", "val_num_samples", "workers")),
    help="random images and tokens of the model's shapes (--train-num-samples, default 1000)",
)
