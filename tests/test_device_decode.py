"""--image-decode device: JPEGs shipped undecoded by the loader workers and decoded batch-wise where the batch is
moved to (torchvision's decode_jpeg: nvJPEG on a GPU; here the CPU, the same code path)."""

import io
import pickle

import open_clip
import pytest
import torch
import webdataset as wds
from helpers import python_train, read_metrics
from PIL import Image
from test_data import _photo_jpeg
from torchdata.stateful_dataloader import StatefulDataLoader

from bigclip.data.decode import decode_rgb
from bigclip.data.device_decode import EncodedImages, EncodedJpeg, collate_samples
from bigclip.data.pixels import PixelBatch, Pixels
from bigclip.data.shards import ShardReader
from bigclip.data.skips import SkipCounter
from bigclip.data.transforms import image_transform
from bigclip.data.wds_plan import ShardPlan
from bigclip.data.wds_stream import ShardStream
from bigclip.errors import UserError

MEAN, STD = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
GREY_LEVELS = torch.tensor(STD)[:, None, None] * 255  # normalised units -> 8-bit grey levels


def _transform(decode: str, train: bool):
    return image_transform(224, train, MEAN, STD, decode=decode)


def _on_device(sample) -> torch.Tensor:
    return collate_samples([(sample, torch.zeros(1))])[0].to("cpu")[0]


def _png(data: bytes) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).save(out, "PNG")
    return out.getvalue()


def _cmyk_jpeg(data: bytes) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("CMYK").save(out, "JPEG", quality=92)
    return out.getvalue()


def _grey_jpeg(data: bytes) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("L").save(out, "JPEG", quality=92)
    return out.getvalue()


def _corrupt_jpeg(data: bytes) -> bytes:
    """A JPEG whose header PIL opens (size, mode) but whose Huffman tables no decoder accepts."""
    at = data.index(b"\xff\xc4") + 5  # inside the first DHT segment: its code counts
    return data[:at] + b"\xff" * 16 + data[at + 16 :]


@pytest.mark.parametrize("train", [True, False])
def test_device_decoding_draws_the_same_crops_and_stays_within_a_grey_level_of_full_decoding(train):
    """The worker ships bytes and a crop drawn with the same random numbers as full decoding (the generator's
    state after each sample is identical); decoded and resized on the device the tensors are within 0.3 grey
    levels of OpenCLIP's full decoding on average (measured 0.07-0.16) and 6 at most (measured 5: rounding of
    different resampling filters) — closer than reduced decoding (0.4-2.6)."""
    for long_side in (512, 1024, 2048):
        for index, square in ((0, False), (1, False), (0, True)):
            data = _photo_jpeg(index, long_side, square)
            out, states = {}, {}
            for decode in ("full", "device"):
                torch.manual_seed(long_side + index)
                out[decode] = decode_rgb(io.BytesIO(data), _transform(decode, train))
                states[decode] = torch.get_rng_state()
            assert isinstance(out["device"], EncodedJpeg)  # the worker decoded nothing
            assert torch.equal(states["full"], states["device"])
            levels = (out["full"] - _on_device(out["device"])).abs() * GREY_LEVELS
            assert levels.mean() < 0.3 and levels.max() <= 6, (long_side, index, square, levels.mean(), levels.max())


