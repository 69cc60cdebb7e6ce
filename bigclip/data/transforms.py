"""Image -> normalised tensor, for training (random crops, optional jitter) and evaluation.

Follows OpenCLIP's `image_transform`: training uses RandomResizedCrop over the --aug-cfg scale range
(or timm's create_transform with use_timm=true); evaluation resizes by --image-resize-mode and
centre-crops. Two deliberate extensions: `ratio` and `--image-interpolation` are honoured on the
plain torchvision training path too (OpenCLIP ignores them there; build.py hands the training crop bicubic, as
OpenCLIP's, unless the flag is given). With full decoding an image is resized and cropped in the mode it was opened
in and converted to RGB last, step for step as OpenCLIP's transforms, which matters for RGBA (resampled with its
alpha premultiplied) and palette images (PIL resizes those nearest): tests/test_preprocess_parity.py, every family.

Reduced decoding (--image-decode reduced, what auto is on a CPU): a transform's first step receives the image
undecoded (a JPEG as data/decode.py's Jpeg, whose header libjpeg-turbo read; anything else as PIL opened it) and
decodes a JPEG at the smallest DCT scale (1/2, 1/4, 1/8: what PIL's `draft` asks libjpeg for) that still leaves
the pixels the crop keeps at least as large as the output. The crop is drawn on the full image's size with torchvision's
RandomResizedCrop.get_params draws (same scale/ratio semantics, same random numbers), then mapped exactly (a
fractional box) onto the reduced image; evaluation's shortest-side resize likewise. What changes is
resampling only (libjpeg's DCT downscale before the bicubic resize): tests/test_data.py bounds the difference on
photographs. A training crop is resized with torch (data/pixels.py: PIL's result, up to the rounding, in a third of
the time) where it can be placed exactly, else with PIL; evaluation, other formats, and --image-decode full, resize
as OpenCLIP does.

--image-decode device: the workers ship JPEGs' bytes with their crops and the batch is decoded on the training
device (data/device_decode.py); what cannot go there is decoded as `reduced` decodes it. --image-decode auto (the
default): reduced, or on a GPU with few loading cores for the images' size, device for the JPEGs large enough
(data/decode_choice.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from timm.data import create_transform
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode

from bigclip.data.aug_cfg import validate_aug_cfg
from bigclip.data.decode import Jpeg
from bigclip.data.device_decode import DeviceDecodeTransform, OutputGeometry
from bigclip.data.pixels import NORMALIZE_AT, Pixels, normalized, resized_crop, resized_region
from bigclip.errors import UserError

logger = logging.getLogger(__name__)

INTERPOLATIONS = ("bicubic", "bilinear", "random")
DECODE_MODES = ("auto", "reduced", "full", "device")  # auto: data/decode_choice.py picks reduced or device
DRAFT_SCALES = (8, 4, 2)  # libjpeg's DCT scaling: 1/8, 1/4, 1/2
RESIZE_MODES = ("shortest", "longest", "squash")
_TIMM_ONLY = ("re_prob", "re_count")


def to_rgb(image: Image.Image | Jpeg) -> Image.Image:
    """A PIL image in RGB (a Jpeg decoded by libjpeg-turbo: PIL's own pixels)."""
    if isinstance(image, Jpeg):
        pixels = image.decode()
        return Image.fromarray(pixels) if pixels is not None else image.opened().convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def reduce_jpeg(image: Image.Image, factor: int) -> float:
    """Make a JPEG that PIL has opened but not decoded decode at 1/`factor` of its size (libjpeg's DCT scaling, the
    last partial block rounded up); returns the scale from full-size to decoded coordinates (1/factor, or 1.0 when
    nothing was reduced: other formats, an image already decoded)."""
    if image.format != "JPEG":
        return 1.0
    width, height = image.size
    # PIL picks the scale min(width // w, height // h) for a request (w, h)
    drafted = image.draft("RGB", (max(1, width // factor), max(1, height // factor)))  # None once decoded
    if not drafted:
        return 1.0
    _mode, box = drafted  # the full image's extent in decoded coordinates: (0, 0, width / scale, height / scale)
    return box[2] / width


def decode_reduced(image: Image.Image | Jpeg, factor: int) -> tuple[torch.Tensor | Image.Image, float]:
    """The image's RGB pixels, a JPEG's decoded at 1/`factor` (1: whole), and the scale from full-size to decoded
    coordinates: a uint8 [3, H, W] tensor (channels-last in memory: what torch's uint8 resize is fastest on) where
    libjpeg-turbo decoded it, else a PIL image in RGB (other formats; JPEGs it calls damaged, which PIL reads)."""
    if isinstance(image, Jpeg):
        pixels = image.decode(factor)
        if pixels is not None:
            return torch.from_numpy(pixels).permute(2, 0, 1), 1.0 / factor
        image = image.opened()
    scale = reduce_jpeg(image, factor) if factor > 1 else 1.0
    return to_rgb(image), scale


def _as_pil(decoded: torch.Tensor | Image.Image) -> Image.Image:
    return Image.fromarray(decoded.permute(1, 2, 0).numpy()) if isinstance(decoded, torch.Tensor) else decoded


def _largest_factor(width: float, height: float, out_width: int, out_height: int) -> int:
    """The largest DCT reduction that keeps a width x height region at least out_width x out_height (1: none)."""
    return next((f for f in DRAFT_SCALES if width / f >= out_width and height / f >= out_height), 1)


class ReducedRandomResizedCrop(T.RandomResizedCrop):
    """RandomResizedCrop whose crop is drawn on the full image's size (the same random numbers and scale/ratio
    semantics) and cut from a JPEG decoded at reduced scale where the crop still covers the output size."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation=InterpolationMode.BILINEAR):
        super().__init__(size, scale=scale, ratio=ratio, interpolation=interpolation)
        # torchvision's get_params takes log(ratio) as float32 on every call: the same numbers, once
        self._log_ratio = tuple(float(x) for x in torch.log(torch.tensor(self.ratio)))
        self._draw = torch.empty(1)  # each draw into one float32 element, as get_params's torch.empty(1)

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(top, left, height, width): torchvision's RandomResizedCrop.get_params for a width x height image, the
        same random numbers drawn the same way (tests/test_data.py), on the header's size alone. (Its ten tries
        run about five times an image at OpenCLIP's scale (0.9, 1): drawing into one tensor halves their cost.)"""
        area = height * width
        draw = self._draw
        for _ in range(10):
            target_area = area * draw.uniform_(self.scale[0], self.scale[1]).item()
            aspect_ratio = draw.uniform_(*self._log_ratio).exp_().item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        return _central_box(width, height, self.ratio)

    def forward(self, image: Image.Image | Jpeg) -> torch.Tensor:
        """uint8 [3, H, W]. A crop at whole scale is resized by torch (data/pixels.py: a third of PIL's time). One on
        a DCT-reduced JPEG lands on fractional pixels (rounding it to whole reduced pixels would shift the image by
        up to half of one: measured 3.7 grey levels from full decoding instead of 2): torch resamples it where each
        axis has a whole end (resized_region: at 1/2, three axes in four), PIL's resize(box=) where one has not."""
        top, left, height, width = self.box(*image.size)  # the header's size only
        factor = _largest_factor(width, height, self.size[1], self.size[0])
        decoded, scale = decode_reduced(image, factor)
        if scale == 1.0:
            pixels = decoded if isinstance(decoded, torch.Tensor) else T.functional.pil_to_tensor(decoded)
            return resized_crop(pixels, (top, left, height, width), self.size, self.interpolation)
        box = (left * scale, top * scale, (left + width) * scale, (top + height) * scale)
        if isinstance(decoded, torch.Tensor):
            resized = resized_region(decoded, box, self.size, self.interpolation)
            if resized is not None:
                return resized
        return T.functional.pil_to_tensor(
            _as_pil(decoded).resize((self.size[1], self.size[0]), _PIL_FILTERS[self.interpolation], box=box)
        )


def _central_box(width: int, height: int, ratio: Sequence[float]) -> tuple[int, int, int, int]:
    """torchvision's fallback when ten draws found no crop: the centre, at the nearest allowed aspect ratio."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:  # whole image
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


class Normalized:
    """uint8 [3, H, W] -> normalised float32: ToTensor then Normalize, in one step. `at` (data/pixels.py's
    NORMALIZE_AT): "image" normalises here; "batch" and "device" leave the pixels 8-bit (Pixels), normalised into
    the loader's batch or where the batch is moved to the training device."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], at: str = "image"):
        if at not in NORMALIZE_AT:
            raise ValueError(f"normalise at {at!r}: one of {NORMALIZE_AT}")
        self.mean, self.std, self.at = tuple(mean), tuple(std), at

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor | Pixels:
        if self.at == "image":
            return normalized(pixels, self.mean, self.std)
        return Pixels(pixels, self.mean, self.std, self.at)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean}, std={self.std}, at={self.at})"


_PIL_FILTERS = {
    InterpolationMode.BICUBIC: Image.Resampling.BICUBIC,
    InterpolationMode.BILINEAR: Image.Resampling.BILINEAR,
}


class ReducedResize:
    """Evaluation's shortest-side resize (torchvision's Resize(shortest): the same output size) of a JPEG decoded at
    the smallest DCT scale whose shorter side still covers `shortest`, resampled from the full image's exact extent
    on the reduced one."""

    def __init__(self, shortest: int, interpolation: InterpolationMode):
        self.shortest = shortest
        self.interpolation = interpolation

    def __call__(self, image: Image.Image | Jpeg) -> Image.Image:
        width, height = image.size
        side = min(width, height)
        factor = _largest_factor(side, side, self.shortest, self.shortest)
        if factor == 1 or image.format != "JPEG":  # nothing to reduce: OpenCLIP's resize, in the image's own mode
            return T.functional.resize(decoded(image), self.shortest, interpolation=self.interpolation)
        pixels, scale = decode_reduced(image, factor)
        image = _as_pil(pixels)
        if scale == 1.0:
            return T.functional.resize(image, self.shortest, interpolation=self.interpolation)
        long = int(self.shortest * max(width, height) / side)  # torchvision's rule for Resize(int)
        size = (self.shortest, long) if width <= height else (long, self.shortest)
        return image.resize(size, _PIL_FILTERS[self.interpolation], box=(0, 0, width * scale, height * scale))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shortest={self.shortest}, interpolation={self.interpolation.value})"


def _pair_size(image_size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(image_size, int):
        return image_size, image_size
    size = tuple(int(s) for s in image_size)
    return (size[0], size[0]) if len(size) == 1 else size[-2:]


class ResizeKeepRatio:
    """Scale so the image covers the target (`longest=False`) or fits inside it (`longest=True`): OpenCLIP's
    ResizeKeepRatio, its arithmetic too (divide by the ratio of source to target, then round), so that a side
    landing on .5 rounds as OpenCLIP's does."""

    def __init__(self, size: tuple[int, int], longest: bool, interpolation: InterpolationMode):
        self.size = size
        self.longest = longest
        self.interpolation = interpolation

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        ratios = (height / self.size[0], width / self.size[1])
        ratio = max(ratios) if self.longest else min(ratios)
        new_size = [round(height / ratio), round(width / ratio)]
        return T.functional.resize(image, new_size, interpolation=self.interpolation)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, longest={self.longest})"


class CenterCropOrPad:
    """torchvision's CenterCrop (the same padding split and crop offsets), padding with `fill` (OpenCLIP's
    fill_color, in every band) where the image is smaller: 'longest' letterboxing."""

    def __init__(self, size: tuple[int, int], fill: int = 0):
        self.size, self.fill = size, fill

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        crop_height, crop_width = self.size
        if crop_width > width or crop_height > height:
            padding = [
                max(crop_width - width, 0) // 2,
                max(crop_height - height, 0) // 2,
                (max(crop_width - width, 0) + 1) // 2,
                (max(crop_height - height, 0) + 1) // 2,
            ]
            image = T.functional.pad(image, padding, fill=self.fill)
        return T.functional.center_crop(image, list(self.size))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, fill={self.fill})"


