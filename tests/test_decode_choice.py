"""--image-decode auto (data/decode_choice.py): per image, decoded on the GPU when the rank's loading cores would
deliver images of its size more slowly than the device path, by the loader workers (reduced) otherwise."""

import dataclasses
import io
import logging

import open_clip
import pytest
import torch
from test_data import _photo_jpeg
from test_device_decode import GREY_LEVELS, _photo_shards

from bigclip.build import build_data, build_transforms, image_decode_choice
from bigclip.data.config import DataConfig
from bigclip.data.decode import decode_rgb
from bigclip.data.decode_choice import (
    DEVICE_IMAGES_PER_S,
    REDUCED_S_PER_IMAGE,
    DecodeChoice,
    choose_image_decode,
    device_min_pixels,
    loading_cores,
    reduced_seconds,
)
from bigclip.data.device_decode import (
    DeviceDecodeTransform,
    EncodedImages,
    EncodedJpeg,
    collate_samples,
    device_decodes_jpegs,
)
from bigclip.data.pixels import PixelBatch
from bigclip.data.transforms import image_transform
from bigclip.dist import World
from bigclip.model.config import ModelConfig

MEAN, STD = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
PHOTO_512 = REDUCED_S_PER_IMAGE[1][0]  # the measured 512-px photographs' pixels


def _crossover_by_bisection(cores: float) -> float:
    """Where `cores` workers' images per second fall to the device's, found by bisection on the cost model (the
    rule inverts it in closed form)."""
    lo, hi = 1.0, 1e9
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cores / reduced_seconds(mid) > DEVICE_IMAGES_PER_S else (lo, mid)
    return hi


def test_the_rule_ships_what_the_workers_would_deliver_more_slowly_than_the_device():
    # the measurements behind it (H200, 16-core host): 1024-px photos with 2 workers, reduced 489 samples/s against
    # 2336 on the device; 512 px with 4 workers 1417 against 1476; 512 px with 8 workers 2981 against 2008
    assert device_min_pixels(2) == 0 and device_min_pixels(1) == 0 and device_min_pixels(0) == 0
    assert 0 < device_min_pixels(4) <= PHOTO_512 < device_min_pixels(8)
    thresholds = [device_min_pixels(cores) for cores in range(1, 65)]
    assert thresholds == sorted(thresholds)  # more cores never ship more
    for cores in (3.5, 4, 6, 8, 12, 16, 48):
        assert device_min_pixels(cores) == pytest.approx(_crossover_by_bisection(cores), rel=1e-6, abs=1)
    # beyond the measured sizes the cost keeps growing (a 12-megapixel photo costs a worker ~48 ms)
    assert 0.03 < reduced_seconds(4000 * 3000) < 0.06
    assert device_min_pixels(10**7) is None  # no image that large: nothing goes to the device


def test_a_ranks_loading_cores_are_its_workers_within_its_share_of_the_cpus():
    assert loading_cores(4, 8, allowed=16, machine=16) == 2  # torchrun, 8 GPUs on 16 unpinned cores
    assert loading_cores(8, 8, allowed=4, machine=64) == 4  # Slurm's --cpus-per-task 4: pinned, its own
    assert loading_cores(4, 1, allowed=16, machine=16) == 4
    assert loading_cores(4, 32, allowed=16, machine=16) == 1  # at least a core
    assert loading_cores(0, 1, allowed=16, machine=16) == 0  # --workers 0: the training process loads


def test_auto_is_reduced_on_a_cpu_and_with_augmentations_on_the_workers_pixels():
    assert choose_image_decode("auto", "cpu", {}, 1) == DecodeChoice("reduced")
    assert choose_image_decode("auto", "cuda", {}, 2) == DecodeChoice("device", 0)
    assert choose_image_decode("auto", "cuda", {}, 8) == DecodeChoice("device", device_min_pixels(8))
    for aug in ({"color_jitter": 0.4}, {"gray_scale_prob": 0.2}, {"use_timm": True}):
        assert choose_image_decode("auto", "cuda", aug, 2) == DecodeChoice("reduced")
    assert choose_image_decode("device", "cuda", {}, 64) == DecodeChoice("device", 0)  # asked for: every JPEG
    assert choose_image_decode("full", "cuda", {}, 1) == DecodeChoice("full")
    # a GPU whose JPEG decoder torchvision lacks (a build without nvJPEG): the workers decode
    assert choose_image_decode("auto", "cuda", {}, 2, device_decodes=False) == DecodeChoice("reduced")
    assert device_decodes_jpegs(torch.device("cpu"))  # the probe decodes a JPEG there
    assert "decoded on the device" in DecodeChoice("device", device_min_pixels(8)).describe()


