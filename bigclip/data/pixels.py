"""8-bit pixels cropped, resized and normalised with torch: the steps that reduced decoding in the loader workers
and device decoding on the training device share, and how a run's loader batches 8-bit images.

torch's antialiased resize of uint8 images (vectorised) is what PIL's resize computes, up to its own fixed-point
rounding (measured on photographs: at most 1 grey level at most scales, up to 8 on a few pixels where an axis shrinks
by less than 1.3; 0.2 on average at most: tests/test_data.py bounds it), in about a third of PIL's time here. A GPU
decodes JPEGs with torchvision (nvJPEG); the CPU with libjpeg-turbo through simplejpeg (data/decode.py), which reads
slightly corrupt files silently where torchvision's libjpeg prints a line to stderr for each.

Where a run's training images are normalised (`NORMALIZE_AT`, chosen by bigclip/build.py): "image", by the
transform (a standalone transform's float image); "batch", by the loader worker's collate, straight into the
shared memory the batch crosses to the training process in (a CPU run); "device", where the batch is moved to the
training device (a GPU run: the 8-bit batch is a quarter of the bytes through shared memory and the copy).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

NORMALIZE_AT = ("image", "batch", "device")
TORCH_DECODABLE_MODES = ("RGB", "L")  # JPEG modes torchvision decodes to PIL's RGB; CMYK/YCCK stay with PIL


def decode_jpegs(data, device: torch.device | str = "cpu"):
    """uint8 [3, H, W] RGB pixels of a JPEG's bytes (a uint8 tensor), or of a list of them (decoded together: on a
    GPU, one nvJPEG batch). Greyscale is expanded as PIL's convert("RGB") expands it. RuntimeError: unreadable."""
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its image decoders in favour of TorchCodec's; the call is the same there (see
        # docs/architecture.md), and the warning, on every image, is nothing a user can act on
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def jpeg_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a writable copy: torch refuses read-only buffers


def resized_crop(
    pixels: torch.Tensor, box: tuple[int, int, int, int], size: Sequence[int], interpolation: InterpolationMode
) -> torch.Tensor:
    """uint8 [3, h, w] -> the (top, left, height, width) crop resized to `size` (antialiased, rounded to 8 bits as
    PIL's output is), as torchvision's resized_crop computes it."""
    if pixels.device.type != "cpu":  # torchvision resamples a float copy there, rounded back
        return TF.resized_crop(pixels, *box, list(size), interpolation, antialias=True)
    # on the CPU torch resamples uint8 itself (vectorised, fixed-point); torchvision would go through float for bicubic
    top, left, height, width = box
    crop = pixels[:, top : top + height, left : left + width].unsqueeze(0)
    mode = "bicubic" if interpolation == InterpolationMode.BICUBIC else "bilinear"
    return F.interpolate(crop, size=list(size), mode=mode, align_corners=False, antialias=True)[0]


_ANTIALIASED = {
    InterpolationMode.BICUBIC: torch.ops.aten._upsample_bicubic2d_aa,
    InterpolationMode.BILINEAR: torch.ops.aten._upsample_bilinear2d_aa,
}


def resized_region(
    pixels: torch.Tensor,
    region: tuple[float, float, float, float],
    size: Sequence[int],
    interpolation: InterpolationMode,
) -> torch.Tensor | None:
    """uint8 [3, h, w] (on the CPU) -> its `region` (left, top, right, bottom: fractional, as PIL's resize(box=)
    takes it) resized to `size` (height, width), antialiased; or None, where on some axis neither end of the region
    falls on a pixel edge (the caller resizes with PIL). torch's resize maps output pixels from the start of its
    input, at a scale it can be given: anchored at an end that is whole, the input flipped when that end is the far
    one, it samples where PIL's resize(box=) samples, within the two resizers' rounding (above) in a third of the
    time; its filter stops at the region's edges, where PIL's reads on into the pixels beyond them (torchvision's
    resized_crop, OpenCLIP's, stops there too)."""
    rows = _anchored(region[1], region[3], pixels.shape[1])
    cols = _anchored(region[0], region[2], pixels.shape[2])
    if rows is None or cols is None:
        return None
    crop = pixels[:, rows[0] : rows[1], cols[0] : cols[1]]
    flips = [dim for dim, (_, _, flipped) in ((1, rows), (2, cols)) if flipped]
    if flips:
        crop = crop.flip(flips)
    height, width = size
    scales = (height / (region[3] - region[1]), width / (region[2] - region[0]))  # output / input, as torch takes it
    out = _ANTIALIASED[interpolation](crop.unsqueeze(0), [height, width], False, *scales)[0]
    return out.flip(flips) if flips else out


