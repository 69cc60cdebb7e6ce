"""The data package with real files: PNG/JPEG images, CSV files, .tar shards, DataLoader workers."""

from __future__ import annotations

import dataclasses
import io
import os
import tarfile
import warnings

import numpy as np
import open_clip
import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms import InterpolationMode

from bigclip.data import (
    DIGIT_CLASSNAMES,
    DIGIT_TEMPLATES,
    DataConfig,
    DataInfo,
    get_data,
    image_transform,
    parse_aug_cfg,
    resolve_dataset_type,
)
from bigclip.data.digits import digit_caption, load_digit_split
from bigclip.data.sampler import ShardedBatchSampler
from bigclip.data.skips import SkipCounter
from bigclip.dist import World
from bigclip.errors import UserError
from bigclip.evaluation.validate import check_val_count
from bigclip.model.tokenizer import ByteTokenizer

SIZE = 8
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
TOKENIZER = ByteTokenizer(context_length=24)
PREPROCESS = image_transform(SIZE, False, MEAN, STD)
PREPROCESS_CFG = {"size": (SIZE, SIZE), "mean": MEAN, "std": STD}


def make_cfg(**overrides) -> DataConfig:
    base = dict(workers=0, batch_size=2, seed=0)
    return dataclasses.replace(DataConfig(), **{**base, **overrides})


def load(cfg, rank=0, world_size=1, epoch=0) -> dict:
    return get_data(
        cfg,
        PREPROCESS,
        PREPROCESS,
        TOKENIZER,
        rank=rank,
        world_size=world_size,
        epoch=epoch,
        preprocess_cfg=PREPROCESS_CFG,
    )


def captions_of(batches) -> list[str]:
    return [TOKENIZER.decode(row) for _, tokens in batches for row in tokens]


def png_bytes(shade: int, size=(12, 10), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (shade, 255 - shade, 7)).save(buf, format=fmt)
    return buf.getvalue()


def write_csv(folder, rows: list[tuple[str, str]], sep="\t", name="data.csv") -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(f"filepath{sep}title\n")
        for image, caption in rows:
            f.write(f"{image}{sep}{caption}\n")
    return path


def image_files(folder, n: int) -> list[str]:
    paths = []
    for i in range(n):
        path = os.path.join(folder, f"img{i}.png")
        with open(path, "wb") as f:
            f.write(png_bytes(20 * i))
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------ synthetic
def test_synthetic_is_deterministic_and_shaped():
    cfg = make_cfg(dataset_type="synthetic", train_num_samples=12, batch_size=4)
    first, second = load(cfg)["train"], load(cfg)["train"]
    assert first.num_batches == 3 and first.num_samples == 12
    a, b = list(first.dataloader), list(second.dataloader)
    assert len(a) == 3
    for (ia, ta), (ib, tb) in zip(a, b):
        assert ia.shape == (4, 3, SIZE, SIZE) and ia.dtype == torch.float32
        assert ta.shape == (4, 24) and ta.dtype == torch.long
        assert torch.equal(ia, ib) and torch.equal(ta, tb)
        assert (ta[:, 0] == 257).all() and (ta.argmax(dim=1) == (ta == 258).float().argmax(dim=1)).all()
    first.set_epoch(1)
    assert not torch.equal(next(iter(first.dataloader))[0], a[0][0])  # reshuffled for epoch 1


def test_synthetic_default_length():
    assert load(make_cfg(dataset_type="synthetic", batch_size=10))["train"].num_samples == 1000


# ---------------------------------------------------------------------------------------------- CSV
def test_csv_happy_path(tmp_path):
    images = image_files(tmp_path, 6)
    path = write_csv(tmp_path, [(p, f"caption {i}") for i, p in enumerate(images)])
    data = load(make_cfg(train_data=path, val_data=path, batch_size=4))
    train, val = data["train"], data["val"]
    assert train.num_batches == 1 and len(list(train.dataloader)) == 1
    batches = list(val.dataloader)
    assert [len(b[0]) for b in batches] == [4, 2]  # evaluation keeps the partial batch
    assert captions_of(batches) == [f"caption {i}" for i in range(6)]
    assert batches[0][0].shape == (4, 3, SIZE, SIZE)
    assert sum(train.skipped().values()) == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_csv_bad_samples_are_replaced_and_counted(tmp_path, workers):
    images = image_files(tmp_path, 8)
    with open(images[5], "wb") as f:
        f.write(b"\x89PNG not really an image")
    rows = [(p, f"caption {i}") for i, p in enumerate(images)]
    rows[2] = (str(tmp_path / "gone.png"), "caption 2")  # image file missing
    rows[6] = (images[6], "")  # caption missing
    path = write_csv(tmp_path, rows)
    info = load(make_cfg(train_data=path, val_data=path, batch_size=4, workers=workers))["val"]
    batches = list(info.dataloader)
    assert [len(b[0]) for b in batches] == [4, 4]  # sizes never shrink
    # Each bad sample is replaced by the next readable one: 2->3, 5->7 (6 is bad too), 6->7.
    assert captions_of(batches) == [f"caption {i}" for i in (0, 1, 3, 3, 4, 7, 7, 7)]
    assert info.skipped() == {
        "missing_image": 1,
        "bad_image": 1,
        "missing_caption": 1,
        "read_error": 0,
        "dropped": 0,
        "too_large": 0,
    }
    list(info.dataloader)
    assert info.skipped()["missing_image"] == 2  # cumulative across epochs


