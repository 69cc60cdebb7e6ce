"""DataConfig: the slice of the flags the data package reads, and the one parser of --train-data / --val-data.

A data value names one or more sources joined by '::' (OpenCLIP's syntax), each a path or URL with brace
patterns (shards-{0000..0099}.tar). `sources()` is the only place that syntax is read: validation, the format
detection of --dataset-type auto, the upsampling factors and the shard lists all start from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import webdataset as wds

from bigclip.data.sample_keys import DEFAULT_IMAGE_KEY, DEFAULT_TEXT_KEY, SampleKeys
from bigclip.data.transforms import DECODE_MODES, INTERPOLATIONS, RESIZE_MODES
from bigclip.flag_fields import DATA, EVAL, Applies, flag, non_negative_int, optional, positive_int
from bigclip.registry import Registry
from bigclip.storage_options import parse_storage_options

OPENCLIP_WORKERS = 4


def default_workers() -> int:
    """--workers' default: OpenCLIP's 4, but no more than the CPUs this process may run on (a 2-core machine
    otherwise gets PyTorch's warning that 4 workers exceed its suggested maximum, and slower loading)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or OPENCLIP_WORKERS
    return min(OPENCLIP_WORKERS, cpus)


# --dataset-type NAME -> a data/sources.py DataSource; each kind's module registers itself (data/factory.py
# imports them). Created here, with the flag that names it.
DATA_SOURCES: Registry = Registry("--dataset-type")


def sources(value: str) -> list[list[str]]:
    """The paths or URLs of every '::'-separated source of a data value: WebDataset's own expansion (brace
    patterns, WDS_ environment variables) of each."""
    return [wds.shardlists.expand_urls(source) for source in value.split("::")]


@dataclass(frozen=True)
class DataConfig:
    """The data flags (OpenCLIP's names), and the run's values the loaders are cut by."""

    train_data: str | None = flag(
        None,
        "Training data: a CSV file, WebDataset shards with brace expansion "
        "(a::b for several sources), or nothing for the embedded demo.",
        DATA,
    )
    val_data: str | None = flag(None, "Validation data, same formats as --train-data.", DATA)
    train_num_samples: int | None = flag(
        None, "Samples per epoch; required for WebDataset.", DATA, check=optional(positive_int)
    )
    val_num_samples: int | None = flag(
        None, "Samples in the validation set (WebDataset).", DATA, check=optional(positive_int)
    )
    dataset_type: str = flag(
        "auto",
        "The data format: auto (the kind the file extension of --train-data names), or a registered kind.",
        DATA,
        shows=DATA_SOURCES,
    )
    dataset_resampled: bool = flag(
        False, "WebDataset: each reader draws shards with replacement (seeded by seed, epoch, rank, worker).", DATA
    )
    csv_separator: str = flag("\t", "Column separator of CSV data.", DATA)
    csv_img_key: str = flag("filepath", "CSV column holding image paths.", DATA)
    csv_caption_key: str = flag("title", "CSV column holding captions.", DATA)
    max_image_pixels: int | None = flag(
        None,
        "Skip (and count as data/skipped_too_large) images whose header says more pixels than this, before "
        "decoding them; 0 or unset: no limit (OpenCLIP main's flag).",
        DATA,
        check=optional(non_negative_int),
    )
    shard_prefetch_mb: int = flag(
        32,
        "WebDataset on object storage (any fsspec URL): each reader reads its shards this many MiB ahead in a "
        "thread and starts the next shard while decoding the current one (the same samples in the same order); "
        "0: read only as decoding asks.",
        DATA,
        check=non_negative_int,
    )
    image_key: str = flag(
        DEFAULT_IMAGE_KEY,
        "WebDataset: the member suffix holding the image; ';' separates alternatives, the first present wins "
        "(OpenCLIP main's flag).",
        DATA,
    )
    text_key: str = flag(
        DEFAULT_TEXT_KEY,
        "WebDataset: the member suffix holding the caption, ';' for alternatives, e.g. txt;caption (OpenCLIP "
        "main's flag).",
        DATA,
    )
    json_text_key: str | None = flag(
        None,
        "WebDataset: read the caption from these ';'-separated fields of the sample's .json member instead, the "
        "first non-empty one (OpenCLIP main's flag).",
        DATA,
    )
    json_text_key_probs: list[float] | None = flag(
        None,
        "With --json-text-key: weights by which each sample draws the order of the fields tried (missing or 0: "
        "fallbacks); seeded per sample, so a resumed run draws alike (OpenCLIP main's flag).",
        DATA,
        applies=Applies(lambda c: c.json_text_key is not None, "with --json-text-key"),
        nargs="+",
        type=float,
    )
    train_data_upsampling_factors: str | None = flag(
        None, "Per-source sampling weights a::b for the '::' sources of --train-data (with --dataset-resampled).", DATA
    )
    workers: int = flag(
        default_workers(),
        f"Data loader workers per process (OpenCLIP's default {OPENCLIP_WORKERS}, or the CPUs this process may use "
        f"when fewer: more workers than CPUs only contend).",
        DATA,
        check=non_negative_int,
    )
    image_mean: list[float] | None = flag(None, "Override the image normalisation mean.", DATA, nargs="+", type=float)
    image_std: list[float] | None = flag(None, "Override the image normalisation std.", DATA, nargs="+", type=float)
    image_interpolation: str | None = flag(None, "bicubic, bilinear or random.", DATA, choices=INTERPOLATIONS)
    image_resize_mode: str | None = flag(None, "shortest, longest or squash.", DATA, choices=RESIZE_MODES)
    image_decode: str = flag(
        "auto",
        "auto: reduced, or on a GPU with few loading cores for the images' size, device for the JPEGs large enough "
        "(each image by its header's size; new in bigclip); "
        "reduced: JPEGs decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still covers the crop at the output "
        "size, the crop drawn as OpenCLIP draws it (new in bigclip; resampling differs slightly); full: every pixel, "
        "as OpenCLIP; device: the loader workers ship JPEGs undecoded (with their crops) and the batch is decoded on "
        "the training device (nvJPEG through torchvision on a GPU; other formats decoded as reduced).",
        DATA,
        choices=DECODE_MODES,
    )
    aug_cfg: list[str] | dict[str, Any] = flag(
        [], "Augmentation key=value pairs, e.g. scale=0.9::1.0.", DATA, nargs="*"
    )
    imagenet_val: str | None = flag(
        None, "ImageNet validation folder (one folder per class) for zero-shot classification.", EVAL
    )
    imagenet_v2: str | None = flag(None, "ImageNet-v2 folder (class folders 0 ... 999) for zero-shot.", EVAL)
    # read here, owned by another slice (its flag is declared there)
    batch_size: int = 64
    seed: int = 0
    storage_options: str | dict[str, Any] | None = None
    demo: bool = False  # the embedded digits demo (no data flags)

    def split_value(self, train: bool) -> tuple[str | None, str]:
        """(--train-data or --val-data value, the flag's name)."""
        return (self.train_data, "--train-data") if train else (self.val_data, "--val-data")

    def options(self) -> dict[str, Any]:
        """fsspec options for data URLs (--storage-options)."""
        return parse_storage_options(self.storage_options)

    def sample_keys(self) -> SampleKeys:
        """Where a WebDataset sample's image and caption are (--image-key, --text-key, --json-text-key...)."""
        return SampleKeys.from_flags(
            self.image_key, self.text_key, self.json_text_key, self.json_text_key_probs, self.seed
        )
