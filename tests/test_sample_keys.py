"""OpenCLIP main's --image-key, --text-key, --json-text-key and --json-text-key-probs on real shards read by
ShardStream: which member is the image and which the caption, with fallbacks, and a weighted caption draw that a
resumed run repeats exactly."""

from __future__ import annotations

import json
import pickle

import pytest
import webdataset as wds
from test_wds_stream import WORKERS, _png, loader, number_tokenizer, numbers, to_tensor

from bigclip.config import resolve
from bigclip.data.sample_keys import SampleKeys
from bigclip.data.shards import ShardReader
from bigclip.data.skips import SkipCounter
from bigclip.data.wds_plan import ShardPlan
from bigclip.data.wds_stream import ShardStream
from bigclip.errors import UserError


def write(directory, samples: list[dict], shards: int = 4) -> list[str]:
    paths = []
    for s in range(shards):
        path = str(directory / f"k-{s:03d}.tar")
        with wds.TarWriter(path) as sink:
            for i, sample in enumerate(samples[s::shards]):
                sink.write({"__key__": f"{s:03d}{i:05d}", **sample})
        paths.append(path)
    return paths


def read_all(paths, keys: SampleKeys, quota=None, resampled=False):
    plan = ShardPlan.build([paths], None, resampled=resampled, seed=1)
    s = ShardStream(plan, ShardReader(), to_tensor, number_tokenizer, SkipCounter("test"), batch_size=4,
                    workers=WORKERS, train=quota is not None, batches_per_worker=quota, keys=keys)  # fmt: skip
    s.shuffle_buffer, s.shuffle_initial = 20, 5
    return s


def test_image_and_text_keys_with_alternatives(tmp_path):
    png = _png()
    samples = [{"image": png, "caption": str(n)} for n in range(20)]
    samples += [{"png": png, "txt": str(n)} for n in range(20, 40)]
    samples += [{"image": png, "other": b"40"}]  # no caption under any given key: skipped, counted
    paths = write(tmp_path, samples)
    keys = SampleKeys.from_flags("image;png", "caption;txt", None, None, seed=0)
    s = read_all(paths, keys)
    got = sorted(n for batch in loader(s) for n in numbers(batch))
    assert got == list(range(40))
    assert s.skips.snapshot()["missing_caption"] == 1
    # OpenCLIP's defaults read none of the "image"/"caption" samples
    s = read_all(paths, SampleKeys())
    assert sorted(n for batch in loader(s) for n in numbers(batch)) == list(range(20, 40))


def json_samples(n: int) -> list[dict]:
    png = _png()
    out = []
    for i in range(n):
        fields = {"short": str(i), "long": str(1000 + i) if i % 5 else "  "}  # every 5th: an empty long caption
        out.append({"png": png, "json": json.dumps(fields).encode()})
    return out


def test_json_text_key_takes_the_first_non_empty_field(tmp_path):
    paths = write(tmp_path, json_samples(40))
    keys = SampleKeys.from_flags("png", "txt", "long;short", None, seed=0)
    got = sorted(n for batch in loader(read_all(paths, keys)) for n in numbers(batch))
    assert got == sorted([1000 + i if i % 5 else i for i in range(40)])


