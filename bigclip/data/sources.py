"""Data source kinds (--dataset-type): the registry, and what every kind's loader is built from.

A kind is registered in DATA_SOURCES by its own module (synthetic.py, csv_dataset.py, wds_source.py) with the
function that builds its loader for one split and the file extensions --dataset-type auto recognises it by;
data/factory.py imports those modules. To add a kind: a module that registers itself, and its import in
factory.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from PIL import Image

from bigclip.data.config import DATA_SOURCES, DataConfig, sources
from bigclip.data.device_decode import collate_samples
from bigclip.data.info import DataInfo
from bigclip.data.sampler import ShardedBatchSampler
from bigclip.data.skips import SkipCounter
from bigclip.data.workers import worker_loader
from bigclip.errors import UserError

AUTO = "auto"  # --dataset-type auto: the kind the data value's extension names


@dataclass(frozen=True)
class Split:
    """One loader to build: training or validation, what the user named it with, and its transform."""

    train: bool
    path: str | None  # the --train-data / --val-data value
    flag: str  # "--train-data" / "--val-data"
    num_samples: int | None  # --train-num-samples / --val-num-samples
    transform: Callable | None  # PIL image -> tensor

    @property
    def role(self) -> str:
        return "train" if self.train else "val"


@dataclass(frozen=True)
class LoaderContext:
    """What every loader is built with besides the data flags."""

    tokenizer: Callable
    rank: int = 0
    world_size: int = 1
    geometry: dict[str, Any] | None = None  # the model's {'size': (H, W), 'mean', 'std'}
    eval_transform: Callable | None = None  # measures the image size when the geometry has none


@dataclass(frozen=True)
class DataSource:
    build: Callable[[DataConfig, Split, LoaderContext], DataInfo]
    extensions: tuple[str, ...] = ()  # what --dataset-type auto recognises it by ('.tar')
    needs_path: bool = True  # reads --train-data / --val-data
    check: Callable[[DataConfig], None] = lambda cfg: None  # its own flags' rules


def dataset_type_names() -> list[str]:
    return [AUTO, *DATA_SOURCES.names()]


def reads_without_path(dataset_type: str) -> bool:
    """Whether --dataset-type names a kind that makes its data without --train-data (synthetic)."""
    return dataset_type in DATA_SOURCES and not DATA_SOURCES.get(dataset_type).needs_path


def check_dataset_type(dataset_type: str) -> None:
    if "audio" in dataset_type:  # OpenCLIP main's synthetic-audio (CLAP)
        raise UserError(
            f"--dataset-type {dataset_type}: audio towers (CLAP) are not supported: bigclip trains image-text "
            f"models; choose one of {', '.join(dataset_type_names())}"
        )
    if dataset_type != AUTO and dataset_type not in DATA_SOURCES:
        raise UserError(f"--dataset-type {dataset_type!r}: choose one of {', '.join(dataset_type_names())}")


def _kind_by_extension(names: list[str]) -> str | None:
    for kind, source in DATA_SOURCES.items():
        if source.extensions and all(n.lower().endswith(source.extensions) for n in names):
            return kind
    return None


def resolve_dataset_type(path: str | None, dataset_type: str, flag: str) -> str:
    """The concrete kind for `path`: --dataset-type itself, or for 'auto' the one its extension names."""
    check_dataset_type(dataset_type)
    if dataset_type != AUTO:
        return dataset_type
    if not path:
        raise UserError(f"{flag} is missing: give a .csv/.tsv file or .tar shards, or --dataset-type synthetic")
    kinds = {_kind_by_extension(names) for names in sources(path)}
    if len(kinds) != 1 or None in kinds:
        raise UserError(
            f"{flag} {path}: cannot tell the data format from the file extension "
            f"(.csv/.tsv or .tar expected); pass --dataset-type csv or --dataset-type webdataset"
        )
    return kinds.pop()


def check_source(cfg: DataConfig) -> None:
    """--dataset-type's rules: a registered kind that gets the path it needs, and that kind's own rules."""
    check_dataset_type(cfg.dataset_type)
    if cfg.dataset_type == AUTO:
        for source in {_kind_by_extension(names) for names in sources(cfg.train_data or "")} - {None}:
            DATA_SOURCES.get(source).check(cfg)
        return
    source = DATA_SOURCES.get(cfg.dataset_type)
    if source.needs_path and cfg.train_data is None:
        raise UserError(f"--dataset-type {cfg.dataset_type!r}: needs --train-data")
    source.check(cfg)


# -- helpers the kinds share
def image_size(ctx: LoaderContext) -> tuple[int, int]:
    """The model's image size: from its geometry, else measured off the evaluation transform."""
    size = (ctx.geometry or {}).get("size")
    if size is None and ctx.eval_transform is not None:
        return tuple(ctx.eval_transform(Image.new("RGB", (32, 32))).shape[-2:])
    if size is None:
        return 224, 224
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def batch_sampler(cfg: DataConfig, num_samples: int, train: bool, ctx: LoaderContext) -> ShardedBatchSampler:
    return ShardedBatchSampler(num_samples, cfg.batch_size, ctx.rank, ctx.world_size, cfg.seed, train=train)


def map_style_loader(
    dataset, sampler: ShardedBatchSampler, workers: int, skips: SkipCounter | None, flag: str, cfg: DataConfig, ctx
) -> DataInfo:
    """A map-style dataset's loader; `flag` names what to change when it makes no full batch."""
    collate = partial(collate_samples, skips_key=skips.key if skips is not None else None)
    loader = worker_loader(dataset, workers, batch_sampler=sampler, collate_fn=collate)
    info = DataInfo(loader, num_samples=len(dataset), num_batches=sampler.num_batches, sampler=sampler, skips=skips)
    if info.num_batches == 0:
        raise UserError(
            f"{flag}: {info.num_samples} samples make no full batch of --batch-size {cfg.batch_size} "
            f"on {ctx.world_size} process(es); lower --batch-size or add data"
        )
    return info