def decoded(image: Image.Image | Jpeg) -> Image.Image:
    """A PIL image: a Jpeg decoded (RGB), anything else as it is, in its own mode. OpenCLIP resizes and crops an
    image in the mode it was opened in and converts to RGB last (an RGBA image is resampled with its alpha
    premultiplied, so the colour of transparent pixels does not bleed in); the full-decoding transforms do the same,
    step for step, and end with `to_rgb`."""
    return to_rgb(image) if isinstance(image, Jpeg) else image


def _random_resized_crop(size, scale, ratio, interpolation: str, reduced: bool) -> Any:
    ratio = ratio or (3 / 4, 4 / 3)
    crop = ReducedRandomResizedCrop if reduced else T.RandomResizedCrop
    if interpolation == "random":
        # A fresh choice per image, as timm's 'random' interpolation does.
        return T.RandomChoice(
            [
                crop(size, scale=scale, ratio=ratio, interpolation=mode)
                for mode in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)
            ]
        )
    mode = InterpolationMode.BILINEAR if interpolation == "bilinear" else InterpolationMode.BICUBIC
    return crop(size, scale=scale, ratio=ratio, interpolation=mode)


def _color_jitter(strength) -> T.ColorJitter:
    if isinstance(strength, float):
        return T.ColorJitter(strength, strength, strength)
    return T.ColorJitter(*strength)