def test_csv_training_batches_stay_full_with_bad_samples(tmp_path):
    images = image_files(tmp_path, 8)
    rows = [(p, f"caption {i}") for i, p in enumerate(images)]
    rows[0] = ("nowhere.png", "caption 0")
    info = load(make_cfg(train_data=write_csv(tmp_path, rows), batch_size=4, workers=2))["train"]
    assert [len(b[0]) for b in info.dataloader] == [4, 4]
    assert info.skipped()["missing_image"] == 1


def test_csv_relative_paths_beside_the_file_and_other_separator(tmp_path):
    image_files(tmp_path, 2)
    path = write_csv(tmp_path, [("img0.png", "zero"), ("img1.png", "one")], sep=",", name="d.tsv")
    info = load(make_cfg(train_data=path, csv_separator=",", batch_size=2))["train"]
    assert sorted(captions_of(info.dataloader)) == ["one", "zero"]


def test_csv_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"--train-data .*missing\.csv: file not found"):
        load(make_cfg(train_data=str(tmp_path / "missing.csv")))
    path = write_csv(tmp_path, [("a.png", "x")])
    with pytest.raises(UserError, match="--csv-img-key image: no such column"):
        load(make_cfg(train_data=path, csv_img_key="image"))
    with pytest.raises(UserError, match="--batch-size 4"):
        load(make_cfg(train_data=path, batch_size=4))
    with pytest.raises(UserError, match="--csv-separator"):
        load(make_cfg(train_data=path, csv_separator=";;"))


