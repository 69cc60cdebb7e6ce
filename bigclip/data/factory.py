"""get_data: the training loop's one entry point into the data package."""

from __future__ import annotations

import functools
from typing import Any

import braceexpand
from PIL import Image

from bigclip.data.csv_dataset import CsvDataset
from bigclip.data.digits import build_digits
from bigclip.data.imagenet import build_zeroshot_sets
from bigclip.data.info import DataInfo
from bigclip.data.sampler import ShardedBatchSampler
from bigclip.data.shards import expand_shard_urls, iter_shard_samples
from bigclip.data.skips import SkipCounter
from bigclip.data.synthetic import SyntheticDataset
from bigclip.data.wds_plan import ShardPlan, batches_per_worker, parse_upsampling_factors
from bigclip.data.wds_stream import ShardStream
from bigclip.data.workers import worker_loader
from bigclip.errors import UserError
from bigclip.storage_options import parse_storage_options

DATASET_TYPES = ("auto", "csv", "webdataset", "synthetic")
SYNTHETIC_DEFAULT_SAMPLES = 1000
# OpenAI CLIP's normalisation, used when neither the flags nor the model give one.
DEFAULT_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_STD = (0.26862954, 0.26130258, 0.27577711)


def _kind_by_extension(path: str) -> str | None:
    names = list(braceexpand.braceexpand(path))
    for kind, extensions in (("csv", (".csv", ".tsv")), ("webdataset", (".tar",))):
        if all(n.lower().endswith(extensions) for n in names):
            return kind
    return None


def check_dataset_type(dataset_type: str) -> None:
    if dataset_type not in DATASET_TYPES:
        raise UserError(f"--dataset-type {dataset_type!r}: choose one of {', '.join(DATASET_TYPES)}")


def resolve_dataset_type(path: str | None, dataset_type: str, flag: str) -> str:
    """The concrete type for `path`: --dataset-type itself, or for 'auto' the one its extension names."""
    check_dataset_type(dataset_type)
    if dataset_type != "auto":
        return dataset_type
    if not path:
        raise UserError(f"{flag} is missing: give a .csv/.tsv file or .tar shards, or --dataset-type synthetic")
    kinds = {_kind_by_extension(source) for source in path.split("::")}
    if len(kinds) != 1 or None in kinds:
        raise UserError(
            f"{flag} {path}: cannot tell the data format from the file extension "
            f"(.csv/.tsv or .tar expected); pass --dataset-type csv or --dataset-type webdataset"
        )
    return kinds.pop()


def _image_size(preprocess_cfg: dict, transform) -> tuple[int, int]:
    size = preprocess_cfg.get("size")
    if size is None and transform is not None:
        return tuple(transform(Image.new("RGB", (32, 32))).shape[-2:])
    if size is None:
        return 224, 224
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def _map_style_loader(dataset, sampler: ShardedBatchSampler, workers: int, skips: SkipCounter | None) -> DataInfo:
    loader = worker_loader(dataset, workers, batch_sampler=sampler)
    return DataInfo(loader, num_samples=len(dataset), num_batches=sampler.num_batches, sampler=sampler, skips=skips)


def _check_batches(info: DataInfo, flag: str, batch_size: int, world_size: int) -> DataInfo:
    if info.num_batches == 0:
        raise UserError(
            f"{flag}: {info.num_samples} samples make no full batch of --batch-size {batch_size} "
            f"on {world_size} process(es); lower --batch-size or add data"
        )
    return info


