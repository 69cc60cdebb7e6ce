"""The resumable WebDataset stream: exactly-once epochs, resampling with upsampling factors, and a position that
saved after any batch resumes to exactly the samples an uninterrupted loader would have produced.

Shards are real tars written with webdataset's TarWriter; captions carry the sample's number so batches can
be traced back to samples (the tokenizer turns "17" into [[17]]). Loaders are torchdata's StatefulDataLoader
with 2 worker processes, and 2 ranks are two streams with rank 0 and 1.
"""

import collections
import io
import json
import pickle

import pytest
import torch
import webdataset as wds
from helpers import fork_ranks, free_port
from PIL import Image
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)
from torchdata.stateful_dataloader import StatefulDataLoader

from bigclip.data.shards import ShardReader, expand_shard_urls, iter_shard_samples
from bigclip.data.skips import SkipCounter
from bigclip.data.wds_plan import ShardPlan, parse_upsampling_factors
from bigclip.data.wds_stream import ShardStream
from bigclip.errors import UserError

WORKERS = 2


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(directory, counts: list[int], first: int = 0, prefix: str = "s") -> list[str]:
    png, paths, number = _png(), [], first
    for i, count in enumerate(counts):
        path = str(directory / f"{prefix}-{i:03d}.tar")
        with wds.TarWriter(path) as sink:
            for _ in range(count):
                sink.write({"__key__": f"{number:06d}", "png": png, "txt": str(number)})
                number += 1
        paths.append(path)
    return paths


def number_tokenizer(texts):
    return torch.tensor([[int(t)] for t in texts])


def to_tensor(img):
    return torch.zeros(1)


def stream(plan, rank=0, world=1, batch=4, quota=10_000, train=True, buffer=(50, 10)):
    s = ShardStream(
        plan,
        ShardReader(),
        to_tensor,
        number_tokenizer,
        SkipCounter("test"),
        batch_size=batch,
        rank=rank,
        world_size=world,
        workers=WORKERS,
        train=train,
        batches_per_worker=quota if train else None,
    )
    s.shuffle_buffer, s.shuffle_initial = buffer
    return s


def loader(s):
    return StatefulDataLoader(s, batch_size=None, num_workers=WORKERS)


def numbers(batch) -> list[int]:
    return batch[1][:, 0].tolist()


def test_without_resampling_every_sample_is_read_once_per_epoch_over_ranks_and_workers(tmp_path):
    shards = write_shards(tmp_path, [13, 7, 20, 9, 11, 16, 5, 8])  # 89 samples, 8 shards for 4 slots
    plan = ShardPlan.build([shards], None, resampled=False, seed=3)
    for epoch in (0, 1):
        seen, dropped = [], 0
        for rank in (0, 1):
            s = stream(plan, rank=rank, world=2)
            s.set_epoch(epoch)
            seen += [n for b in loader(s) for n in numbers(b)]
            dropped += s.skips.snapshot()["dropped"]
        assert len(seen) == len(set(seen))
        assert len(seen) + dropped == 89  # the rest: last partial batches, counted
    # epochs differ in order
    a, b = stream(plan), stream(plan)
    b.set_epoch(1)
    assert [numbers(x) for x in loader(a)] != [numbers(x) for x in loader(b)]


def test_fewer_shards_than_readers_is_one_line():
    plan = ShardPlan.build([["a.tar", "b.tar", "c.tar"]], None, resampled=False, seed=0)
    with pytest.raises(UserError, match="3 shards for 4 readers"):
        plan.check_slots(4, "--train-data x")