def test_json_text_key_probs_draw_by_weight_and_resume_exactly(tmp_path):
    paths = write(tmp_path, json_samples(400))
    keys = SampleKeys.from_flags("png", "txt", "short;long", [1.0, 3.0], seed=5)
    quota = 30  # batches per worker, resampled: an endless stream cut at the same point
    whole = [numbers(b) for b in loader(read_all(paths, keys, quota, resampled=True))]
    drawn = [n for batch in whole for n in batch]
    long_share = sum(n >= 1000 for n in drawn) / len(drawn)
    # long drawn first with P 3/4, except where it is empty (every 5th sample: short as the fallback)
    assert 0.5 < long_share < 0.72, long_share
    again = loader(read_all(paths, keys, quota, resampled=True))
    it = iter(again)
    head = [numbers(next(it)) for _ in range(7)]
    saved = pickle.loads(pickle.dumps(again.state_dict()))
    del it, again
    resumed = loader(read_all(paths, keys, quota, resampled=True))
    resumed.load_state_dict(saved)
    assert head + [numbers(b) for b in resumed] == whole
    # another seed draws other captions for the same samples
    other = SampleKeys.from_flags("png", "txt", "short;long", [1.0, 3.0], seed=6)
    assert [numbers(b) for b in loader(read_all(paths, other, quota, resampled=True))] != whole


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"json_text_key": "a;b", "json_text_key_probs": [1.0, 2.0, 3.0]}, "at most one non-negative weight"),
        ({"json_text_key": "a", "json_text_key_probs": [-1.0]}, "at most one non-negative weight"),
        ({"image_key": ";"}, "--image-key ';': name at least one member suffix"),
    ],
)
def test_bad_key_flags_are_one_line(values, message):
    with pytest.raises(UserError, match=message):
        resolve({"train_data": "s3://bucket/shard-0000.tar", "model": "test-tiny", **values})  # WebDataset's flags


def test_json_text_key_probs_without_json_text_key_runs_with_one_warning():
    """OpenCLIP reads the weights only beside --json-text-key and accepts them without it: the run goes on and says
    so in one line naming the flag (flag_fields.idle), and reads the captions from --text-key."""
    run = resolve({"train_data": "s3://bucket/shard-0000.tar", "model": "test-tiny", "json_text_key_probs": [1.0]})
    assert run.sections.idle_notes == (
        "--json-text-key-probs: only applies with --json-text-key; the flag does nothing in this run",
    )
    assert run.sections.data.sample_keys().json_weights is None


def test_max_image_pixels_skips_by_the_header_before_decoding(tmp_path):
    """--max-image-pixels: a 300x200 image over a 50 000-pixel limit is skipped and counted as too_large. Its body
    is cut short, so decoding it would have failed (bad_image): the header alone decided. CSV rows alike."""
    import io

    from PIL import Image

    from bigclip.data.csv_dataset import CsvDataset
    from bigclip.data.map_style import SampleSkipped

    buf = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 10, 10)).save(buf, format="JPEG")
    whole = buf.getvalue()
    big_truncated = whole[: whole.index(b"\xff\xda") + 40]  # headers up to the scan's start, pixels cut short
    png = _png()
    paths = write(tmp_path, [{"jpg": big_truncated, "txt": b"99"}] + [{"png": png, "txt": str(n)} for n in range(7)])
    plan = ShardPlan.build([paths], None, resampled=False, seed=1)
    s = ShardStream(plan, ShardReader(), to_tensor, number_tokenizer, SkipCounter("test"), batch_size=4,
                    workers=WORKERS, train=False, max_pixels=50_000)  # fmt: skip
    assert sorted(n for batch in loader(s) for n in numbers(batch)) == list(range(7))
    counts = s.skips.snapshot()
    assert counts["too_large"] == 1 and counts["bad_image"] == 0
    # without the limit the same sample is decoded, and fails as a bad image
    s = ShardStream(plan, ShardReader(), to_tensor, number_tokenizer, SkipCounter("test"), batch_size=4,
                    workers=WORKERS, train=False)  # fmt: skip
    list(loader(s))
    assert s.skips.snapshot()["bad_image"] == 1

    (tmp_path / "big.jpg").write_bytes(big_truncated)
    (tmp_path / "rows.csv").write_text(f"filepath\ttitle\n{tmp_path / 'big.jpg'}\ta caption\n")
    rows = CsvDataset(str(tmp_path / "rows.csv"), to_tensor, number_tokenizer, SkipCounter("t"), max_pixels=50_000)
    with pytest.raises(SampleSkipped) as skipped:
        rows.load(0)
    assert skipped.value.reason == "too_large"