def test_other_formats_are_decoded_by_the_worker_and_ride_in_the_same_batch():
    """A PNG and a CMYK JPEG are decoded in the worker exactly as reduced decoding does; a greyscale JPEG goes to
    the device and comes back as RGB; the batch keeps its order."""
    photo = _photo_jpeg(1, 1024)
    images = [photo, _png(photo), _cmyk_jpeg(photo), _grey_jpeg(photo)]
    device, reduced = _transform("device", True), _transform("reduced", True)
    samples, expected = [], []
    for i, data in enumerate(images):
        torch.manual_seed(i)
        samples.append((decode_rgb(io.BytesIO(data), device), torch.tensor([i])))
        torch.manual_seed(i)
        expected.append(decode_rgb(io.BytesIO(data), reduced))
    assert [type(s[0]) for s in samples] == [EncodedJpeg, torch.Tensor, torch.Tensor, EncodedJpeg]
    batch, numbers = collate_samples(samples)
    assert isinstance(batch, EncodedImages) and numbers[:, 0].tolist() == [0, 1, 2, 3]
    pixels = batch.to("cpu", dtype=torch.float64)
    assert pixels.shape == (4, 3, 224, 224) and pixels.dtype == torch.float64
    assert torch.equal(pixels[1].float(), expected[1]) and torch.equal(pixels[2].float(), expected[2])
    for i in (0, 3):
        assert ((pixels[i].float() - expected[i]).abs() * GREY_LEVELS).mean() < 3  # reduced vs device: resampling
    grey = pixels[3] * torch.tensor(STD, dtype=torch.float64)[:, None, None] + torch.tensor(MEAN)[:, None, None]
    assert torch.allclose(grey[0], grey[1], atol=1e-6) and torch.allclose(grey[1], grey[2], atol=1e-6)
    # on a GPU rank the worker-decoded ones ride 8-bit (Pixels) and are normalised on the device with the rest
    deferred = image_transform(224, True, MEAN, STD, decode="device", normalize_at="device")
    shipped = []
    for i, data in enumerate(images):
        torch.manual_seed(i)
        shipped.append((decode_rgb(io.BytesIO(data), deferred), torch.tensor([i])))
    assert [type(s[0]) for s in shipped] == [EncodedJpeg, Pixels, Pixels, EncodedJpeg]
    again = collate_samples(shipped)[0].to("cpu", dtype=torch.float64)
    assert torch.allclose(again, pixels, rtol=0, atol=1e-6)


def test_a_jpeg_no_decoder_reads_is_counted_and_replaced_by_the_next_image_of_its_batch(caplog):
    photos = [_photo_jpeg(0, 512), _corrupt_jpeg(_photo_jpeg(1, 512)), _photo_jpeg(1, 640)]
    with Image.open(io.BytesIO(photos[1])) as image:
        assert image.format == "JPEG"
        with pytest.raises(OSError):
            image.load()  # PIL's decoder refuses it too
    device = _transform("device", False)
    skips = SkipCounter("train")
    samples = [(decode_rgb(io.BytesIO(d), device), torch.tensor([i])) for i, d in enumerate(photos)]
    batch, _ = collate_samples(samples, skips.key)
    batch = pickle.loads(pickle.dumps(batch))  # as it comes from a worker process
    pixels = batch.to("cpu")
    assert torch.equal(pixels[1], pixels[2]) and not torch.equal(pixels[0], pixels[2])
    assert skips.snapshot()["bad_image"] == 1
    assert "skipped a sample (bad_image)" in caplog.text
    only_bad, _ = collate_samples(samples[1:2], skips.key)
    with pytest.raises(UserError, match="no JPEG of a batch of 1 could be decoded"):
        only_bad.to("cpu")


@pytest.mark.slow
def test_cpu_only_augmentations_are_refused_with_device_decoding(tmp_path):
    _photo_shards(tmp_path, shards=2, per_shard=2)
    for aug in (["color_jitter=0.4"], ["gray_scale_prob=0.2"], ["use_timm=True"]):
        with pytest.raises(UserError, match="--image-decode device"):
            image_transform(224, True, MEAN, STD, aug_cfg=aug, decode="device")
    out = python_train(["--model", "test-tiny", "--train-data", str(tmp_path / "p-{0..1}.tar"), "--dataset-type",
                        "webdataset", "--train-num-samples", "8", "--image-decode", "device", "--aug-cfg",
                        "color_jitter=0.4", "--logs", str(tmp_path / "logs")])  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("bigclip: error: --image-decode device crops and resizes")
    assert not (tmp_path / "logs").exists()


def _photo_shards(directory, shards: int = 3, per_shard: int = 8) -> list[str]:
    """JPEG photographs of varied sizes and crops (a PNG among them), numbered captions."""
    paths, number = [], 0
    for s in range(shards):
        path = str(directory / f"p-{s}.tar")
        with wds.TarWriter(path) as sink:
            for _ in range(per_shard):
                data = _photo_jpeg(number % 2, 300 + 97 * number, square=number % 3 == 0)
                key = "png" if number == 5 else "jpg"
                sink.write({"__key__": f"{number:06d}", key: _png(data) if key == "png" else data, "txt": str(number)})
                number += 1
        paths.append(path)
    return paths