@pytest.mark.parametrize("train", [True, False])
def test_jpegs_below_the_threshold_are_decoded_by_the_worker_as_reduced_and_ride_with_the_shipped(train):
    """min_pixels between two photographs: the smaller is decoded by the worker bit for bit as reduced decoding
    (same random draws), the larger shipped; the mixed batch's images within a grey level of full decoding's."""
    photos = [_photo_jpeg(0, 512), _photo_jpeg(1, 1024), _photo_jpeg(1, 640)]
    auto = image_transform(224, train, MEAN, STD, decode="device", device_min_pixels=200_000)
    assert isinstance(auto, DeviceDecodeTransform) and auto.min_pixels == 200_000
    samples, reduced, full, states = [], [], [], []
    for i, data in enumerate(photos):
        for decode, out in (("reduced", reduced), ("full", full)):
            torch.manual_seed(i)
            out.append(decode_rgb(io.BytesIO(data), image_transform(224, train, MEAN, STD, decode=decode)))
        states.append(torch.get_rng_state())
        torch.manual_seed(i)
        samples.append((decode_rgb(io.BytesIO(data), auto), torch.tensor([i])))
        assert torch.equal(torch.get_rng_state(), states[-1])  # the same draws whichever side decodes
    assert [type(s[0]) for s in samples] == [torch.Tensor, EncodedJpeg, EncodedJpeg]  # 512x342 < 200k <= 640x427
    assert torch.equal(samples[0][0], reduced[0])
    batch, numbers = collate_samples(samples)
    assert isinstance(batch, EncodedImages) and numbers[:, 0].tolist() == [0, 1, 2]
    pixels = batch.to("cpu")
    assert torch.equal(pixels[0], reduced[0])
    for i in (1, 2):
        assert ((pixels[i] - full[i]).abs() * GREY_LEVELS).mean() < 0.3


def test_a_run_resolves_auto_for_its_device_and_says_what_it_chose(tmp_path, caplog):
    """build_data as a run calls it: on a CPU rank auto trains on reduced decoding's float batches (and says
    nothing); on an accelerator rank with no loader workers every JPEG is shipped (EncodedImages, decoded where
    moved: here the CPU), the same images within resampling noise; with 8 workers on 8 cores a 512-px photograph
    stays in the workers, a 2048-px one is shipped. The accelerator here is the meta device (a CPU machine has no
    GPU; the loader only reads the rank's device, and torchvision's decoder answers the start-up probe for it)."""
    _photo_shards(tmp_path, shards=2, per_shard=4)
    shards = f"{tmp_path}/p-{{0..1}}.tar"
    data = dataclasses.replace(
        DataConfig(), train_data=shards, train_num_samples=8, dataset_type="webdataset", batch_size=4, workers=0,
        seed=3,
    )  # fmt: skip
    assert data.image_decode == "auto"  # the default
    batches = {}
    for device in ("meta", "cpu"):
        torch.manual_seed(0)
        with caplog.at_level(logging.INFO, logger="bigclip"):
            loaders, _ = build_data(ModelConfig(model="test-tiny"), data, World(device=torch.device(device)), 0)
        batches[device] = [images for images, _ in loaders["train"].dataloader]
    assert caplog.text.count("--image-decode auto:") == 1  # said where it ships images (a CPU's auto is reduced)
    assert "--image-decode auto: device decoding" in caplog.text  # workers 0: every JPEG, said plainly
    assert len(batches["meta"]) == len(batches["cpu"]) == 2
    for shipped, floats in zip(batches["meta"], batches["cpu"], strict=True):
        assert isinstance(shipped, EncodedImages) and isinstance(floats, torch.Tensor)
        assert not isinstance(floats, PixelBatch)
        assert ((shipped.to("cpu") - floats).abs() * GREY_LEVELS).mean() < 3  # device vs reduced: resampling
    many = dataclasses.replace(data, workers=8)
    choice = image_decode_choice(many, World(device=torch.device("meta")))
    assert choice.mode == "device" and choice.min_pixels == device_min_pixels(loading_cores(8, 1))
    eight_cores = DecodeChoice("device", device_min_pixels(8))  # as a rank with 8 workers on 8 cores chooses
    train, val, _ = build_transforms(ModelConfig(model="test-tiny"), many, "device", eight_cores)
    assert train.min_pixels == val.min_pixels == eight_cores.min_pixels
    for transform in (train, val):
        assert not transform.ships(_Header(512, 341)) and transform.ships(_Header(2048, 1365))
        assert not transform.ships(_Header(2048, 1365, format="PNG"))


@dataclasses.dataclass
class _Header:
    """What `ships` reads of an image: format, mode and size (a JPEG's header)."""

    width: int
    height: int
    format: str = "JPEG"
    mode: str = "RGB"

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height
