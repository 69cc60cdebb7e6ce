"""--image-decode auto (the default): which JPEGs a run's training device decodes and which its loader workers do.

Reduced decoding in the workers (data/transforms.py) costs CPU time that grows with an image's size; decoding on
the GPU (data/device_decode.py, nvJPEG) costs the workers almost nothing but takes a share of the GPU and the
training process, so it pays only where the workers would otherwise be the bottleneck. The rule, per image, from
its header's size: decode it on the device when the CPU cores this GPU has for loading could deliver fewer images
of that size per second than the device path does (DEVICE_IMAGES_PER_S), in the workers otherwise. So with many
cores per GPU every image is decoded by the workers, as `reduced`; with few, large photographs go to the GPU
first, and with one or two cores every JPEG does. On a CPU, or with augmentations that need the worker's pixels
(--aug-cfg color_jitter, gray_scale_prob, use_timm), or where torchvision cannot decode on the device (a build
without nvJPEG, a GPU it has no JPEG decoder for), `auto` is `reduced`.

The figures are measured (docs/benchmarks.md, "--image-decode auto"); the GPU kit's `decode` part measures both
paths at 2, 4 and 8 workers on 512- and 1024-px photographs and reports the rule's choice beside each pair.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass

from bigclip.data.transforms import cpu_only_augmentations

# One loader worker's seconds per training sample with --image-decode reduced, by the JPEG's pixel count: the
# photographs of bench/data_throughput.py (--photos 256, 512, 1024 --workers 1: crops of aspect 3:4 to 4:3 resized
# to that long side, so PHOTO_AREA x side^2 pixels on average): 698, 435 and 202 samples/s here (2-core x86-64,
# 2026-11-29); the H200's 16-core host measured 373 and 354 per worker at 512 px and 245 at 1024 px (2026-11-27,
# an older loader). Reading the shard, the caption and the batch are in it: what a worker does per sample besides
# the decode. Larger images: the last slope (what grows is the entropy decoding, linear in the file; libjpeg's
# 1/4 and 1/8 scales keep the decoded pixels near the output's).
PHOTO_AREA = 0.868  # the mean of min(r, 1/r) for an aspect r drawn uniformly from 3/4 to 4/3
REDUCED_SAMPLES_PER_S = ((256, 698), (512, 435), (1024, 202))  # (long side, one worker's samples/s)
REDUCED_S_PER_IMAGE = tuple((round(PHOTO_AREA * side * side), 1 / rate) for side, rate in REDUCED_SAMPLES_PER_S)
# Images per second one GPU takes through --image-decode device while training (nvJPEG decodes the batch, crops
# are resized there): H200, ViT-B-32 amp batch 256, 2008 samples/s at 512 px with 8 workers; the loader alone
# 2336 at 1024 px with 2 workers (the GPU kit, 2026-11-27).
DEVICE_IMAGES_PER_S = 2000.0


@dataclass(frozen=True)
class DecodeChoice:
    """What a run's transforms do: `mode` reduced | full | device; with device, the JPEGs of at least
    `min_pixels` pixels are shipped to the device and smaller ones decoded by the workers (0: every JPEG)."""

    mode: str
    min_pixels: int = 0

    def describe(self) -> str:
        if self.mode != "device" or self.min_pixels == 0:
            return f"{self.mode} decoding"
        side = round((self.min_pixels * 4 / 3) ** 0.5)  # the long side of a 4:3 photograph of that many pixels
        return (
            f"JPEGs of at least {self.min_pixels / 1e6:.2f} MP (a 4:3 photo of {side} px) decoded on the device, "
            "smaller ones reduced in the loader workers"
        )


def _along(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The piecewise-linear function through `points` (x increasing) at x, extended by its end segments."""
    i = min(max(bisect_left([p for p, _ in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def reduced_seconds(pixels: float) -> float:
    """One worker's seconds per sample of that many pixels, interpolated in REDUCED_S_PER_IMAGE (the end slopes
    beyond it, never below the smallest measured)."""
    return max(REDUCED_S_PER_IMAGE[0][1], _along(REDUCED_S_PER_IMAGE, pixels))


def device_min_pixels(cores: float) -> int | None:
    """The smallest JPEG (pixels) that `cores` loading cores would deliver more slowly than the device decodes:
    0 when every JPEG should go to the device, None when none should."""
    if cores <= 0:
        return 0  # the training process loads by itself (--workers 0): every decode it avoids is a step's time
    budget = cores / DEVICE_IMAGES_PER_S  # seconds a worker may spend on an image and still keep up
    if budget < REDUCED_S_PER_IMAGE[0][1]:
        return 0
    pixels = _along(tuple((t, p) for p, t in REDUCED_S_PER_IMAGE), budget)  # reduced_seconds inverted
    return round(pixels) if pixels < 1e9 else None  # beyond a gigapixel: no image is decoded on the device


def loading_cores(workers: int, local_processes: int, allowed: int | None = None, machine: int | None = None) -> float:
    """The CPU cores one training process has for its loader: its workers, at most its share of the CPUs it may
    run on (`allowed`, its affinity). Where that is the whole machine (`machine` CPUs), the node's training
    processes share it; a scheduler that pins each task (Slurm's --cpus-per-task, numactl) gives each its own."""
    if allowed is None:
        try:
            allowed = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            allowed = os.cpu_count() or 1
    machine = (os.cpu_count() or allowed) if machine is None else machine
    share = allowed / max(local_processes, 1) if allowed >= machine else allowed
    return min(float(workers), max(share, 1.0)) if workers > 0 else 0.0


def choose_image_decode(
    decode: str, device_type: str, aug: dict, cores: float, device_decodes: bool = True
) -> DecodeChoice:
    """--image-decode's value as this process runs it (`aug`: the validated --aug-cfg; `cores`: loading_cores;
    `device_decodes`: whether the device's JPEG decoder works, device_decode.device_decodes_jpegs)."""
    if decode == "device":
        return DecodeChoice("device")
    if decode != "auto":
        return DecodeChoice(decode)
    if device_type == "cpu" or cpu_only_augmentations(aug) or not device_decodes:
        return DecodeChoice("reduced")
    min_pixels = device_min_pixels(cores)
    return DecodeChoice("reduced") if min_pixels is None else DecodeChoice("device", min_pixels)
