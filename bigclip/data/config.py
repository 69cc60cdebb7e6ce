"""DataConfig: the slice of the flags the data package reads, and the one parser of --train-data / --val-data.

A data value names one or more sources joined by '::' (OpenCLIP's syntax), each a path or URL with brace
patterns (shards-{0000..0099}.tar). `sources()` is the only place that syntax is read: validation, the format
detection of --dataset-type auto, the upsampling factors and the shard lists all start from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import webdataset as wds

from bigclip.storage_options import parse_storage_options


def sources(value: str) -> list[list[str]]:
    """The paths or URLs of every '::'-separated source of a data value: WebDataset's own expansion (brace
    patterns, WDS_ environment variables) of each."""
    return [wds.shardlists.expand_urls(source) for source in value.split("::")]


@dataclass(frozen=True)
class DataConfig:
    """The data flags (OpenCLIP's names), and the run's values the loaders are cut by."""

    train_data: str | None = None
    val_data: str | None = None
    train_num_samples: int | None = None
    val_num_samples: int | None = None
    dataset_type: str = "auto"
    dataset_resampled: bool = False
    csv_separator: str = "\t"
    csv_img_key: str = "filepath"
    csv_caption_key: str = "title"
    train_data_upsampling_factors: str | None = None
    workers: int = 4
    image_mean: list[float] | None = None
    image_std: list[float] | None = None
    image_interpolation: str | None = None
    image_resize_mode: str | None = None
    aug_cfg: list[str] | dict[str, Any] = field(default_factory=list)
    imagenet_val: str | None = None
    imagenet_v2: str | None = None
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