@pytest.mark.parametrize("resampled", [False, True])
def test_position_saved_after_any_batch_resumes_exactly(tmp_path, resampled):
    shards = write_shards(tmp_path, [30, 25, 40, 35, 20, 30])
    plan = ShardPlan.build([shards], None, resampled=resampled, seed=7)
    quota = 12  # batches per worker: resampled streams are endless
    whole = [numbers(b) for b in loader(stream(plan, quota=quota))]
    assert len(whole) == 2 * quota or not resampled
    for cut in (1, 5, 11):
        first = loader(stream(plan, quota=quota))
        it = iter(first)
        head = [numbers(next(it)) for _ in range(cut)]
        saved = pickle.loads(pickle.dumps(first.state_dict()))  # as it travels through a checkpoint
        del it, first
        again = loader(stream(plan, quota=quota))
        again.load_state_dict(saved)
        assert head + [numbers(b) for b in again] == whole, cut


def test_upsampling_factors_set_each_sources_share(tmp_path):
    a = write_shards(tmp_path, [10] * 4, first=0, prefix="a")  # numbers < 1000
    b = write_shards(tmp_path, [10] * 2, first=1000, prefix="b")
    factors = parse_upsampling_factors("1::3", [a, b], resampled=True)
    plan = ShardPlan.build([a, b], factors, resampled=True, seed=1)
    got = [n for batch in loader(stream(plan, quota=150, batch=8, buffer=(20, 5))) for n in numbers(batch)]
    share_b = sum(n >= 1000 for n in got) / len(got)
    expected = (2 * 3) / (4 * 1 + 2 * 3)  # per-shard weights: factor x shards, as OpenCLIP
    assert abs(share_b - expected) < 0.06, (share_b, expected)
    counts = collections.Counter(n // 10 for n in got)  # every shard is drawn
    assert len(counts) == 6


def test_upsampling_factors_follow_openclips_rules():
    sources = [["a.tar"], ["b.tar"]]
    with pytest.raises(UserError, match="add --dataset-resampled"):
        parse_upsampling_factors("1::2", sources, resampled=False)
    with pytest.raises(UserError, match="3 factors for 2 data sources"):
        parse_upsampling_factors("1::2::3", sources, resampled=True)
    assert parse_upsampling_factors("1::0.5", sources, resampled=True) == [1.0, 0.5]


def test_evaluation_reads_every_sample_once_in_order(tmp_path):
    shards = write_shards(tmp_path, [5, 6, 7, 3])
    plan = ShardPlan.build([shards], None, resampled=False, seed=0)
    seen = []
    for rank in (0, 1):
        seen += [n for b in loader(stream(plan, rank=rank, world=2, batch=4, train=False)) for n in numbers(b)]
    assert sorted(seen) == list(range(21))


# ------------------------------------------------------------------------------------ shards on S3 (moto)
def upload(s3, bucket, paths) -> list[str]:
    fs = s3.fs()
    urls = []
    for path in paths:
        url = f"s3://{bucket}/shards/{path.rsplit('/', 1)[1]}"
        fs.put(path, url)
        urls.append(url)
    return urls


def test_shards_stream_from_s3_like_local_and_prefixes_are_listed(tmp_path, s3, s3_bucket):
    local = write_shards(tmp_path, [9, 14, 5])
    remote = upload(s3, s3_bucket, local)
    listed = expand_shard_urls(f"s3://{s3_bucket}/shards/", "--train-data")
    assert listed == [remote]
    assert expand_shard_urls(f"s3://{s3_bucket}/shards/s-00{{0..1}}.tar::{local[2]}", "--train-data") == [
        remote[:2],
        [local[2]],
    ]
    for a, b in zip(local, remote):
        ours = [(s["__key__"], s["png"], s["txt"], s["__index__"]) for s in iter_shard_samples(b)]
        assert ours == [(s["__key__"], s["png"], s["txt"], s["__index__"]) for s in iter_shard_samples(a)]
    assert [s["__index__"] for s in iter_shard_samples(remote[1], start=10)] == [10, 11, 12, 13]
    with pytest.raises(UserError, match="--train-data s3://.*/nothing/: no .tar shards"):
        expand_shard_urls(f"s3://{s3_bucket}/nothing/", "--train-data")
    # a whole training epoch from S3 equals the one from local disk
    plan_local = ShardPlan.build([local], None, resampled=False, seed=2)
    plan_s3 = ShardPlan.build([remote], None, resampled=False, seed=2)
    s_local, s_s3 = stream(plan_local), stream(plan_s3)
    s_local.read_shard = s_s3.read_shard = ShardReader()
    assert [numbers(b) for b in loader(s_s3)] == [numbers(b) for b in loader(s_local)]


@pytest.mark.slow
@pytest.mark.parametrize("resampled", [False, True])
def test_prefetched_s3_shards_give_the_same_batches_and_resume_exactly(tmp_path, s3, s3_bucket, resampled):
    remote = upload(s3, s3_bucket, write_shards(tmp_path, [30, 25, 40, 35, 20, 30]))
    plan = ShardPlan.build([remote], None, resampled=resampled, seed=7)

    def prefetching(**kw):
        s = stream(plan, **kw)
        s.read_shard = ShardReader(prefetch_bytes=8 << 10)  # smaller than a shard: the bound is reached
        return s

    plain = [numbers(b) for b in loader(stream(plan, quota=12))]
    whole = [numbers(b) for b in loader(prefetching(quota=12))]
    assert whole == plain
    for cut in (1, 7):
        first = loader(prefetching(quota=12))
        it = iter(first)
        head = [numbers(next(it)) for _ in range(cut)]
        saved = pickle.loads(pickle.dumps(first.state_dict()))
        del it, first
        again = loader(prefetching(quota=12))
        again.load_state_dict(saved)
        assert head + [numbers(b) for b in again] == whole, cut


def test_the_next_shard_downloads_while_the_current_one_is_decoded_within_the_bound(
    tmp_path, s3, s3_bucket, monkeypatch
):
    from bigclip.data import shards as shards_mod

    remote = upload(s3, s3_bucket, write_shards(tmp_path, [400, 300]))  # ~1 MB and ~0.7 MB
    opened, open_shard = [], shards_mod.open_shard
    monkeypatch.setattr(shards_mod, "open_shard", lambda url, *a: opened.append(url) or open_shard(url, *a))
    bound = 64 << 10
    reader = ShardReader(prefetch_bytes=bound)
    first = reader(remote[0], then=remote[1])
    head = [next(first)]  # shard 0 is being read; the next one has started
    following_url, following = reader._prefetcher.next
    assert following_url == remote[1]
    # The next shard fills its bound and waits there (no deadline but the test's: it happens or it hangs).
    while not following.queue.full():
        following.stopping.wait(0.01)
    assert 0 < following.buffered_bytes() <= bound + following.chunk
    rest = list(first) + list(reader(remote[1]))  # the second read takes the prefetched stream
    assert opened == remote and reader._prefetcher.next is None  # each shard opened once
    direct = [s for url in remote for s in iter_shard_samples(url)]
    got = head + rest
    assert [(s["__url__"], s["__key__"], s["png"], s["txt"]) for s in got] == [
        (s["__url__"], s["__key__"], s["png"], s["txt"]) for s in direct
    ]


def test_a_prefetched_shard_that_fails_is_reported_like_a_direct_read(tmp_path, s3, s3_bucket):
    (remote,) = upload(s3, s3_bucket, write_shards(tmp_path, [20]))
    missing = f"s3://{s3_bucket}/shards/missing.tar"
    reader, errors = ShardReader(prefetch_bytes=8 << 10), []
    got = list(reader(remote, then=missing)) + list(reader(missing, on_error=lambda kind, detail: errors.append(kind)))
    assert len(got) == 20 and errors == ["shard_failed"]


def test_an_s3_outage_mid_shard_is_retried_and_the_shard_completes(tmp_path, s3, s3_bucket, monkeypatch):
    import threading
    import time

    from tcp_proxy import TcpProxy

    from bigclip.data import shards as shards_mod

    # ~1.6 MB, read in 1 MiB requests: the outage lands before the second. It is the proxy's (every connection
    # reset, new ones refused): stopping the server itself left keep-alive connections served by their threads,
    # so the second request could still succeed, as it once did under load.
    (local,) = write_shards(tmp_path, [400])
    (remote,) = upload(s3, s3_bucket, [local])
    monkeypatch.setattr(shards_mod, "_BLOCK", 64 << 10)
    proxy = TcpProxy(("127.0.0.1", s3.port))
    try:
        samples, errors = [], []
        reader = iter_shard_samples(
            remote, {"endpoint_url": proxy.endpoint}, on_error=lambda kind, detail: errors.append(kind)
        )
        samples.append(next(reader))
        proxy.refuse()
        threading.Timer(3.0, proxy.accept).start()  # back on the same port after 3 s
        started = time.monotonic()
        samples += list(reader)
        assert time.monotonic() - started >= 2.5 and errors == []
    finally:
        proxy.close()
    assert [s["__index__"] for s in samples] == list(range(400))


def test_a_shard_that_keeps_failing_is_reported_not_raised(tmp_path, s3, s3_bucket, monkeypatch):
    errors = []
    got = list(
        iter_shard_samples(f"s3://{s3_bucket}/shards/missing.tar", on_error=lambda kind, detail: errors.append(kind))
    )
    assert got == [] and errors == ["shard_failed"]


# ------------------------------------------------------------------------- ranks that run out unevenly
def _uneven_worker(rank, port, shards, out):
    import dataclasses

    import torch.distributed as dist

    from bigclip.data import DataConfig, get_data
    from bigclip.dist import World
    from bigclip.loop import _micro_batches, _while_every_rank_has_data

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    world = World(rank=rank, world_size=2, backend="gloo")
    cfg = dataclasses.replace(DataConfig(), train_data=shards, train_num_samples=400, batch_size=4, workers=1)
    info = get_data(cfg, to_tensor, to_tensor, number_tokenizer, rank=rank, world_size=2)["train"]

    class Engine:  # what _micro_batches asks of an engine: the weights' dtype
        precision = type("P", (), {"param_dtype": torch.float32})

    steps = list(_while_every_rank_has_data(_micro_batches(info.dataloader, 1, 100, Engine, world), 4, info, world))
    seen = [n for group in steps for _images, texts in group for n in texts[:, 0].tolist()]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"steps": len(steps), "seen": seen, "skipped": info.skipped()}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_take_equal_steps_and_every_sample_is_read_or_counted(tmp_path):
    """2 ranks, shards of very different sizes: the ranks stop together when the first runs out, and the
    other reads the rest of its shards, counted as dropped: trained + dropped = every sample, once."""
    write_shards(tmp_path, [6, 30, 5, 40])  # each rank reads two; however they pair up, one has 9+ more
    fork_ranks(_uneven_worker, (free_port(), str(tmp_path / "s-{000..003}.tar"), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    seen = ranks[0]["seen"] + ranks[1]["seen"]
    dropped = ranks[0]["skipped"]["dropped"] + ranks[1]["skipped"]["dropped"]
    assert len(seen) == len(set(seen)) and len(seen) + dropped == 81
    assert dropped >= 8  # the longer rank's tail was read, not trained on


# ------------------------------------------------------------------------- resuming on another topology
def _info(shards: str, rank: int, world: int, workers: int):
    import dataclasses

    from bigclip.data import DataConfig, get_data

    cfg = dataclasses.replace(DataConfig(), train_data=shards, train_num_samples=10_000, batch_size=4, workers=workers)
    return get_data(cfg, to_tensor, to_tensor, number_tokenizer, rank=rank, world_size=world)["train"]


@pytest.mark.parametrize("world, workers", [(1, 3), (2, 1), (2, 3)])
def test_resume_on_another_world_size_or_worker_count_reads_the_rest_once(tmp_path, world, workers):
    """2 ranks x 2 workers take some batches and save their positions; the epoch then continues on another
    topology. Taken before + read after + dropped = every sample of the epoch, none twice."""
    write_shards(tmp_path, [23, 17, 30, 12, 25, 19, 8, 26])  # 160 samples
    shards = str(tmp_path / "s-{000..007}.tar")
    taken, positions = [], {}
    for rank, cut in ((0, 5), (1, 2)):
        info = _info(shards, rank, 2, 2)
        info.set_epoch(0)
        it = iter(info.dataloader)
        taken += [n for _ in range(cut) for n in numbers(next(it))]
        positions[rank] = pickle.loads(pickle.dumps(info.position()))
        info.close()
    after, dropped = [], 0
    for rank in range(world):
        info = _info(shards, rank, world, workers)
        info.restore({"world_size": 2, "ranks": positions} if world != 2 else positions[rank])
        info.set_epoch(0, skip_batches=3)
        after += [n for b in info.dataloader for n in numbers(b)]
        dropped += info.skipped()["dropped"]
    assert not set(taken) & set(after) and len(after) == len(set(after))
    assert len(taken) + len(after) + dropped == 160


def test_storage_options_reach_the_shard_reads(tmp_path, s3, s3_bucket, monkeypatch):
    """Where the environment names no usable endpoint, --storage-options' endpoint (as for checkpoints) is the
    one listings and reads use."""
    (remote,) = upload(s3, s3_bucket, write_shards(tmp_path, [6]))
    options = {"client_kwargs": {"endpoint_url": s3.endpoint}}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing answers there
    assert expand_shard_urls(f"s3://{s3_bucket}/shards/", "--train-data", options) == [[remote]]
    errors = []
    samples = list(iter_shard_samples(remote, storage_options=options, on_error=lambda *e: errors.append(e)))
    assert [s["txt"] for s in samples] == [str(n).encode() for n in range(6)] and not errors


def test_img2dataset_shards_read_unchanged(tmp_path):
    """img2dataset writes .jpg, .txt and .json per sample (plus a .parquet/_stats.json beside the tar): the
    samples train as they are, their extra members ignored."""
    jpg = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 100, 50)).save(jpg, format="JPEG")
    path = str(tmp_path / "00000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(5):
            meta = {"url": f"https://example.com/{i}.jpg", "caption": f"photo {i}", "width": 8, "height": 6}
            sink.write({"__key__": f"00000{i:04d}", "jpg": jpg.getvalue(), "txt": f"photo {i}",
                        "json": json.dumps(meta).encode()})  # fmt: skip
    s = stream(ShardPlan.build([[path]], None, resampled=False, seed=0), batch=5, train=False)
    s.tokenizer = lambda texts: torch.tensor([[int(t.split()[1])] for t in texts])
    s.transform = lambda img: torch.tensor(img.size)
    (batch,) = list(StatefulDataLoader(s, batch_size=None, num_workers=0))
    assert batch[1][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert batch[0].tolist() == [[8, 6]] * 5 and not any(s.skips.snapshot().values())


def test_the_shuffle_buffer_draws_as_webdatasets_and_packs_its_refs():
    """The buffer behind the saved position: the same draws as webdataset's list shuffle (swap with the last, pop),
    its refs packed into one bytes object in the items' order; older positions (lists of pairs) still read."""
    import random

    from bigclip.data.wds_stream import ShuffleBuffer, unpack_refs

    buffer, plain = ShuffleBuffer(), []
    ours, theirs = random.Random(0), random.Random(0)
    for i in range(500):
        item = ((i % 7, 1000 + i), {"__index__": i})
        buffer.append(item)
        plain.append(item)
        if i % 3 == 0:
            k = theirs.randrange(len(plain))
            plain[k], plain[-1] = plain[-1], plain[k]
            assert buffer.take(ours) == plain.pop()
    packed = buffer.packed_refs()
    assert isinstance(packed, bytes) and len(packed) == 16 * len(plain)
    assert unpack_refs(packed) == [ref for ref, _ in plain] == [ref for ref, _ in buffer.items]
    assert unpack_refs([[3, 4], [5, 6]]) == [(3, 4), (5, 6)]