# ---------------------------------------------------------------------------------------- webdataset
def write_shard(path, samples: list[dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            key = sample["__key__"]
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture()
def shards(tmp_path):
    """Two shards, 10 samples: 8 good, one undecodable image, one without caption."""
    for shard in range(2):
        samples = []
        for i in range(5):
            n = shard * 5 + i
            fmt, ext = (("JPEG", "jpg"), ("PNG", "png"))[n % 2]
            samples.append({"__key__": f"s{n:03d}", ext: png_bytes(n * 20, fmt=fmt), "txt": f"sample {n}".encode()})
        samples[1]["png" if samples[1].get("png") else "jpg"] = b"garbage bytes"  # s001 / s006
        if shard == 1:
            del samples[3]["txt"]  # s008
        write_shard(tmp_path / f"shard-{shard}.tar", samples)
    return str(tmp_path / "shard-{0..1}.tar")


GOOD = sorted(f"sample {n}" for n in range(10) if n not in (1, 6, 8))


def test_webdataset_eval_reads_every_good_sample_once(shards):
    info = load(make_cfg(val_data=shards, batch_size=3))["val"]
    assert sorted(captions_of(info.dataloader)) == GOOD
    assert info.skipped() == {
        "missing_image": 0,
        "bad_image": 2,
        "missing_caption": 1,
        "read_error": 0,
        "dropped": 0,
        "too_large": 0,
    }


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_training_epoch_reads_each_shard_once(shards, workers):
    """Without resampling an epoch ends when the shards do: 7 usable samples -> 2 batches of 3, 1 dropped
    (with 2 workers each reads one shard: 4 + 3 usable -> 1 + 1 batches, 1 + 0 dropped)."""
    cfg = make_cfg(train_data=shards, train_num_samples=30, batch_size=3, workers=workers)
    info = load(cfg)["train"]
    assert info.num_batches == 10 and info.num_samples == 30 and info.ends_early
    batches = list(info.dataloader)
    assert len(batches) == 2 and all(b[0].shape == (3, 3, SIZE, SIZE) for b in batches)
    assert set(captions_of(batches)) <= set(GOOD) and len(set(captions_of(batches))) == 6
    skipped = info.skipped()
    assert skipped["bad_image"] == 2 and skipped["missing_caption"] == 1 and skipped["dropped"] == 1
    again = list(load(cfg)["train"].dataloader)
    assert captions_of(again) == captions_of(batches)  # same seed, same epoch: same stream


@pytest.mark.parametrize("workers", [0, 2])
def test_a_webdataset_training_loader_closes_after_use(shards, workers):
    """--workers 0, the usual debugging setting, trained and then ended with a traceback at close: its
    single-process iterator has no workers to shut down."""
    info = load(make_cfg(train_data=shards, train_num_samples=30, batch_size=3, workers=workers))["train"]
    assert len(next(iter(info.dataloader))[0]) == 3
    info.close()
    assert getattr(info.dataloader, "_iterator", None) is None


def test_a_webdataset_loader_is_built_without_torchdatas_deprecation_warning(shards):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(make_cfg(train_data=shards, train_num_samples=30, batch_size=3, workers=0))
    assert not [w for w in caught if "set_vital" in str(w.message)]


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_resampled_training_fills_the_epoch(shards, workers):
    cfg = make_cfg(train_data=shards, train_num_samples=30, batch_size=3, workers=workers, dataset_resampled=True)
    info = load(cfg)["train"]
    batches = list(info.dataloader)
    assert len(batches) == 10 and not info.ends_early
    assert set(captions_of(batches)) <= set(GOOD)
    assert captions_of(list(load(cfg)["train"].dataloader)) == captions_of(batches)


def test_webdataset_two_ranks_disjoint_equal(shards):
    cfg = make_cfg(val_data=shards, train_data=shards, train_num_samples=6, batch_size=3)
    seen = [captions_of(load(cfg, rank=r, world_size=2)["val"].dataloader) for r in range(2)]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == GOOD
    train = [list(load(cfg, rank=r, world_size=2)["train"].dataloader) for r in range(2)]
    assert [len(t) for t in train] == [1, 1] and all(len(t[0][0]) == 3 for t in train)


def test_webdataset_position_restores_the_rest_of_the_epoch(tmp_path):
    """DataInfo.position() after some batches, restored into a fresh loader: exactly the batches that were
    still to come (the stream's own tests cover resampling and every cut)."""
    for shard in range(4):
        write_shard(
            tmp_path / f"c{shard}.tar",
            [{"__key__": f"k{shard}{i}", "png": png_bytes(i), "txt": f"clean {shard} {i}".encode()} for i in range(4)],
        )
    cfg = make_cfg(train_data=str(tmp_path / "c{0..3}.tar"), train_num_samples=16, batch_size=2, workers=2)
    info = load(cfg, epoch=3)["train"]
    full = captions_of(info.dataloader)
    assert len(full) == 16
    info.set_epoch(3)
    it = iter(info.dataloader)
    head = [next(it) for _ in range(3)]
    position = info.position()
    del it
    again = load(cfg, epoch=0)["train"]
    again.restore(position)
    again.set_epoch(3, skip_batches=3)
    assert captions_of(head) + captions_of(again.dataloader) == full
    other_epoch = load(cfg, epoch=0)["train"]
    other_epoch.restore(position)
    other_epoch.set_epoch(4)  # a position of epoch 3 does not apply to epoch 4
    assert len(captions_of(other_epoch.dataloader)) == 16


def test_webdataset_without_resampling_needs_a_shard_per_reader(shards):
    with pytest.raises(UserError, match=r"2 shards for 4 readers .*--dataset-resampled"):
        load(make_cfg(train_data=shards, train_num_samples=8, workers=2), rank=0, world_size=2)
    assert load(make_cfg(train_data=shards, train_num_samples=8, workers=2, dataset_resampled=True), world_size=2)


def test_webdataset_user_errors(tmp_path, shards):
    with pytest.raises(UserError, match="--train-num-samples"):
        load(make_cfg(train_data=shards))
    with pytest.raises(UserError, match=r"--train-data .*shard-2\.tar: shard not found"):
        load(make_cfg(train_data=shards.replace("1}", "2}"), train_num_samples=4))
    # Several sources joined with '::' concatenate.
    joined = f"{shards}::{shards}"
    both = load(make_cfg(val_data=joined, batch_size=4))["val"]
    assert sorted(captions_of(both.dataloader)) == sorted(GOOD * 2)


# ------------------------------------------------------------------------------------ type detection
@pytest.mark.parametrize(
    "path, kind",
    [
        ("a/train.csv", "csv"),
        ("b.TSV", "csv"),
        ("s/{000..009}.tar", "webdataset"),
        ("x/{a,b}.tar::y/c.tar", "webdataset"),
    ],
)
def test_auto_dataset_type(path, kind):
    assert resolve_dataset_type(path, "auto", "--train-data") == kind
    assert resolve_dataset_type(path, "synthetic", "--train-data") == "synthetic"


@pytest.mark.parametrize("path", ["data.parquet", "a.csv::b.tar", "{a.tar,b.txt}"])
def test_auto_dataset_type_errors(path):
    with pytest.raises(UserError, match=r"--val-data .*--dataset-type"):
        resolve_dataset_type(path, "auto", "--val-data")


# ------------------------------------------------------------------------------------------ sharding
def test_two_rank_training_batches_are_disjoint_and_equal():
    per_rank = []
    for rank in range(2):
        sampler = ShardedBatchSampler(23, batch_size=4, rank=rank, world_size=2, seed=5)
        sampler.set_epoch(2)
        per_rank.append(list(sampler))
    assert [len(b) for b in per_rank] == [2, 2]
    assert all(len(batch) == 4 for batches in per_rank for batch in batches)
    flat = [i for batches in per_rank for batch in batches for i in batch]
    assert len(set(flat)) == 16
    cfg = make_cfg(dataset_type="synthetic", train_num_samples=16, batch_size=4)
    loaders = [load(cfg, rank=r, world_size=2)["train"].dataloader for r in range(2)]
    images = [torch.cat([b[0] for b in loader]) for loader in loaders]
    assert images[0].shape == images[1].shape == (8, 3, SIZE, SIZE)
    assert not any(torch.equal(x, y) for x in images[0] for y in images[1])


def test_eval_sharding_covers_every_sample_once_with_equal_batch_counts():
    samplers = [ShardedBatchSampler(21, batch_size=4, rank=r, world_size=2, train=False) for r in range(2)]
    batches = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [3, 3]
    assert len(batches[0]) == len(batches[1]) == 3
    flat = sorted(i for rank in batches for b in rank for i in b)
    assert flat == list(range(21))


def test_skip_batches_continues_the_same_epoch():
    sampler = ShardedBatchSampler(40, batch_size=4, seed=1)
    sampler.set_epoch(7)
    full = list(sampler)
    sampler.set_epoch(7, skip_batches=4)
    assert list(sampler) == full[4:] and len(sampler) == len(full) - 4


# ---------------------------------------------------------------------------------------------- demo
@pytest.mark.slow
def test_digits_split_is_fixed_stratified_and_disjoint():
    a, b = load_digit_split(), load_digit_split()
    assert len(a.train_labels) == 1437 and len(a.heldout_labels) == 360
    assert torch.equal(a.heldout_indices, b.heldout_indices) and torch.equal(a.train_images, b.train_images)
    assert not set(a.train_indices.tolist()) & set(a.heldout_indices.tolist())
    per_class = torch.bincount(a.heldout_labels, minlength=10)
    assert per_class.min() >= 35 and per_class.max() <= 37
    assert a.train_images.shape == (1437, 8, 8) and 0 <= a.train_images.min() and a.train_images.max() == 1


def test_digits_loaders():
    cfg = make_cfg(demo=True, batch_size=64)
    tokenizer = ByteTokenizer(context_length=32)
    size_cfg = {"size": (16, 16), "mean": MEAN, "std": STD}
    data = get_data(cfg, None, None, tokenizer, preprocess_cfg=size_cfg)
    assert data["classnames"] == DIGIT_CLASSNAMES and data["templates"] == DIGIT_TEMPLATES
    assert digit_caption(7) == DIGIT_TEMPLATES[0].format("seven")
    train = data["train"]
    assert train.num_batches == 1437 // 64
    images, tokens = next(iter(train.dataloader))
    assert images.shape == (64, 3, 16, 16) and tokens.shape == (64, 32)
    assert torch.allclose(images[:, 0], images[:, 2])  # grey replicated to three channels
    assert images.min() == pytest.approx((0 - 0.5) / 0.25)  # background is 0, normalised
    assert {tokenizer.decode(t) for t in tokens} <= {digit_caption(c) for c in range(10)}
    again = next(iter(get_data(cfg, None, None, tokenizer, preprocess_cfg=size_cfg)["train"].dataloader))
    assert torch.equal(again[0], images)
    shots = list(data["zeroshot"].dataloader)
    labels = torch.cat([s[1] for s in shots])
    assert len(labels) == 360 and labels.dtype == torch.long and labels.max() == 9
    assert sum(len(b[0]) for b in data["val"].dataloader) == 360
    with pytest.raises(UserError, match="--force-context-length 16"):
        get_data(cfg, None, None, ByteTokenizer(context_length=16), preprocess_cfg=size_cfg)


# ----------------------------------------------------------------------------------------- transforms
def test_parse_aug_cfg_values_and_errors():
    cfg = parse_aug_cfg(
        ["scale=(0.5,1.0)", "ratio_range=0.75::1.33", "use_timm=True", "re_prob=0.25", "re_count=2", "color_jitter=0.4"]
    )
    assert cfg == {
        "scale": (0.5, 1.0),
        "ratio": (0.75, 1.33),
        "use_timm": True,
        "re_prob": 0.25,
        "re_count": 2,
        "color_jitter": 0.4,
    }
    for bad, message in [
        ("sharpness=2", "unknown key"),
        ("scale", "expected key=value"),
        ("scale=1.0::0.5", "low <= high"),
        ("gray_scale_prob=2", "probability"),
        ("use_timm=maybe", "true or false"),
        ("re_count=0", ">= 1"),
    ]:
        with pytest.raises(UserError, match=f"--aug-cfg .*{message}"):
            parse_aug_cfg([bad])


@pytest.mark.parametrize("resize_mode", ["shortest", "longest", "squash"])
def test_image_transform_shapes(resize_mode):
    image = Image.new("L", (40, 20), 200)  # grey, wide
    out = image_transform((16, 12), False, MEAN, STD, "bilinear", resize_mode)(image)
    assert out.shape == (3, 16, 12)
    if resize_mode == "longest":
        assert out[:, 0].min() == pytest.approx(-2.0)  # letterbox padding is black
    aug = {"scale": (0.5, 1.0), "gray_scale_prob": 0.5, "color_jitter": (0.2, 0.2, 0.2, 0.1)}
    train = image_transform(16, True, MEAN, STD, "random", aug_cfg=aug)
    assert train(image).shape == (3, 16, 16)
    timm = image_transform(16, True, MEAN, STD, aug_cfg=["use_timm=true", "re_prob=0.5"])
    assert timm(image).shape == (3, 16, 16)
    with pytest.raises(UserError, match="--image-resize-mode"):
        image_transform(16, False, MEAN, STD, resize_mode="fit")


def test_datainfo_without_counters():
    info = DataInfo(dataloader=[], num_samples=0, num_batches=0)
    assert set(info.skipped().values()) == {0}


def test_webdataset_truncated_shard_is_counted(tmp_path, shards):
    # Members are 512-byte header + 512-byte data here: cut inside the third member's data (s006.png).
    whole = (tmp_path / "shard-1.tar").read_bytes()
    (tmp_path / "shard-1.tar").write_bytes(whole[: 2 * 1024 + 700])
    info = load(make_cfg(val_data=shards, batch_size=3))["val"]
    assert sorted(captions_of(info.dataloader)) == [f"sample {n}" for n in (0, 2, 3, 4, 5)]
    assert info.skipped()["read_error"] == 1


def test_webdataset_training_without_any_usable_sample(tmp_path):
    """Resampling would draw shards for ever: it stops with one line. Read once, the epoch is just empty (the
    training loop then stops the run: tests/test_cli_runs.py)."""
    bad = [{"__key__": f"b{i}", "jpg": b"no jpeg", "txt": b"x"} for i in range(3)]
    write_shard(tmp_path / "bad.tar", bad)
    cfg = make_cfg(train_data=str(tmp_path / "bad.tar"), train_num_samples=4, dataset_resampled=True)
    info = load(cfg)["train"]
    info.sampler.max_unusable_before_first = 50  # give up sooner than 10000 samples
    with pytest.raises(UserError, match="no usable sample"):
        next(iter(info.dataloader))
    once = load(dataclasses.replace(cfg, dataset_resampled=False))["train"]
    assert list(once.dataloader) == [] and once.skipped()["bad_image"] == 3


def test_eval_transform_equals_openclips_on_a_4_3_image():
    """500x375 is ImageNet's most common shape: bigclip's eval preprocessing must give OpenCLIP's pixels."""

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8))
    ours = image_transform((224, 224), False, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
    theirs = open_clip.image_transform(224, is_train=False)
    assert torch.equal(ours(image), theirs(image))


def _said_in_a_child(skips: SkipCounter, lines: list[str], out) -> None:
    out.put([skips._first_time(line) for line in lines])


def test_a_skip_repeated_by_every_worker_is_said_once_and_counted_each_time(caplog):
    """A corrupt shard drawn again and again by each worker of a resampled stream: one warning line for the
    loader (its processes share what was said), every occurrence counted; at most 5 distinct lines."""
    import multiprocessing

    skips = SkipCounter("train")
    with caplog.at_level("WARNING", logger="bigclip"):
        for _ in range(10):
            skips.count("read_error", "shard_failed: bad.tar: ReadError")
    assert caplog.text.count("skipped a sample (read_error) shard_failed: bad.tar") == 1
    same = "train data: skipped a sample (read_error) shard_failed: bad.tar: ReadError"
    context = multiprocessing.get_context("fork")  # as DataLoader starts its workers here
    out = context.Queue()
    child = context.Process(target=_said_in_a_child, args=(skips, [same, "new in the worker"], out))
    child.start()
    assert out.get(timeout=60) == [False, True]  # the worker sees what the main process said, and says its own
    child.join()
    assert not skips._first_time("new in the worker")  # ...which the main process now knows too
    assert [skips._first_time(f"line {i}") for i in range(5)] == [True, True, True, False, False]  # 5 in all
    assert skips.snapshot()["read_error"] == 10


def test_validation_count_is_checked_against_val_num_samples(caplog):
    skips = SkipCounter("val")
    skips.count("bad_image", n=2)
    val = DataInfo(dataloader=[], num_samples=0, num_batches=0, skips=skips)
    with caplog.at_level("WARNING", logger="bigclip"):
        check_val_count(10, val, 12, World())  # 10 evaluated + 2 unusable: every sample accounted for
        assert "validation:" not in caplog.text
        check_val_count(9, val, 12, World())
    assert "9 samples evaluated and 2 skipped as unusable, but --val-num-samples is 12" in caplog.text


def test_the_default_worker_count_fits_the_cpus_and_draws_no_pytorch_warning():
    from bigclip.data.config import DataConfig
    from bigclip.data.workers import worker_loader

    workers = DataConfig().workers
    assert workers == min(4, len(os.sched_getaffinity(0)))  # OpenCLIP's 4, unless this process has fewer CPUs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker_loader(list(range(8)), workers, batch_size=2)
    assert not [w for w in caught if "worker" in str(w.message)], [str(w.message) for w in caught]


# --- reduced JPEG decoding (--image-decode reduced) -----------------------------------------------------------------


def _photo_jpeg(index: int, long_side: int, square: bool = False) -> bytes:
    """scikit-learn's two sample photographs (640x427; or their centre square), resized so the long side is
    `long_side`, as JPEG q92."""
    from sklearn.datasets import load_sample_images

    image = Image.fromarray(load_sample_images().images[index])
    if square:  # RandomResizedCrop's default scale (0.9, 1) mostly falls back to its centre crop on a 3:2 image
        image = image.crop((106, 0, 533, 427))
    scale = long_side / max(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=92)
    return out.getvalue()


def _both_decodes(data: bytes, train: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(full decode, reduced decode, whether both drew the same random numbers) of one encoded image."""
    from bigclip.data.decode import decode_rgb

    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    out, states = [], []
    for decode in ("full", "reduced"):
        torch.manual_seed(seed)
        out.append(decode_rgb(io.BytesIO(data), image_transform(224, train, mean, std, decode=decode)))
        states.append(torch.get_rng_state())
    return out[0], out[1], torch.equal(*states)


@pytest.mark.slow
@pytest.mark.parametrize("train", [False, True])
def test_reduced_decoding_crops_like_openclip_and_stays_within_resampling_noise(train):
    """Photographs of 1024 and 2048 px (3:2 and square): the same crops (the same random numbers drawn, the crops
    differing between seeds), the final tensors within 3 grey levels of full decoding on average (measured
    0.4-2.3: libjpeg's DCT downscale before the bicubic resize, instead of the bicubic resize alone); the
    reduction really happens."""
    from torchvision.transforms import InterpolationMode

    from bigclip.data.transforms import ReducedResize

    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    for long_side in (1024, 2048):
        for index, square in ((0, False), (1, False), (0, True), (1, True)):
            crops = []
            for seed in range(3):
                full, reduced, same_draws = _both_decodes(_photo_jpeg(index, long_side, square), train, seed)
                assert same_draws
                levels = ((full - reduced).abs() * std * 255).mean().item()
                assert levels < 3.0, (long_side, index, square, seed, levels)
                crops.append(full)
            if train and square:
                assert not torch.equal(crops[0], crops[1])  # the seeds drew different crops
        with Image.open(io.BytesIO(_photo_jpeg(0, long_side))) as image:
            ReducedResize(224, InterpolationMode.BICUBIC)(image)
            assert min(image.size) >= 224 and max(image.size) <= long_side // 2  # decoded at 1/2 or less


def test_reduced_decoding_leaves_small_jpegs_and_other_formats_as_openclip_up_to_the_resizes_rounding():
    """Nothing reduced (a 512-px JPEG: 342 px short side, no 1/2 scale covers 224; a PNG): evaluation's pixels are
    OpenCLIP's exactly; training's crop is resized by torch instead of PIL, which rounds a few pixels the other way
    (measured: at most 1 grey level, 0.001-0.003 on average)."""
    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    png = io.BytesIO()
    Image.open(io.BytesIO(_photo_jpeg(1, 2048))).save(png, "PNG")
    for data in (_photo_jpeg(0, 512), png.getvalue()):
        full, reduced, _ = _both_decodes(data, False)
        assert torch.equal(full, reduced)
        for seed in range(3):
            full, reduced, same_draws = _both_decodes(data, True, seed)
            levels = (full - reduced).abs() * std * 255
            assert same_draws and levels.max() < 1.0 + 1e-3 and levels.mean() < 0.01, (
                seed,
                levels.max(),
                levels.mean(),
            )


def test_jpegs_decode_through_libjpeg_turbo_to_pils_own_pixels_at_every_dct_scale(capfd):
    """data/decode.py's Jpeg (libjpeg-turbo through simplejpeg) gives PIL's pixels bit for bit, whole and at 1/2,
    1/4, 1/8 (PIL's draft), for colour, greyscale and progressive JPEGs. What it does not read as PIL would stays
    with PIL: CMYK (PIL converts it differently), PNG, a JPEG with stray bytes (libjpeg-turbo refuses its header; PIL
    reads it), a truncated one (PIL's error, as before). Nothing is printed to stderr."""
    from bigclip.data.decode import read_jpeg

    def pil(data: bytes, factor: int) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            if factor > 1:
                image.draft("RGB", (image.width // factor, image.height // factor))
            return np.array(image.convert("RGB"))

    def encoded(image: Image.Image, **options) -> bytes:
        out = io.BytesIO()
        image.save(out, "JPEG", quality=92, **options)
        return out.getvalue()

    photo = Image.open(io.BytesIO(_photo_jpeg(1, 1024)))
    kinds = {
        "colour 4:2:0": _photo_jpeg(0, 1024),
        "colour 4:4:4, odd size": encoded(photo.crop((0, 0, 1001, 677)), subsampling=0),
        "greyscale": encoded(photo.convert("L")),
        "progressive": encoded(photo, progressive=True),
    }
    for kind, data in kinds.items():
        jpeg = read_jpeg(data)
        assert jpeg is not None and jpeg.size == Image.open(io.BytesIO(data)).size, kind
        for factor in (1, 2, 4, 8):
            assert np.array_equal(jpeg.decode(factor), pil(data, factor)), (kind, factor)

    good = kinds["colour 4:2:0"]
    scan = good.index(b"\xff\xda")
    stray = good[:scan] + b"\x00\x00\x00" + good[scan:]  # "Corrupt JPEG data: 3 extraneous bytes before marker"
    png = io.BytesIO()
    photo.save(png, "PNG")
    for data in (encoded(photo.convert("CMYK")), png.getvalue(), stray):
        assert read_jpeg(data) is None
    assert read_jpeg(good[: len(good) // 2]).decode() is None  # truncated: PIL's turn (it raises)
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    from bigclip.data.decode import decode_rgb

    for train in (True, False):
        full, reduced = (image_transform(224, train, mean, std, decode=d) for d in ("full", "reduced"))
        torch.manual_seed(0)
        expected = full(Image.open(io.BytesIO(stray)).convert("RGB"))
        torch.manual_seed(0)
        assert decode_rgb(io.BytesIO(stray), full).equal(expected)
        torch.manual_seed(0)
        assert decode_rgb(io.BytesIO(stray), reduced).shape == expected.shape
    with pytest.raises(OSError, match="truncated"):
        decode_rgb(io.BytesIO(good[: len(good) // 2]), image_transform(224, True, mean, std, decode="reduced"))
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_a_jpeg_is_transformed_as_the_pil_opened_image_was():
    """The reduced transforms on a Jpeg (libjpeg-turbo) draw the same crops with the same random numbers as on the
    image PIL opened, with the same pixels: evaluation's bit for bit; a training crop that torch resizes from a
    DCT-reduced image (resized_region) as PIL resized it, up to the two resizers' rounding inside it (measured: at
    most 2 grey levels, 0.016 on average) and, on its outer two pixels, PIL's filter reading on past the crop's
    edge (measured: at most 7). The DCT reduction is chosen alike (1/2 and 1/4 at 1024 and 2048 px)."""
    from bigclip.data.decode import read_jpeg
    from bigclip.data.transforms import ReducedResize, decode_reduced

    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    levels = torch.tensor(std)[:, None, None] * 255
    for long_side in (512, 1024, 2048):
        for index, square in ((0, False), (1, True)):
            data = _photo_jpeg(index, long_side, square)
            for train in (True, False):
                transform = image_transform(224, train, mean, std, aug_cfg={"scale": (0.25, 1.0)}, decode="reduced")
                for seed in range(4):
                    out, states = [], []
                    for image in (Image.open(io.BytesIO(data)), read_jpeg(data)):
                        torch.manual_seed(seed)
                        out.append(transform(image))
                        states.append(torch.get_rng_state())
                    assert torch.equal(*states)
                    if not train:
                        assert torch.equal(*out)
                        continue
                    apart = (out[0] - out[1]).abs() * levels
                    where = (long_side, index, square, seed)
                    assert apart[:, 2:-2, 2:-2].max() <= 2 + 1e-3 and apart.max() <= 8 and apart.mean() < 0.05, where
    data = _photo_jpeg(0, 2048)
    width, height = Image.open(io.BytesIO(data)).size
    pixels, scale = decode_reduced(read_jpeg(data), 4)
    assert scale == 0.25 and pixels.shape == (3, -(-height // 4), -(-width // 4))
    assert ReducedResize(224, InterpolationMode.BICUBIC)(read_jpeg(data)).size == (width * 224 // height, 224)


@pytest.mark.slow
def test_crops_and_regions_are_resized_by_torch_within_rounding_of_pils_resize():
    """torch's uint8 antialiased resize against PIL's on photographs' crops, shrunk as a training crop is:
    resized_crop (whole pixels) and resized_region (a fractional region one of whose ends is whole on each axis:
    the near end, or the far one, the axis flipped) both within the two resizers' rounding of PIL's resize of the
    same pixels (measured: at most 1 grey level at most scales, up to 8 on a few pixels where one axis shrinks by
    less than 1.3; 0.2 on average at most), where a half-pixel misplacement would be several levels on average.
    resized_region declines (None) a region with no whole end on an axis."""
    from torchvision.transforms import InterpolationMode

    from bigclip.data.pixels import resized_crop, resized_region

    filters = {InterpolationMode.BICUBIC: Image.BICUBIC, InterpolationMode.BILINEAR: Image.BILINEAR}
    rng = np.random.default_rng(0)
    worst = []
    for index, long_side in ((1, 512), (0, 1024)):
        photo = Image.open(io.BytesIO(_photo_jpeg(index, long_side))).convert("RGB")
        pixels = torch.from_numpy(np.array(photo)).permute(2, 0, 1)
        for trial in range(24):
            mode = (InterpolationMode.BICUBIC, InterpolationMode.BILINEAR)[trial % 4 // 2]
            region = []
            for length, out in zip(photo.size, (200, 224), strict=True):  # x, y: larger than the output
                span = float(rng.integers(out + 1, length - 8)) + float(rng.choice([0.25, 0.5, 0.75]))
                if trial % 2:  # the far end whole
                    end = int(rng.integers(int(span) + 1, length + 1))
                    region.append((end - span, end))
                else:
                    start = int(rng.integers(0, length - int(span)))
                    region.append((start, start + span))
            (left, right), (top, bottom) = region
            resized = resized_region(pixels, (left, top, right, bottom), (224, 200), mode)
            # PIL on the pixels torch reads (its filter stops where torch's does), the region placed alike in them
            x0, y0 = int(np.floor(left)), int(np.floor(top))
            seen = photo.crop((x0, y0, int(np.ceil(right)), int(np.ceil(bottom))))
            box = (left - x0, top - y0, right - x0, bottom - y0)
            expected = torch.from_numpy(np.array(seen.resize((200, 224), filters[mode], box=box)))
            worst.append((resized.permute(1, 2, 0).int() - expected.int()).abs())
            # whole pixels: the crop as torchvision's resized_crop (OpenCLIP's) cuts it
            crop = (int(top), int(left), int(bottom - top), int(right - left))
            resized = resized_crop(pixels, crop, (224, 200), mode)
            cut = photo.crop((crop[1], crop[0], crop[1] + crop[3], crop[0] + crop[2]))
            expected = torch.from_numpy(np.array(cut.resize((200, 224), filters[mode])))
            worst.append((resized.permute(1, 2, 0).int() - expected.int()).abs())
    assert max(int(apart.max()) for apart in worst) <= 10
    assert max(float(apart.float().mean()) for apart in worst) < 0.3
    assert resized_region(pixels, (10.5, 0, 300.5, 200), (224, 224), InterpolationMode.BICUBIC) is None
    assert resized_region(pixels, (0, 10.5, 200, 300.25), (224, 224), InterpolationMode.BICUBIC) is None


def test_crop_boxes_are_torchvisions_draws():
    """ReducedRandomResizedCrop.box (the header's size only) draws torchvision's RandomResizedCrop.get_params crops
    with the same random numbers, leaving the generator where get_params leaves it; its centre fallback too."""
    from bigclip.data.transforms import ReducedRandomResizedCrop

    rng = np.random.default_rng(0)
    for scale, ratio in (((0.9, 1.0), (3 / 4, 4 / 3)), ((0.08, 1.0), (3 / 4, 4 / 3)), ((0.95, 1.0), (0.5, 0.6))):
        crop = ReducedRandomResizedCrop(224, scale=scale, ratio=ratio)
        for trial in range(60):
            width, height = (int(x) for x in rng.integers(16, 2048, size=2))
            if trial % 10 == 0:
                width, height = 2000, 40  # no draw fits: the centre fallback
            torch.manual_seed(trial)
            expected = torchvision.transforms.RandomResizedCrop.get_params(
                torch.empty(3, height, width), list(scale), list(ratio)
            )
            state = torch.get_rng_state()
            torch.manual_seed(trial)
            assert crop.box(width, height) == tuple(expected), (scale, ratio, width, height)
            assert torch.equal(torch.get_rng_state(), state)


def test_reduced_crops_take_color_jitter_and_grayscale_on_their_8_bit_tensor():
    """--aug-cfg color_jitter and gray_scale_prob follow a reduced crop as torchvision's tensor versions (the same
    random draws as full decoding's PIL versions): measured 0.18 and 0.49 grey levels from full decoding on
    average, at most 3."""
    from bigclip.data.decode import decode_rgb

    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    for aug in (["color_jitter=0.4"], ["color_jitter=(0.4,0.4,0.4,0.1)", "gray_scale_prob=1.0"]):
        out = {}
        for decode in ("full", "reduced"):
            torch.manual_seed(0)
            transform = image_transform(224, True, mean, std, aug_cfg=aug, decode=decode)
            out[decode] = decode_rgb(io.BytesIO(_photo_jpeg(0, 512)), transform)
        levels = (out["full"] - out["reduced"]).abs() * torch.tensor(std)[:, None, None] * 255
        assert levels.mean() < 1.0 and levels.max() <= 3.0 + 1e-3, (aug, levels.mean(), levels.max())
    grey = out["reduced"] * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    assert torch.allclose(grey[0], grey[1], atol=1e-5) and torch.allclose(grey[1], grey[2], atol=1e-5)


def test_image_decode_flag_reaches_the_run_transforms():
    from bigclip.build import build_transforms
    from bigclip.data.transforms import ReducedRandomResizedCrop, ReducedResize
    from bigclip.model.config import ModelConfig

    for decode, expected in (("auto", True), ("reduced", True), ("full", False)):  # auto: reduced without a device
        train, val, _ = build_transforms(ModelConfig(model="test-tiny"), DataConfig(image_decode=decode))
        assert isinstance(train.transforms[0], ReducedRandomResizedCrop) == expected
        assert isinstance(val.transforms[0], ReducedResize) == expected
