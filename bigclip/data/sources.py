"""Data source kinds (--dataset-type): the registry, and what every kind's loader is built from.

A kind is registered in DATA_SOURCES by its own module (synthetic.py, csv_dataset.py, wds_source.py) with the
function that builds its loader for one split, the file extensions --dataset-type auto recognises it by and the
data flags it reads that not every kind does (`flags`: --csv-separator is csv's); data/factory.py imports
those modules. To add a kind: a module that registers itself, and its import in factory.py.

A kind's flag given to a run whose data is of other kinds would do nothing: check_source_flags refuses it in one
line, as engines refuse each other's flags. The embedded demo and the ImageNet zero-shot sets are data the run
reads besides the registered kinds, with the flags they read (DEMO_FLAGS, ZEROSHOT_FLAGS).
"""

from __future__ import annotations

import dataclasses
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
from bigclip.flag_fields import idle

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
    # variable-length text (text_cfg variable_text): each batch's captions cut to its longest, padding id this
    text_pad_id: int | None = None


@dataclass(frozen=True)
class DataSource:
    build: Callable[[DataConfig, Split, LoaderContext], DataInfo]
    extensions: tuple[str, ...] = ()  # what --dataset-type auto recognises it by ('.tar')
    needs_path: bool = True  # reads --train-data / --val-data
    check: Callable[[DataConfig], None] = lambda cfg: None  # its own flags' rules
    flags: tuple[str, ...] = ()  # the data flags it reads that some other kind does not (see check_source_flags)


# The flags of the image transforms (build.py's preprocess): read by the kinds that decode images
IMAGE_FLAGS = ("image_mean", "image_std", "image_interpolation", "image_resize_mode", "image_decode", "aug_cfg")
# What the embedded demo (no data flags) and the ImageNet zero-shot sets (--imagenet-val/-v2, evaluation transform:
# no augmentation) read of the data flags
DEMO, ZEROSHOT = "the embedded demo (no --train-data)", "the ImageNet zero-shot sets"
DEMO_FLAGS = ("image_mean", "image_std")
ZEROSHOT_FLAGS = ("workers", *(f for f in IMAGE_FLAGS if f != "aug_cfg"))
# Flags read for one split only (the others: for every split of their kind)
TRAIN_ONLY = ("train_num_samples", "aug_cfg", "dataset_resampled", "train_data_upsampling_factors")
VAL_ONLY = ("val_num_samples",)


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


def _kind_of(path: str | None, dataset_type: str) -> str | None:
    """The registered kind a split's data value is read as; None where auto cannot tell (the build says why)."""
    if dataset_type != AUTO:
        return dataset_type
    kinds = {_kind_by_extension(names) for names in sources(path)} if path else {None}
    return kinds.pop() if len(kinds) == 1 else None


def data_in_use(cfg: DataConfig) -> dict[str, list[str]]:
    """What this run reads, by split: 'train' and 'val' -> the kinds (registered names, or DEMO), 'eval' ->
    [ZEROSHOT] when ImageNet sets are named. An unknown kind (auto on an extension it cannot tell) is None."""
    generated = reads_without_path(cfg.dataset_type)
    if cfg.demo:
        splits = {"train": [DEMO], "val": [DEMO]}
    else:
        train = _kind_of(cfg.train_data, cfg.dataset_type) if cfg.train_data or generated else None
        has_val = cfg.val_data or (generated and cfg.val_num_samples)
        splits = {"train": [train], "val": [_kind_of(cfg.val_data, cfg.dataset_type)] if has_val else []}
    splits["eval"] = [ZEROSHOT] if (cfg.imagenet_val or cfg.imagenet_v2) else []
    return splits


def _either(words: list[str]) -> str:
    return " or ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} or {words[-1]}"


def _reads(kind: str | None, name: str) -> bool:
    if kind is None:
        return True  # an unknown kind stops the run where its loader is built
    if kind == DEMO:
        return name in DEMO_FLAGS
    if kind == ZEROSHOT:
        return name in ZEROSHOT_FLAGS
    return name in DATA_SOURCES.get(kind).flags


def _kinds_for(name: str, in_use: dict[str, list[str]]) -> list[str]:
    """The kinds of this run's data that flag `name` could apply to (its splits' kinds)."""
    splits = ["train"] if name in TRAIN_ONLY else ["val"] if name in VAL_ONLY else ["train", "val", "eval"]
    return list(dict.fromkeys(kind for split in splits for kind in in_use[split]))


def read_here(cfg: DataConfig, name: str) -> bool:
    """Whether some data of this run reads flag `name` (where none does, check_source_flags has said it is idle,
    and its value's own rules, which the reader would apply, are moot)."""
    return any(_reads(kind, name) for kind in _kinds_for(name, data_in_use(cfg)))


def check_source_flags(cfg: DataConfig) -> None:
    """A data flag that some kind reads, set where no data of this run is read with it, is idle (flag_fields.idle:
    OpenCLIP's warn, bigclip's are refused, in one line naming it and the data it applies to); so are
    --train-data / --val-data where the data is generated. --val-data where the demo runs is refused: without
    --train-data bigclip trains its embedded demo, where OpenCLIP would evaluate --val-data alone."""
    generated = reads_without_path(cfg.dataset_type)
    for name, value in (("train_data", cfg.train_data), ("val_data", cfg.val_data)):
        if value and generated:
            idle(name, f"--dataset-type {cfg.dataset_type} makes its own data and reads no files", "drop one of them")
    if cfg.demo and cfg.val_data:
        raise UserError("--val-data: needs --train-data (without it the embedded demo runs, with its own validation)")
    in_use = data_in_use(cfg)
    claimed = {name for _, source in DATA_SOURCES.items() for name in source.flags}
    defaults = {f.name: f for f in dataclasses.fields(DataConfig)}
    for name in sorted(claimed | set(DEMO_FLAGS) | set(ZEROSHOT_FLAGS)):
        field = defaults[name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if getattr(cfg, name) == default:
            continue
        kinds = _kinds_for(name, in_use)
        if any(_reads(kind, name) for kind in kinds):
            continue
        role = " training" if name in TRAIN_ONLY else " validation" if name in VAL_ONLY else ""
        kinds_reading = [kind for kind, source in DATA_SOURCES.items() if name in source.flags]
        readers = [f"{_either(kinds_reading)}{role} data"] if kinds_reading else []
        readers += [who for who, reads in ((DEMO, DEMO_FLAGS), (ZEROSHOT, ZEROSHOT_FLAGS)) if name in reads]
        here = f"this run's{role} data is {' and '.join(kinds)}" if kinds else f"this run has no{role} data"
        idle(name, f"only applies to {_either(readers)}; {here}")


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
    collate = partial(collate_samples, skips_key=skips.key if skips is not None else None, text_pad_id=ctx.text_pad_id)
    loader = worker_loader(dataset, workers, batch_sampler=sampler, collate_fn=collate)
    info = DataInfo(loader, num_samples=len(dataset), num_batches=sampler.num_batches, sampler=sampler, skips=skips)
    if info.num_batches == 0:
        raise UserError(
            f"{flag}: {info.num_samples} samples make no full batch of --batch-size {cfg.batch_size} "
            f"on {ctx.world_size} process(es); lower --batch-size or add data"
        )
    return info
