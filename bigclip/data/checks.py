"""The data flags' rules, checked before any work (the source kind's own rules are in data/sources.py)."""

from __future__ import annotations

import os

from bigclip.data.aug_cfg import validate_aug_cfg
from bigclip.data.config import DataConfig, sources
from bigclip.data.imagenet import class_folders
from bigclip.data.sources import check_source_flags, read_here
from bigclip.data.transforms import check_image_decode
from bigclip.data.wds_plan import parse_upsampling_factors
from bigclip.errors import UserError


def _is_url(path: str) -> bool:
    return "://" in path or path.startswith("pipe:")  # pipe: a command whose output is the shard


def check_data(cfg: DataConfig) -> None:
    """The data flags' rules, before any work: local paths exist, augmentation settings and upsampling factors
    are well formed, ImageNet folders hold 1000 classes. The source kind's own rules (data/sources.py) come
    with --dataset-type; the choices of --image-interpolation / --image-resize-mode are declared with the
    flags (data/transforms.py owns them). A flag of a kind of data this run does not read is idle (sources.py)."""
    check_source_flags(cfg)
    for name in ("image_mean", "image_std"):
        value = getattr(cfg, name)
        if value is not None and len(value) not in (1, 3):
            raise UserError(f"--{name.replace('_', '-')} {value!r}: give one value or three (R G B)")
    check_image_decode(cfg.image_decode, validate_aug_cfg(cfg.aug_cfg))
    cfg.sample_keys()  # --image-key, --text-key, --json-text-key(-probs) well formed
    # OpenCLIP's rules (its WebDataset reader asserts them), before any shard is listed
    if cfg.train_data_upsampling_factors is not None and read_here(cfg, "train_data_upsampling_factors"):
        parse_upsampling_factors(
            cfg.train_data_upsampling_factors, sources(cfg.train_data or ""), cfg.dataset_resampled
        )
    for train in (True, False):
        value, flag = cfg.split_value(train)
        for path in (p for source in sources(value) for p in source) if value else ():
            if not _is_url(path) and not os.path.exists(path):
                raise UserError(f"{flag} {value!r}: '{path}' does not exist; check the path")
    for name in ("imagenet_val", "imagenet_v2"):
        if getattr(cfg, name):
            class_folders(getattr(cfg, name), name)  # 1000 class folders, before any work