class _Builder:
    def __init__(self, cfg, preprocess_train, preprocess_val, tokenizer, rank, world_size, preprocess_cfg):
        self.cfg = cfg
        self.transforms = {True: preprocess_train, False: preprocess_val}
        self.tokenizer = tokenizer
        self.rank, self.world_size = rank, world_size
        self.preprocess_cfg = preprocess_cfg

    def build(self, train: bool) -> DataInfo:
        cfg = self.cfg
        flag = "--train-data" if train else "--val-data"
        path = cfg.train_data if train else cfg.val_data
        kind = resolve_dataset_type(path, cfg.dataset_type, flag)
        if kind == "synthetic":
            return self.synthetic(train)
        if kind == "csv":
            return self.csv(path, flag, train)
        return self.webdataset(path, flag, train)

    def _sampler(self, num_samples: int, train: bool) -> ShardedBatchSampler:
        cfg = self.cfg
        return ShardedBatchSampler(num_samples, cfg.batch_size, self.rank, self.world_size, cfg.seed, train=train)

    def synthetic(self, train: bool) -> DataInfo:
        cfg = self.cfg
        num_samples = (cfg.train_num_samples if train else cfg.val_num_samples) or SYNTHETIC_DEFAULT_SAMPLES
        size = _image_size(self.preprocess_cfg, self.transforms[False])
        dataset = SyntheticDataset(num_samples, size, self.tokenizer, seed=cfg.seed, stream=0 if train else 1)
        info = _map_style_loader(dataset, self._sampler(num_samples, train), cfg.workers, skips=None)
        return _check_batches(
            info, "--train-num-samples" if train else "--val-num-samples", cfg.batch_size, self.world_size
        )

    def csv(self, path: str, flag: str, train: bool) -> DataInfo:
        cfg = self.cfg
        if "::" in path:
            raise UserError(f"{flag} {path}: CSV data is one file; join sources with :: only for .tar shards")
        skips = SkipCounter("train" if train else "val")
        dataset = CsvDataset(
            path,
            self.transforms[train],
            self.tokenizer,
            skips,
            flag=flag,
            separator=cfg.csv_separator,
            img_key=cfg.csv_img_key,
            caption_key=cfg.csv_caption_key,
        )
        info = _map_style_loader(dataset, self._sampler(len(dataset), train), cfg.workers, skips)
        return _check_batches(info, f"{flag} {path}", cfg.batch_size, self.world_size)

    def webdataset(self, path: str, flag: str, train: bool) -> DataInfo:
        cfg = self.cfg
        options = parse_storage_options(cfg.storage_options)
        sources = expand_shard_urls(path, flag, options)
        num_samples = cfg.train_num_samples if train else cfg.val_num_samples
        if train and not num_samples:
            raise UserError(f"{flag} {path}: WebDataset training needs --train-num-samples (samples per epoch)")
        resampled = train and cfg.dataset_resampled
        factors = parse_upsampling_factors(cfg.train_data_upsampling_factors, sources, resampled) if train else None
        plan = ShardPlan.build(sources, factors, resampled, cfg.seed)
        workers = max(1, cfg.workers)
        per_worker = None
        if train:
            plan.check_slots(self.world_size * workers, f"{flag} {path}")
            per_worker = batches_per_worker(num_samples, cfg.batch_size, self.world_size, cfg.workers)
            num_batches = per_worker * workers
            num_samples = num_batches * cfg.batch_size * self.world_size
        else:
            # Unknown without --val-num-samples; with it, an estimate (ranks may differ by a batch).
            num_batches = -(-num_samples // (cfg.batch_size * self.world_size)) if num_samples else None
        skips = SkipCounter("train" if train else "val")
        stream = ShardStream(
            plan,
            functools.partial(iter_shard_samples, storage_options=options),
            self.transforms[train],
            self.tokenizer,
            skips,
            batch_size=cfg.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            workers=cfg.workers,
            train=train,
            batches_per_worker=per_worker,
            num_batches=None if train else num_batches,
            source=f"{flag} {path}",
        )
        loader = worker_loader(stream, cfg.workers, batch_size=None, stateful=train)
        return DataInfo(
            loader,
            num_samples=num_samples or 0,
            num_batches=num_batches or 0,
            sampler=stream,
            skips=skips,
            resumable=train,
            ends_early=train and not resampled,
        )

    def demo(self) -> dict[str, Any]:
        cfg, pre = self.cfg, self.preprocess_cfg
        mean = tuple(cfg.image_mean) if cfg.image_mean else tuple(pre.get("mean") or DEFAULT_MEAN)
        std = tuple(cfg.image_std) if cfg.image_std else tuple(pre.get("std") or DEFAULT_STD)
        mean, std = (mean * 3 if len(mean) == 1 else mean), (std * 3 if len(std) == 1 else std)
        size = _image_size(pre, None if pre.get("size") else self.transforms[False])
        return build_digits(self.tokenizer, size, mean, std, cfg.batch_size, cfg.seed, self.rank, self.world_size)


def get_data(
    cfg,
    preprocess_train,
    preprocess_val,
    tokenizer,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    preprocess_cfg: dict | None = None,
) -> dict[str, Any]:
    """Loaders named 'train' and 'val' (DataInfo) as the config asks, and one per ImageNet zero-shot set
    (--imagenet-val, --imagenet-v2; keyed by their metric prefix, yielding (images, class index)); for the
    embedded demo (cfg.demo) also 'zeroshot', 'classnames' and 'templates'.

    `preprocess_cfg` = {'size': (H, W), 'mean': ..., 'std': ...}: the model's image geometry, used
    where images are made as tensors (synthetic data, the demo) rather than by the preprocess callables.
    """
    builder = _Builder(cfg, preprocess_train, preprocess_val, tokenizer, rank, world_size, preprocess_cfg or {})
    if cfg.demo:
        data = builder.demo()
    else:
        data = {}
        synthetic = cfg.dataset_type == "synthetic"
        if cfg.train_data or synthetic:
            data["train"] = builder.build(train=True)
        if cfg.val_data or (synthetic and cfg.val_num_samples):
            data["val"] = builder.build(train=False)
    data.update(build_zeroshot_sets(cfg, preprocess_val, rank, world_size))
    for info in data.values():
        if isinstance(info, DataInfo):
            info.set_epoch(epoch)
    return data