def _anchored(start: float, end: float, length: int) -> tuple[int, int, bool] | None:
    """(first pixel, one past the last, flipped) of the input that covers [start, end) on an axis, starting at the
    end that is whole (flipped: the far one); None if neither is."""
    if start == int(start):
        return int(start), min(length, math.ceil(end)), False
    if end == int(end):
        return math.floor(start), int(end), True
    return None


def normalized(
    pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float], out: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 [3, H, W] (or a batch [B, 3, H, W]) -> contiguous float32 (x / 255 - mean) / std, as ToTensor then
    Normalize make it (to float32 rounding: within 5e-7), in one pass: x * (1 / (255 std)) - mean / std, written into
    `out` if given. Five passes (convert, scale, subtract, divide, make contiguous) cost 0.43 ms an image at 224 px
    here, this one 0.12."""
    bias, scale = _affine(tuple(mean), tuple(std), pixels.device)
    if out is None:
        out = torch.empty(pixels.shape, dtype=torch.float32, device=pixels.device)
    return torch.addcmul(bias, pixels, scale, out=out)


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(-mean / std, 1 / (255 std)) as [C, 1, 1] float32 on `device`: made once, not per image."""
    std_ = torch.tensor(std, dtype=torch.float32, device=device).view(-1, 1, 1)
    mean_ = torch.tensor(mean, dtype=torch.float32, device=device).view(-1, 1, 1)
    return -mean_ / std_, 1 / (255 * std_)


@dataclass
class Pixels:
    """One training image as a run's transform leaves it: uint8 [3, H, W] and its normalisation, made into the float
    image in the loader's batch (`at` "batch": normalized_batch) or on the training device ("device": PixelBatch)."""

    pixels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    at: str = "device"


def normalized_batch(images: list[Pixels]) -> torch.Tensor:
    """float32 [B, 3, H, W]: each image normalised (as `normalized`) straight into its slot of the batch — in a loader
    worker, in the shared memory the batch crosses to the training process in, where torch's default_collate would
    put it. One write of the float batch where normalising each image, then stacking them, wrote it twice (0.2 ms a
    sample at 224 px on this CPU)."""
    first = images[0]
    shape = (len(images), *first.pixels.shape)
    if get_worker_info() is not None:  # default_collate's own way to allocate a batch in shared memory
        storage = torch.empty(0)._typed_storage()._new_shared(math.prod(shape))
        out = torch.empty(0).new(storage).view(shape)
    else:
        out = torch.empty(shape)
    for slot, image in zip(out, images, strict=True):
        normalized(image.pixels, image.mean, image.std, out=slot)
    return out


class PixelBatch:
    """A batch of Pixels: uint8 [B, 3, H, W]. `.to(device, dtype)` — the call loop.py makes — moves the 8-bit batch
    and normalises it there, returning the float batch the worker would have made (to float32 rounding)."""

    def __init__(self, pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]):
        self.pixels, self.mean, self.std = pixels, mean, std

    def __len__(self) -> int:
        return len(self.pixels)

    def pin_memory(self) -> PixelBatch:
        return PixelBatch(self.pixels.pin_memory(), self.mean, self.std)

    def to(self, device, dtype: torch.dtype | None = None, non_blocking: bool = False) -> torch.Tensor:
        batch = normalized(self.pixels.to(device, non_blocking=non_blocking), self.mean, self.std)
        return batch if dtype is None else batch.to(dtype)
