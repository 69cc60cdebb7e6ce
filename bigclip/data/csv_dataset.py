"""Image-text pairs listed in a CSV/TSV file: one row per sample, an image path column and a caption column.

Image paths are read relative to the current directory (OpenCLIP's behaviour); a relative path that
is not found there is also tried relative to the CSV file's folder.
"""

from __future__ import annotations

import csv
import os

from bigclip.data.config import DataConfig
from bigclip.data.decode import ImageTooLarge, decode_rgb
from bigclip.data.info import DataInfo
from bigclip.data.map_style import ReplacingDataset, SampleSkipped
from bigclip.data.skips import SkipCounter
from bigclip.data.sources import (
    DATA_SOURCES,
    IMAGE_FLAGS,
    DataSource,
    LoaderContext,
    Split,
    batch_sampler,
    map_style_loader,
)
from bigclip.errors import UserError


def _separator(sep: str) -> str:
    if sep in ("\\t", "tab"):  # typed on a shell as a literal backslash-t
        return "\t"
    if len(sep) != 1:
        raise UserError(f"--csv-separator {sep!r}: give a single character, e.g. ',' or a tab")
    return sep


def read_pairs(
    path: str, flag: str, separator: str, img_key: str, caption_key: str
) -> tuple[list[str], list[str | None]]:
    """(image paths, captions) from the file; missing captions are None (skipped when read)."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: file not found; pass an existing CSV file")
    sep = _separator(separator)
    try:
        images, captions = _read_rows(path, flag, sep, img_key, caption_key)
    except UnicodeDecodeError as e:
        raise UserError(
            f"{flag} {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); save the file as UTF-8"
        ) from None
    if not images:
        raise UserError(f"{flag} {path}: the file has no rows; add image,caption rows")
    return images, captions


def _read_rows(path: str, flag: str, sep: str, img_key: str, caption_key: str) -> tuple[list[str], list[str | None]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=sep)
        columns = reader.fieldnames or []
        for key, key_flag in ((img_key, "--csv-img-key"), (caption_key, "--csv-caption-key")):
            if key not in columns:
                raise UserError(
                    f"{key_flag} {key}: no such column in {flag} {path} (columns: {columns}); "
                    f"set {key_flag} or --csv-separator"
                )
        images, captions = [], []
        for row in reader:
            images.append(row[img_key] or "")
            captions.append(row[caption_key])
    return images, captions


class CsvDataset(ReplacingDataset):
    def __init__(
        self,
        path: str,
        transform,
        tokenizer,
        skips: SkipCounter,
        *,
        flag: str = "--train-data",
        separator: str = "\t",
        img_key: str = "filepath",
        caption_key: str = "title",
        max_pixels: int | None = None,
    ):
        super().__init__(skips)
        self.source = f"{flag} {path}"
        self.folder = os.path.dirname(os.path.abspath(path))
        self.images, self.captions = read_pairs(path, flag, separator, img_key, caption_key)
        self.transform = transform
        self.tokenizer = tokenizer
        self.max_pixels = max_pixels  # --max-image-pixels

    def __len__(self) -> int:
        return len(self.images)

    def _image_path(self, index: int) -> str:
        path = self.images[index]
        if path and not os.path.isabs(path) and not os.path.exists(path):
            beside_csv = os.path.join(self.folder, path)
            if os.path.exists(beside_csv):
                return beside_csv
        return path

    def load(self, index: int):
        caption = self.captions[index]
        if caption is None or not caption.strip():
            raise SampleSkipped("missing_caption", f"row {index + 1} of {self.source}")
        path = self._image_path(index)
        if not path or not os.path.isfile(path):
            raise SampleSkipped("missing_image", f"{path!r} (row {index + 1} of {self.source})")
        try:
            image = decode_rgb(path, self.transform, self.max_pixels)
        except ImageTooLarge as e:
            raise SampleSkipped("too_large", f"{path}: {e}") from None
        except Exception as e:  # any decoder or transform failure: this sample is unusable, not the run
            raise SampleSkipped("bad_image", f"{path}: {e}") from None
        return image, self.tokenizer([caption])[0]


def build_csv(cfg: DataConfig, split: Split, ctx: LoaderContext) -> DataInfo:
    if "::" in split.path:
        raise UserError(f"{split.flag} {split.path}: CSV data is one file; join sources with :: only for .tar shards")
    skips = SkipCounter(split.role)
    dataset = CsvDataset(
        split.path,
        split.transform,
        ctx.tokenizer,
        skips,
        flag=split.flag,
        separator=cfg.csv_separator,
        img_key=cfg.csv_img_key,
        caption_key=cfg.csv_caption_key,
        max_pixels=cfg.max_image_pixels,
    )
    sampler = batch_sampler(cfg, len(dataset), split.train, ctx)
    return map_style_loader(dataset, sampler, cfg.workers, skips, f"{split.flag} {split.path}", cfg, ctx)


DATA_SOURCES.register(
    "csv",
    DataSource(
        build_csv,
        extensions=(".csv", ".tsv"),
        flags=("csv_separator", "csv_img_key", "csv_caption_key", "max_image_pixels", "workers", *IMAGE_FLAGS),
    ),
    help="a CSV/TSV file of image paths and captions (--csv-img-key, --csv-caption-key)",
)
