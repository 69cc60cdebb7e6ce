"""--imagenet-val / --imagenet-v2: ImageNet-layout folders for zero-shot classification, as OpenCLIP reads them.

--imagenet-val is torchvision's ImageFolder layout: one folder per class (the synset ids, n01440764 ...), class
index = position in sorted order. --imagenet-v2 is ImageNetV2's layout (folders 0 ... 999, class index = the
folder's number; a lexicographic sort would put 10 before 2). The 1000 class names and the 80 prompt
templates are OpenCLIP's own (open_clip.zero_shot_metadata), so the numbers compare with OpenCLIP's.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from bigclip.data.config import DataConfig
from bigclip.data.decode import decode_rgb
from bigclip.data.device_decode import collate_samples
from bigclip.data.info import DataInfo
from bigclip.data.sampler import ShardedBatchSampler
from bigclip.data.workers import worker_loader
from bigclip.errors import UserError

NUM_CLASSES = 1000
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
# flag -> the metric-name prefix OpenCLIP logs it under
ZEROSHOT_SETS = {"imagenet_val": "imagenet-zeroshot-val", "imagenet_v2": "imagenetv2-zeroshot-val"}


def imagenet_prompts() -> tuple[list[str], list[str]]:
    """OpenCLIP's ImageNet class names and its 80 templates, as format strings ("a photo of a {}.")."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    return list(IMAGENET_CLASSNAMES), [template("{}") for template in OPENAI_IMAGENET_TEMPLATES]


def class_folders(root: str, flag: str) -> list[str]:
    """The class folders of `root` in class-index order, or a UserError saying what was found instead."""
    if not os.path.isdir(root):
        raise UserError(f"--{flag.replace('_', '-')} {root}: not a directory; pass an ImageNet folder of 1000 classes")
    folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if len(folders) != NUM_CLASSES:
        raise UserError(
            f"--{flag.replace('_', '-')} {root}: found {len(folders)} class folders, expected {NUM_CLASSES} "
            f"(one per ImageNet class, e.g. n01440764/ or 0/ ... 999/)"
        )
    if all(d.isdigit() for d in folders):  # ImageNetV2: the folder's number is the class index
        if sorted(int(d) for d in folders) != list(range(NUM_CLASSES)):
            raise UserError(f"--{flag.replace('_', '-')} {root}: numbered class folders must be 0 ... 999")
        folders.sort(key=int)
    return folders


class ImageFolderDataset(Dataset):
    def __init__(self, root: str, flag: str, transform):
        self.transform = transform
        self.samples: list[tuple[str, int]] = []
        for label, folder in enumerate(class_folders(root, flag)):
            directory = os.path.join(root, folder)
            for name in sorted(os.listdir(directory)):
                if name.lower().endswith(IMAGE_EXTENSIONS):
                    self.samples.append((os.path.join(directory, name), label))
        if not self.samples:
            raise UserError(f"--{flag.replace('_', '-')} {root}: the class folders hold no images")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return decode_rgb(path, self.transform), label


def build_zeroshot_sets(cfg: DataConfig, preprocess_val, rank: int, world_size: int) -> dict[str, DataInfo]:
    """One evaluation loader per ImageNet flag given, keyed by its metric prefix; every image on one rank."""
    out = {}
    for flag, prefix in ZEROSHOT_SETS.items():
        root = getattr(cfg, flag)
        if not root:
            continue
        dataset = ImageFolderDataset(root, flag, preprocess_val)
        sampler = ShardedBatchSampler(len(dataset), cfg.batch_size, rank, world_size, train=False)
        loader = worker_loader(dataset, cfg.workers, batch_sampler=sampler, collate_fn=collate_samples)
        out[prefix] = DataInfo(loader, num_samples=len(dataset), num_batches=sampler.num_batches, sampler=sampler)
    return out
