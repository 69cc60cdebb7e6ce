"""--image-decode device: JPEGs decoded on the training device (nvJPEG, through torchvision), a batch at a time.

A loader worker reads each image's header only (data/decode.py). For a JPEG it then draws the random crop
exactly as the CPU transform would (torchvision's RandomResizedCrop.get_params draws on the full image's size: the
same random numbers, so the same crops and the same generator state after each sample) and ships the file's bytes
with the crop box instead of pixels: the worker decodes nothing. The batch (EncodedImages) is decoded
when the training loop moves it to the device (`.to(device, dtype)`, which loop.py and evaluation/ already call):
torchvision.io.decode_jpeg on the whole list at once, then each crop resized (antialiased: what PIL's resize does)
to the output size, rounded to 8 bits as PIL's output is, and normalised. Evaluation's shortest-side resize and
centre crop run there likewise.

What stays on the CPU, decoded by the worker as --image-decode reduced does and carried in the same batch: images
that are not JPEGs, CMYK JPEGs, and evaluation geometries other than the square shortest-side one. A JPEG the
device cannot decode is decoded on the CPU; one that no decoder can read (its header parsed, its data corrupt) is
counted as a bad image and its place in the batch taken by the next image of the batch, as the map-style
datasets replace a bad sample by a neighbour (a batch must keep its size: ranks need equal batches). On a machine
without a GPU the same code decodes on the CPU in the training process (with libjpeg-turbo through simplejpeg, as
the workers decode: the tests run it so).
"""

from __future__ import annotations

import functools
import io
import logging
import random
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from bigclip.data.decode import Jpeg, read_jpeg
from bigclip.data.pixels import (
    TORCH_DECODABLE_MODES,
    PixelBatch,
    Pixels,
    decode_jpegs,
    jpeg_bytes,
    normalized,
    normalized_batch,
    resized_crop,
)
from bigclip.data.skips import SkipCounter
from bigclip.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputGeometry:
    """What every image of a loader becomes: size (height, width), normalisation, and for evaluation the
    shortest-side length it is resized to before the centre crop."""

    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    shortest: int | None = None


@dataclass
class EncodedJpeg:
    """One sample's image as the worker ships it: the file's bytes, the crop (top, left, height, width) on the full
    image (None: evaluation's resize and centre crop), the resampling filter, the output geometry."""

    data: torch.Tensor  # uint8, the whole file
    box: tuple[int, int, int, int] | None
    interpolation: InterpolationMode
    geometry: OutputGeometry


class DeviceDecodeTransform:
    """The worker-side half of --image-decode device. Called on an image (PIL, opened) it is the CPU transform
    (`cpu`: reduced decoding, for what does not go to the device); `encode` ships a JPEG instead."""

    accepts_undecoded = True  # see data/decode.py: it takes the image as PIL opened it

    def __init__(
        self, cpu, geometry: OutputGeometry, crops=None, interpolation=InterpolationMode.BICUBIC, min_pixels: int = 0
    ):
        self.cpu = cpu
        self.geometry = geometry
        # training: the RandomResizedCrop (or torchvision's RandomChoice of them, for 'random' interpolation) whose
        # draws the CPU transform would make; evaluation: None
        self.crops = crops
        self.interpolation = interpolation
        # --image-decode auto on a GPU with few loading cores: JPEGs smaller than this are decoded here, as `cpu`
        # does, because the workers keep up with them (data/decode_choice.py); 0 ships every JPEG
        self.min_pixels = min_pixels

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.cpu(image)

    def ships(self, image: Image.Image | Jpeg) -> bool:
        width, height = image.size
        return image.format == "JPEG" and image.mode in TORCH_DECODABLE_MODES and width * height >= self.min_pixels

    def encode(self, image: Image.Image | Jpeg, data: bytes) -> EncodedJpeg:
        """`image`'s crop drawn as the CPU transform draws it (its header's size only), shipped with `data`."""
        box, interpolation = None, self.interpolation
        if self.crops is not None:
            crop = self.crops
            if hasattr(crop, "transforms"):  # RandomChoice: the same draw as its forward makes
                crop = crop.transforms[random.choices(range(len(crop.transforms)), weights=crop.p)[0]]
            box = crop.box(*image.size)
            interpolation = crop.interpolation
        return EncodedJpeg(jpeg_bytes(data), box, interpolation, self.geometry)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(geometry={self.geometry}, min_pixels={self.min_pixels}, cpu={self.cpu})"


