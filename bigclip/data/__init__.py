"""Data: synthetic, CSV and WebDataset loaders, image transforms, and the embedded digits demo.

from bigclip.data import get_data, DataConfig, DataInfo
data = get_data(DataConfig(...), preprocess_train, preprocess_val, tokenizer, rank, world_size, epoch,
                preprocess_cfg={"size": (H, W), "mean": ..., "std": ...})
"""

from bigclip.data.aug_cfg import parse_aug_cfg, validate_aug_cfg
from bigclip.data.checks import check_data
from bigclip.data.config import DataConfig
from bigclip.data.digits import DIGIT_CLASSNAMES, DIGIT_TEMPLATES
from bigclip.data.factory import get_data
from bigclip.data.info import DataInfo
from bigclip.data.skips import SKIP_REASONS
from bigclip.data.sources import (
    DATA_SOURCES,
    check_dataset_type,
    check_source,
    dataset_type_names,
    reads_without_path,
    resolve_dataset_type,
)
from bigclip.data.transforms import image_transform

__all__ = [
    "DATA_SOURCES",
    "DataConfig",
    "check_data",
    "check_source",
    "dataset_type_names",
    "reads_without_path",
    "DIGIT_CLASSNAMES",
    "DIGIT_TEMPLATES",
    "DataInfo",
    "SKIP_REASONS",
    "get_data",
    "image_transform",
    "parse_aug_cfg",
    "resolve_dataset_type",
    "check_dataset_type",
    "validate_aug_cfg",
]