def _stream(plan, transform, quota: int) -> ShardStream:
    stream = ShardStream(plan, ShardReader(), transform, lambda texts: torch.tensor([[int(t)] for t in texts]),
                         SkipCounter("train"), batch_size=4, rank=0, world_size=1, workers=2, train=True,
                         batches_per_worker=quota)  # fmt: skip
    stream.shuffle_buffer, stream.shuffle_initial = 12, 4
    return stream


def _epoch(loader) -> list[tuple[list[int], torch.Tensor]]:
    return [(texts[:, 0].tolist(), images.to("cpu")) for images, texts in loader]


@pytest.mark.slow
@pytest.mark.parametrize("resampled", [False, True])
def test_loader_batches_keep_their_samples_and_order_and_resume_exactly(tmp_path, resampled):
    """Two workers: the same samples in the same batches as full decoding, the images within resampling noise
    (the workers' generators seeded alike, so the same crops); a position saved mid-epoch resumes with the same
    samples."""
    plan = ShardPlan.build([_photo_shards(tmp_path)], None, resampled=resampled, seed=5)

    def loader(decode: str) -> StatefulDataLoader:
        stream = _stream(plan, _transform(decode, True), quota=3)
        return StatefulDataLoader(stream, batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(1))

    full, device = _epoch(loader("full")), _epoch(loader("device"))
    assert [n for n, _ in device] == [n for n, _ in full] and len(full) == (6 if resampled else 5)
    for (_, a), (_, b) in zip(full, device, strict=True):
        assert ((a - b).abs() * GREY_LEVELS).mean() < 0.5
    first = loader("device")
    it = iter(first)
    head = [next(it) for _ in range(2)]
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    del it, first
    again = loader("device")
    again.load_state_dict(saved)
    rest = _epoch(again)
    assert [t[:, 0].tolist() for _, t in head] + [n for n, _ in rest] == [n for n, _ in device]
    assert all(image.shape == (4, 3, 224, 224) for _, image in rest)


def test_reduced_training_batches_are_normalised_into_the_batch_or_where_moved(tmp_path):
    """--image-decode reduced as a run builds it: two workers normalise their 8-bit images straight into the batch
    (a CPU run: the same floats as the transform that normalises each image, bit for bit), or hand over PixelBatches
    of uint8 pixels (a GPU run: a quarter of the float batch's bytes), whose `.to()` gives those floats (float32
    rounding apart), in the weights' dtype when asked; a PNG among them."""
    plan = ShardPlan.build([_photo_shards(tmp_path)], None, resampled=False, seed=5)

    def loader(at: str) -> StatefulDataLoader:
        transform = image_transform(224, True, MEAN, STD, decode="reduced", normalize_at=at)
        stream = _stream(plan, transform, quota=3)
        return StatefulDataLoader(stream, batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(1))

    floats, batched, shipped = _epoch(loader("image")), list(loader("batch")), list(loader("device"))
    assert len(shipped) == len(batched) == len(floats) == 5
    for (images, texts), (batch, _), (numbers, reference) in zip(shipped, batched, floats, strict=True):
        assert torch.equal(batch, reference)
        assert isinstance(images, PixelBatch) and images.pixels.dtype == torch.uint8 and len(images) == 4
        assert texts[:, 0].tolist() == numbers
        assert torch.allclose(images.to("cpu"), reference, rtol=0, atol=1e-6)
        assert images.to("cpu", torch.bfloat16).dtype == torch.bfloat16