class EncodedImages:
    """A batch whose JPEGs are still encoded; `.to(device, dtype)` decodes them there and returns the image batch
    as the CPU path would have made it: float [B, 3, H, W], normalised, in `dtype`."""

    def __init__(self, items: list, skips_key: str | None = None):
        self.items = items  # EncodedJpeg, or a CPU-decoded image (a float tensor, or 8-bit Pixels)
        self.skips_key = skips_key  # the loader's SkipCounter's key

    def __len__(self) -> int:
        return len(self.items)

    def pin_memory(self) -> EncodedImages:
        return self  # the bytes are small; decode_jpeg copies them to the device itself

    def to(self, device, dtype: torch.dtype | None = None, non_blocking: bool = False) -> torch.Tensor:
        device = torch.device(device)
        _say_once_if_cpu(device)
        out: list[torch.Tensor | None] = [None] * len(self.items)
        jpegs = [i for i, item in enumerate(self.items) if isinstance(item, EncodedJpeg)]
        for i, pixels in zip(jpegs, _decode_all([self.items[i].data for i in jpegs], device), strict=True):
            if pixels is not None:
                out[i] = _finish(pixels, self.items[i])
        for i, item in enumerate(self.items):
            if isinstance(item, torch.Tensor):
                out[i] = item.to(device, non_blocking=non_blocking)
            elif isinstance(item, Pixels):  # decoded by the worker, normalised here
                out[i] = normalized(item.pixels.to(device, non_blocking=non_blocking), item.mean, item.std)
        self._replace_unreadable(out)
        batch = torch.stack(out)
        return batch if dtype is None else batch.to(dtype)

    def _replace_unreadable(self, out: list) -> None:
        bad = [i for i, x in enumerate(out) if x is None]
        if not bad:
            return
        if len(bad) == len(out):
            raise UserError(
                f"no JPEG of a batch of {len(out)} could be decoded (on the device or the CPU): the data is corrupt; "
                "check the shards, or decode in the loader with --image-decode reduced to skip bad images there"
            )
        skips = SkipCounter.find(self.skips_key)
        for i in bad:
            out[i] = next(out[(i + k) % len(out)] for k in range(1, len(out)) if out[(i + k) % len(out)] is not None)
            detail = "(a JPEG no decoder could read; replaced by its batch's next image)"
            if skips is not None:
                skips.count("bad_image", detail)
            else:
                logger.warning(f"skipped an image {detail}")


_SAID_CPU = False


def _say_once_if_cpu(device: torch.device) -> None:
    global _SAID_CPU
    if device.type == "cpu" and not _SAID_CPU:
        _SAID_CPU = True
        logger.warning(
            "--image-decode device on a CPU: every JPEG is decoded whole in the training process; on a machine "
            "without a GPU --image-decode reduced (what auto is there) is faster"
        )


@functools.cache
def device_decodes_jpegs(device: torch.device) -> bool:
    """Whether torchvision decodes a JPEG batch on `device` (nvJPEG on CUDA; a build without it, or a device type
    it has no decoder for, raises): --image-decode auto ships nothing to a device that would hand every image
    back to the training process's CPU. One 16x16 JPEG, once per device."""
    probe = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(probe, "JPEG")
    try:
        (pixels,) = decode_jpegs([jpeg_bytes(probe.getvalue())], device)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return tuple(pixels.shape) == (3, 16, 16)


