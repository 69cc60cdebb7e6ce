"""The embedded demo: scikit-learn's bundled 8x8 handwritten digits as image-caption pairs.

No download: the 1,797 images ship inside scikit-learn. Each image is captioned with the zero-shot
template ("a photo of the digit seven."), so the zero-shot classifier asks exactly the question
training answered. A fixed stratified 20% is held out for validation and zero-shot evaluation; the
split does not depend on --seed, so numbers from different runs compare.

Everything is precomputed as tensors and a whole batch is made at once (shift, upscale, normalise),
so the loader costs microseconds per batch and never the model's time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from bigclip.data.info import DataInfo
from bigclip.data.sampler import ShardedBatchSampler
from bigclip.errors import UserError

DIGIT_CLASSNAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# The longest caption, "a photo of the digit three.", is 27 bytes: it fits test-tiny's byte tokenizer
# (context length 32 = 30 bytes + start and end tokens). A shorter context cuts it before the class name.
DIGIT_TEMPLATES = ["a photo of the digit {}."]
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
MAX_SHIFT = 1  # pixels, on the 8x8 grid: digits are centred loosely, so small shifts are realistic


def digit_caption(label: int) -> str:
    return DIGIT_TEMPLATES[0].format(DIGIT_CLASSNAMES[label])


@dataclass
class DigitSplit:
    train_images: torch.Tensor  # float [N, 8, 8] in 0..1
    train_labels: torch.Tensor  # long [N]
    heldout_images: torch.Tensor
    heldout_labels: torch.Tensor
    train_indices: torch.Tensor  # positions in sklearn's load_digits()
    heldout_indices: torch.Tensor


def load_digit_split() -> DigitSplit:
    # scikit-learn takes seconds to import and only the demo needs it: imported when the demo runs.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, heldout_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=HELDOUT_FRACTION, stratify=labels.numpy(), random_state=SPLIT_SEED
    )
    train_idx, heldout_idx = torch.from_numpy(train_idx), torch.from_numpy(heldout_idx)
    return DigitSplit(
        images[train_idx], labels[train_idx], images[heldout_idx], labels[heldout_idx], train_idx, heldout_idx
    )


def random_shift(images: torch.Tensor, generator: torch.Generator, max_shift: int = MAX_SHIFT) -> torch.Tensor:
    """Move each [8, 8] image by its own whole-pixel offset; uncovered pixels are background (0)."""
    n, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n, 1), generator=generator)
    rows = (dy + torch.arange(h))[:, :, None]
    cols = (dx + torch.arange(w))[:, None, :]
    return padded[torch.arange(n)[:, None, None], rows, cols]


class DigitsDataset(Dataset):
    """Fetched a batch at a time (`__getitems__`): returns (images, tokens) or (images, labels)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        image_size: tuple[int, int],
        mean,
        std,
        class_tokens: torch.Tensor | None = None,
        augment: bool = False,
        seed: int = 0,
    ):
        self.images, self.labels = images, labels
        self.image_size = tuple(image_size)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
        self.class_tokens = class_tokens  # [10, L]; None: yield labels (zero-shot)
        self.augment = augment
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        images, targets = self.__getitems__([index])
        return images[0], targets[0]

    def __getitems__(self, indices: list[int]):
        images = self.images[indices]
        if self.augment:
            # Seeded by the batch's indices, which already depend on (seed, epoch): reproducible runs.
            seed = random.Random(f"{self.seed}/{','.join(map(str, indices))}").getrandbits(63)
            images = random_shift(images, torch.Generator().manual_seed(seed))
        images = F.interpolate(images[:, None], size=self.image_size, mode="bilinear", align_corners=False)
        images = (images.expand(-1, 3, -1, -1) - self.mean) / self.std
        labels = self.labels[indices]
        return images, (labels if self.class_tokens is None else self.class_tokens[labels])


def _keep_batch(batch):
    return batch


def _loader(dataset: DigitsDataset, sampler: ShardedBatchSampler) -> DataInfo:
    # workers=0 always: batches are tensor slices; worker processes would only add latency.
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=0, collate_fn=_keep_batch)
    return DataInfo(loader, num_samples=len(dataset), num_batches=sampler.num_batches, sampler=sampler)


def build_digits(
    tokenizer,
    image_size: tuple[int, int],
    mean,
    std,
    batch_size: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> dict:
    """{'train', 'val', 'zeroshot': DataInfo, 'classnames', 'templates'} for the embedded demo."""
    split = load_digit_split()
    class_tokens = tokenizer([digit_caption(c) for c in range(len(DIGIT_CLASSNAMES))])
    if len(torch.unique(class_tokens, dim=0)) != len(DIGIT_CLASSNAMES):
        raise UserError(
            f"--force-context-length {class_tokens.shape[1]}: too short for the demo captions "
            f"(e.g. {digit_caption(7)!r}); use at least 30 or leave it unset"
        )
    train = DigitsDataset(
        split.train_images, split.train_labels, image_size, mean, std, class_tokens, augment=True, seed=seed
    )
    val = DigitsDataset(split.heldout_images, split.heldout_labels, image_size, mean, std, class_tokens)
    zeroshot = DigitsDataset(split.heldout_images, split.heldout_labels, image_size, mean, std)

    def sampler(dataset: DigitsDataset, train: bool) -> ShardedBatchSampler:
        return ShardedBatchSampler(len(dataset), batch_size, rank, world_size, seed, train=train)

    return {
        "train": _loader(train, sampler(train, True)),
        "val": _loader(val, sampler(val, False)),
        "zeroshot": _loader(zeroshot, sampler(zeroshot, False)),
        "classnames": list(DIGIT_CLASSNAMES),
        "templates": list(DIGIT_TEMPLATES),
    }