def test_a_gpu_runs_training_loader_hands_over_8_bit_batches_and_a_cpu_runs_float_ones(tmp_path):
    """build_data, as a run calls it: for a rank on a GPU the reduced training batches are PixelBatches (nothing is
    put on the GPU here: the loader only reads the rank's device), for a rank on a CPU float tensors; the same
    images either way once moved. Validation stays float."""
    import dataclasses

    from bigclip.build import build_data
    from bigclip.data.config import DataConfig
    from bigclip.dist import World
    from bigclip.model.config import ModelConfig

    _photo_shards(tmp_path, shards=2, per_shard=4)
    shards = f"{tmp_path}/p-{{0..1}}.tar"
    data = dataclasses.replace(
        DataConfig(), train_data=shards, val_data=shards, train_num_samples=8, val_num_samples=8,
        dataset_type="webdataset", batch_size=4, workers=0, seed=3, image_decode="reduced",
    )  # fmt: skip
    batches = {}
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        loaders, _ = build_data(ModelConfig(model="test-tiny"), data, World(device=torch.device(device)), epoch=0)
        batches[device] = [images for images, _ in loaders["train"].dataloader]
        assert all(isinstance(images, torch.Tensor) for images, _ in loaders["val"].dataloader)
    assert len(batches["cuda"]) == len(batches["cpu"]) == 2
    for shipped, floats in zip(batches["cuda"], batches["cpu"], strict=True):
        assert isinstance(shipped, PixelBatch) and isinstance(floats, torch.Tensor)
        assert torch.allclose(shipped.to("cpu"), floats, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_run_with_device_decoding_trains_and_evaluates_like_full_decoding(tmp_path):
    """Training and validation shards, two workers: every step's loss and the validation loss within resampling
    noise of --image-decode full."""
    train = _photo_shards(tmp_path, shards=2)
    metrics = {}
    for decode in ("full", "device"):
        out = python_train(["--model", "test-tiny", "--train-data", f"{tmp_path}/p-{{0..1}}.tar", "--dataset-type",
                            "webdataset", "--train-num-samples", "16", "--val-data", train[0], "--val-num-samples",
                            "8", "--batch-size", "4", "--workers", "2", "--epochs", "1", "--precision", "fp32",
                            "--seed", "3", "--log-every-n-steps", "1", "--image-decode", decode,
                            "--logs", str(tmp_path / "logs"), "--name", decode])  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        metrics[decode] = read_metrics(str(tmp_path / "logs" / decode))
    losses = {d: [r["loss"] for r in m if "loss" in r] for d, m in metrics.items()}
    assert len(losses["full"]) == 4 and losses["full"] != losses["device"]  # really decoded differently
    assert losses["device"] == pytest.approx(losses["full"], rel=2e-4)  # measured 1e-5
    evals = {d: next(r for r in m if "eval/val_loss" in r) for d, m in metrics.items()}
    assert evals["device"]["eval/val_loss"] == pytest.approx(evals["full"]["eval/val_loss"], rel=2e-4)


@pytest.mark.slow
def test_zero_shot_folders_are_decoded_on_the_device_in_their_batches(tmp_path):
    """The ImageNet-folder loader (1000 class folders, JPEGs and a PNG): its batches carry the labels in order
    and the images as full decoding makes them, within a grey level."""
    import numpy as np

    from bigclip.data.config import DataConfig
    from bigclip.data.imagenet import build_zeroshot_sets

    rng = np.random.default_rng(0)
    for i in range(1000):
        folder = tmp_path / "val" / f"n{i:08d}"
        folder.mkdir(parents=True)
        smooth = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((80, 60), Image.BICUBIC)
        smooth.save(folder / ("img.png" if i == 7 else "img.jpg"), quality=92)
    batches = {}
    for decode in ("full", "device"):
        cfg = DataConfig(imagenet_val=str(tmp_path / "val"), batch_size=250, workers=0)
        loader = build_zeroshot_sets(cfg, image_transform(32, False, MEAN, STD, decode=decode), 0, 1)
        batches[decode] = [(images.to("cpu"), labels) for images, labels in loader["imagenet-zeroshot-val"].dataloader]
    assert len(batches["device"]) == 4
    for (a, la), (b, lb) in zip(batches["full"], batches["device"], strict=True):
        assert torch.equal(la, lb) and a.shape == b.shape == (250, 3, 32, 32)
        assert ((a - b).abs() * GREY_LEVELS).mean() < 1.0