def _timm_train_transform(size, mean, std, interpolation: str, aug: dict[str, Any]):
    options = {k: v for k, v in aug.items() if v is not None and k != "use_timm"}
    options.setdefault("color_jitter", None)  # timm would jitter by default; OpenCLIP turns it off
    if "gray_scale_prob" in options:
        options["grayscale_prob"] = options.pop("gray_scale_prob")
    timm_transform = create_transform(
        input_size=(3, *size),
        is_training=True,
        hflip=0.0,
        mean=mean,
        std=std,
        re_mode="pixel",
        interpolation=interpolation,
        **options,
    )
    return _undecoded_ok(T.Compose([to_rgb, timm_transform]))


def cpu_only_augmentations(aug: dict[str, Any]) -> list[str]:
    """The --aug-cfg keys in use that work on the worker's decoded image (jitter and grayscale on its pixels, timm's
    whole pipeline): --image-decode device, which crops and resizes on the device, cannot follow them there."""
    used = (
        ("color_jitter", aug.get("color_jitter") is not None),
        ("gray_scale_prob", bool(aug.get("gray_scale_prob"))),
        ("use_timm", bool(aug.get("use_timm"))),
    )
    return [name for name, on in used if on]


def check_image_decode(decode: str, aug: dict[str, Any]) -> None:
    """--image-decode device is refused with the augmentations that need the worker's pixels (auto falls back to
    reduced with them: data/decode_choice.py)."""
    cpu_only = cpu_only_augmentations(aug)
    if decode == "device" and cpu_only:
        raise UserError(
            f"--image-decode device crops and resizes on the device; --aug-cfg {', '.join(cpu_only)} works on "
            "images decoded in the loader: use --image-decode reduced with it"
        )