def _decode_all(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """uint8 [3, h, w] images on `device`, one per JPEG (None: unreadable). On a GPU the whole list in one call;
    where that fails (one bad image fails the list), image by image, then on the CPU. On the CPU libjpeg-turbo
    through simplejpeg (data/decode.py), which reads a slightly corrupt JPEG silently where torchvision's libjpeg
    prints a line to stderr for it."""
    if not datas:
        return []
    if device.type == "cpu":
        return [_decode_on_cpu(data) for data in datas]
    try:
        return list(decode_jpegs(datas, device))
    except RuntimeError:
        return [_decode_one(data, device) for data in datas]


def _decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpegs(data, device)
    except RuntimeError:  # the device's decoder may refuse what libjpeg reads
        pixels = _decode_on_cpu(data)
        return None if pixels is None else pixels.to(device)


def _decode_on_cpu(data: torch.Tensor) -> torch.Tensor | None:
    """PIL's pixels of a JPEG: libjpeg-turbo's where it reads the file cleanly, else PIL's (it tolerates more);
    None where no decoder reads it (the caller counts and replaces it)."""
    encoded = data.numpy().tobytes()
    jpeg = read_jpeg(encoded)
    pixels = None if jpeg is None else jpeg.decode()
    if pixels is not None:
        return torch.from_numpy(pixels).permute(2, 0, 1)
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            return TF.pil_to_tensor(image.convert("RGB"))
    except Exception:
        return None


def _finish(pixels: torch.Tensor, item: EncodedJpeg) -> torch.Tensor:
    """The decoded image cropped and resized as the CPU transform would (8-bit rounding included), normalised."""
    geometry = item.geometry
    if item.box is not None:
        pixels = resized_crop(pixels, item.box, geometry.size, item.interpolation)
    else:
        pixels = TF.resize(pixels, geometry.shortest, item.interpolation, antialias=True)
        pixels = TF.center_crop(pixels, list(geometry.size))
    return normalized(pixels, geometry.mean, geometry.std)


def trim_text_padding(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """A batch of right-padded captions cut to its longest one (at least one position): OpenCLIP main's
    variable-length text batching (its collate_variable_text pads each batch to its longest caption)."""
    used = (tokens != pad_id).any(dim=0).nonzero()
    length = int(used[-1]) + 1 if len(used) else 1
    return tokens if length == tokens.shape[1] else tokens[:, :length].contiguous()


def collate_samples(samples: list[tuple], skips_key: str | None = None, text_pad_id: int | None = None) -> tuple:
    """A loader's batch from (image, *rest) samples: the images stacked; 8-bit Pixels normalised into the batch, or
    batched as a PixelBatch (normalised on the device: data/pixels.py's NORMALIZE_AT); or an
    EncodedImages batch where some are shipped encoded (--image-decode device; `skips_key`: the loader's
    SkipCounter, which counts the images no decoder can read); the rest as torch's default collate makes it, the
    captions (rest[0]) cut to the batch's longest where `text_pad_id` is given (variable-length text)."""
    images = [s[0] for s in samples]
    rest = default_collate([s[1:] for s in samples])
    if text_pad_id is not None:
        rest = [trim_text_padding(rest[0], text_pad_id), *rest[1:]]
    if any(isinstance(image, EncodedJpeg) for image in images):
        return EncodedImages(images, skips_key), *rest
    if isinstance(images[0], Pixels):  # a run's reduced training transform: 8-bit, normalised here or on the device
        if images[0].at == "batch":
            return normalized_batch(images), *rest
        return PixelBatch(default_collate([image.pixels for image in images]), images[0].mean, images[0].std), *rest
    # default_collate stacks a loader worker's batch straight into shared memory: torch.stack would make a batch
    # that pickling copies there again (measured with one worker and 224-px float images: 0.3-0.5 ms a sample)
    return default_collate(images), *rest
