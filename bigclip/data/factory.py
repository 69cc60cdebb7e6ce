"""get_data: the training loop's one entry point into the data package.

The source kinds register themselves in DATA_SOURCES when their modules are imported, here.
"""

from __future__ import annotations

from typing import Any

from bigclip.data import csv_dataset, synthetic, wds_source  # noqa: F401  (each registers its kind)
from bigclip.data.config import DataConfig
from bigclip.data.digits import build_digits
from bigclip.data.imagenet import build_zeroshot_sets
from bigclip.data.info import DataInfo
from bigclip.data.sources import (
    DATA_SOURCES,
    LoaderContext,
    Split,
    image_size,
    reads_without_path,
    resolve_dataset_type,
)

# OpenAI CLIP's normalisation, used when neither the flags nor the model give one.
DEFAULT_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_STD = (0.26862954, 0.26130258, 0.27577711)


def _split(cfg: DataConfig, train: bool, transform) -> Split:
    path, flag = cfg.split_value(train)
    return Split(train, path, flag, cfg.train_num_samples if train else cfg.val_num_samples, transform)


def build_split(cfg: DataConfig, split: Split, ctx: LoaderContext) -> DataInfo:
    kind = resolve_dataset_type(split.path, cfg.dataset_type, split.flag)
    return DATA_SOURCES.get(kind).build(cfg, split, ctx)


def _demo(cfg: DataConfig, ctx: LoaderContext) -> dict[str, Any]:
    pre = ctx.geometry or {}
    mean = tuple(cfg.image_mean) if cfg.image_mean else tuple(pre.get("mean") or DEFAULT_MEAN)
    std = tuple(cfg.image_std) if cfg.image_std else tuple(pre.get("std") or DEFAULT_STD)
    mean, std = (mean * 3 if len(mean) == 1 else mean), (std * 3 if len(std) == 1 else std)
    return build_digits(ctx.tokenizer, image_size(ctx), mean, std, cfg.batch_size, cfg.seed, ctx.rank, ctx.world_size)


def get_data(
    cfg: DataConfig,
    preprocess_train,
    preprocess_val,
    tokenizer,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    preprocess_cfg: dict | None = None,
    text_pad_id: int | None = None,
) -> dict[str, Any]:
    """Loaders named 'train' and 'val' (DataInfo) as the config asks, and one per ImageNet zero-shot set
    (--imagenet-val, --imagenet-v2; keyed by their metric prefix, yielding (images, class index)); for the
    embedded demo (cfg.demo) also 'zeroshot', 'classnames' and 'templates'.

    `preprocess_cfg` = {'size': (H, W), 'mean': ..., 'std': ...}: the model's image geometry, used
    where images are made as tensors (synthetic data, the demo) rather than by the preprocess callables.
    `text_pad_id`: the architecture's text is variable-length (text_cfg variable_text): each training and
    validation batch's captions are cut to its longest, this being the padding id.
    """
    ctx = LoaderContext(tokenizer, rank, world_size, preprocess_cfg or {}, preprocess_val, text_pad_id)
    if cfg.demo:
        data = _demo(cfg, ctx)
    else:
        data = {}
        generated = reads_without_path(cfg.dataset_type)
        if cfg.train_data or generated:
            data["train"] = build_split(cfg, _split(cfg, True, preprocess_train), ctx)
        if cfg.val_data or (generated and cfg.val_num_samples):
            data["val"] = build_split(cfg, _split(cfg, False, preprocess_val), ctx)
    data.update(build_zeroshot_sets(cfg, preprocess_val, rank, world_size))
    for info in data.values():
        if isinstance(info, DataInfo):
            info.set_epoch(epoch)
    return data