def image_transform(
    image_size: int | Sequence[int],
    is_train: bool,
    mean: Sequence[float],
    std: Sequence[float],
    interpolation: str | None = "bicubic",
    resize_mode: str | None = "shortest",
    aug_cfg: dict | list | None = None,
    decode: str = "full",
    normalize_at: str = "image",
    fill_color: int = 0,
    device_min_pixels: int = 0,
):
    """A callable PIL.Image -> FloatTensor[3, H, W]. `aug_cfg` is a dict or key=value strings. decode="reduced":
    given an image PIL has opened but not decoded, a JPEG is decoded at reduced scale where the output allows;
    "device": a DeviceDecodeTransform, which ships JPEGs of at least `device_min_pixels` pixels to be decoded on the
    training device and decodes smaller ones as "reduced"; "auto" is "reduced" here (a run resolves it for its
    device first: data/decode_choice.py).
    `normalize_at` (training, reduced/device; data/pixels.py's NORMALIZE_AT): "image", the transform's output is the
    float image; "batch" or "device" (what a run's loader uses, on a CPU or a GPU), 8-bit Pixels, which the loader
    normalises into its batch or batches as a PixelBatch, normalised by its `.to(device, dtype)`.
    `fill_color`: what evaluation's 'longest' resize pads with (OpenCLIP's PreprocessCfg.fill_color)."""
    if decode not in DECODE_MODES:
        raise UserError(f"--image-decode {decode}: choose one of {', '.join(DECODE_MODES)}")
    decode = "reduced" if decode == "auto" else decode
    reduced = decode in ("reduced", "device")
    interpolation = interpolation or "bicubic"
    resize_mode = resize_mode or "shortest"
    if interpolation not in INTERPOLATIONS:
        raise UserError(f"--image-interpolation {interpolation}: choose one of {', '.join(INTERPOLATIONS)}")
    if resize_mode not in RESIZE_MODES:
        raise UserError(f"--image-resize-mode {resize_mode}: choose one of {', '.join(RESIZE_MODES)}")
    size = _pair_size(image_size)
    mean, std = tuple(mean), tuple(std)
    normalize = T.Normalize(mean=mean, std=std)

    if is_train:
        aug = validate_aug_cfg(aug_cfg)
        check_image_decode(decode, aug)
        if aug.get("use_timm"):
            return _timm_train_transform(size, mean, std, interpolation, aug)
        unused = [k for k in _TIMM_ONLY if aug.get(k) is not None]
        if unused:
            logger.warning(f"--aug-cfg {', '.join(unused)} need use_timm=true; ignored")
        crop = _random_resized_crop(size, aug.get("scale") or (0.9, 1.0), aug.get("ratio"), interpolation, reduced)
        steps = [crop] if reduced else [decoded, crop, to_rgb]
        # (reduced: jitter and grayscale work on the crop's uint8 tensor, as torchvision's tensor versions do)
        if aug.get("color_jitter") is not None:
            steps.append(T.RandomApply([_color_jitter(aug["color_jitter"])], p=aug.get("color_jitter_prob") or 1.0))
        if aug.get("gray_scale_prob"):
            steps.append(T.RandomGrayscale(p=aug["gray_scale_prob"]))
        finish = [Normalized(mean, std, at=normalize_at)] if reduced else [T.ToTensor(), normalize]
        cpu = _undecoded_ok(T.Compose([*steps, *finish]))
        if decode == "device":
            return DeviceDecodeTransform(cpu, OutputGeometry(size, mean, std), crops=crop, min_pixels=device_min_pixels)
        return cpu

    # Evaluation has no randomness: 'random' interpolation means bicubic here, as in OpenCLIP.
    mode = InterpolationMode.BILINEAR if interpolation == "bilinear" else InterpolationMode.BICUBIC
    if resize_mode == "squash":
        resize = [T.Resize(size, interpolation=mode)]
    elif resize_mode == "shortest" and size[0] == size[1]:
        # OpenCLIP's own choice for square targets: torchvision's shortest-edge resize, which truncates the
        # long side (500x375 -> 298x224) where scaling by a ratio would round it (299): the crop, and so the
        # zero-shot numbers, would differ from OpenCLIP's by a pixel's shift.
        if reduced:
            resize = [ReducedResize(size[0], mode), T.CenterCrop(size)]
            cpu = _undecoded_ok(T.Compose([*resize, to_rgb, T.ToTensor(), normalize]))
            if decode == "device":
                geometry = OutputGeometry(size, mean, std, shortest=size[0])
                return DeviceDecodeTransform(cpu, geometry, interpolation=mode, min_pixels=device_min_pixels)
            return cpu
        resize = [T.Resize(size[0], interpolation=mode), T.CenterCrop(size)]
    elif resize_mode == "shortest":
        # OpenCLIP's ResizeKeepRatio(image_size) for a non-square target: bicubic whatever the interpolation (its
        # image_transform passes none there), kept so that the pixels are OpenCLIP's.
        resize = [ResizeKeepRatio(size, longest=False, interpolation=InterpolationMode.BICUBIC), T.CenterCrop(size)]
    else:
        resize = [ResizeKeepRatio(size, longest=True, interpolation=mode), CenterCropOrPad(size, fill_color)]
    return _undecoded_ok(T.Compose([decoded, *resize, to_rgb, T.ToTensor(), normalize]))


def _undecoded_ok(transform: T.Compose) -> T.Compose:
    """Mark a pipeline whose first step converts to RGB itself: the readers may hand it the image as PIL opened it
    (data/decode.py), which the reduced-decoding steps need."""
    transform.accepts_undecoded = True
    return transform
