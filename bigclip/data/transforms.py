"""PIL image -> normalised tensor, for training (random crops, optional jitter) and evaluation.

Follows OpenCLIP's `image_transform`: training uses RandomResizedCrop over the --aug-cfg scale range
(or timm's create_transform with use_timm=true); evaluation resizes by --image-resize-mode and
centre-crops. Two deliberate extensions: `ratio` and `--image-interpolation` are honoured on the
plain torchvision training path too (OpenCLIP ignores them there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from PIL import Image
from timm.data import create_transform
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode

from bigclip.data.aug_cfg import validate_aug_cfg
from bigclip.errors import UserError

logger = logging.getLogger(__name__)

INTERPOLATIONS = ("bicubic", "bilinear", "random")
RESIZE_MODES = ("shortest", "longest", "squash")
_TIMM_ONLY = ("re_prob", "re_count")


def to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def _pair_size(image_size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(image_size, int):
        return image_size, image_size
    size = tuple(int(s) for s in image_size)
    return (size[0], size[0]) if len(size) == 1 else size[-2:]


class ResizeKeepRatio:
    """Scale so the image covers the target (`longest=False`) or fits inside it (`longest=True`)."""

    def __init__(self, size: tuple[int, int], longest: bool, interpolation: InterpolationMode):
        self.size = size
        self.longest = longest
        self.interpolation = interpolation

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        ratios = (self.size[0] / height, self.size[1] / width)
        scale = min(ratios) if self.longest else max(ratios)
        new_size = [max(1, round(height * scale)), max(1, round(width * scale))]
        return T.functional.resize(image, new_size, interpolation=self.interpolation)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, longest={self.longest})"


def _random_resized_crop(size, scale, ratio, interpolation: str) -> Any:
    ratio = ratio or (3 / 4, 4 / 3)
    if interpolation == "random":
        # A fresh choice per image, as timm's 'random' interpolation does.
        return T.RandomChoice(
            [
                T.RandomResizedCrop(size, scale=scale, ratio=ratio, interpolation=mode)
                for mode in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC)
            ]
        )
    mode = InterpolationMode.BILINEAR if interpolation == "bilinear" else InterpolationMode.BICUBIC
    return T.RandomResizedCrop(size, scale=scale, ratio=ratio, interpolation=mode)


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
    return T.Compose([to_rgb, timm_transform])


def image_transform(
    image_size: int | Sequence[int],
    is_train: bool,
    mean: Sequence[float],
    std: Sequence[float],
    interpolation: str | None = "bicubic",
    resize_mode: str | None = "shortest",
    aug_cfg: dict | list | None = None,
):
    """A callable PIL.Image -> FloatTensor[3, H, W]. `aug_cfg` is a dict or key=value strings."""
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
        if aug.get("use_timm"):
            return _timm_train_transform(size, mean, std, interpolation, aug)
        unused = [k for k in _TIMM_ONLY if aug.get(k) is not None]
        if unused:
            logger.warning(f"--aug-cfg {', '.join(unused)} need use_timm=true; ignored")
        steps = [to_rgb, _random_resized_crop(size, aug.get("scale") or (0.9, 1.0), aug.get("ratio"), interpolation)]
        if aug.get("color_jitter") is not None:
            steps.append(T.RandomApply([_color_jitter(aug["color_jitter"])], p=aug.get("color_jitter_prob") or 1.0))
        if aug.get("gray_scale_prob"):
            steps.append(T.RandomGrayscale(p=aug["gray_scale_prob"]))
        return T.Compose([*steps, T.ToTensor(), normalize])

    # Evaluation has no randomness: 'random' interpolation means bicubic here, as in OpenCLIP.
    mode = InterpolationMode.BILINEAR if interpolation == "bilinear" else InterpolationMode.BICUBIC
    if resize_mode == "squash":
        resize = [T.Resize(size, interpolation=mode)]
    elif resize_mode == "shortest" and size[0] == size[1]:
        # OpenCLIP's own choice for square targets: torchvision's shortest-edge resize, which truncates the
        # long side (500x375 -> 298x224) where scaling by a ratio would round it (299): the crop, and so the
        # zero-shot numbers, would differ from OpenCLIP's by a pixel's shift.
        resize = [T.Resize(size[0], interpolation=mode), T.CenterCrop(size)]
    else:
        # CenterCrop pads with black where the resized image is smaller ('longest' letterboxing).
        resize = [ResizeKeepRatio(size, longest=resize_mode == "longest", interpolation=mode), T.CenterCrop(size)]
    return T.Compose([to_rgb, *resize, T.ToTensor(), normalize])
