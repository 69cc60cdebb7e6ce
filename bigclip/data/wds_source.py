"""--dataset-type webdataset: tar shards (local, any fsspec URL, pipe:), read by ShardStream (data/wds_stream.py)
in the order data/wds_plan.py gives each (rank, worker), resumable mid-epoch for training."""

from __future__ import annotations

from bigclip.data.config import DataConfig, sources
from bigclip.data.info import DataInfo
from bigclip.data.shards import ShardReader, expand_shard_urls, is_remote
from bigclip.data.skips import SkipCounter
from bigclip.data.sources import DATA_SOURCES, IMAGE_FLAGS, DataSource, LoaderContext, Split
from bigclip.data.wds_plan import ShardPlan, batches_per_worker, parse_upsampling_factors
from bigclip.data.wds_stream import ShardStream
from bigclip.data.workers import worker_loader
from bigclip.errors import UserError


def build_webdataset(cfg: DataConfig, split: Split, ctx: LoaderContext) -> DataInfo:
    train, path, flag = split.train, split.path, split.flag
    options = cfg.options()
    shards = expand_shard_urls(path, flag, options)
    num_samples = split.num_samples
    if train and not num_samples:
        raise UserError(f"{flag} {path}: WebDataset training needs --train-num-samples (samples per epoch)")
    resampled = train and cfg.dataset_resampled
    factors = parse_upsampling_factors(cfg.train_data_upsampling_factors, shards, resampled) if train else None
    plan = ShardPlan.build(shards, factors, resampled, cfg.seed)
    workers = max(1, cfg.workers)
    per_worker = None
    if train:
        plan.check_slots(ctx.world_size * workers, f"{flag} {path}")
        per_worker = batches_per_worker(num_samples, cfg.batch_size, ctx.world_size, cfg.workers)
        num_batches = per_worker * workers
        num_samples = num_batches * cfg.batch_size * ctx.world_size
    else:
        # Unknown without --val-num-samples; with it, an estimate (ranks may differ by a batch).
        num_batches = -(-num_samples // (cfg.batch_size * ctx.world_size)) if num_samples else None
    skips = SkipCounter(split.role)
    stream = ShardStream(
        plan,
        ShardReader(options, prefetch_bytes=cfg.shard_prefetch_mb << 20),
        split.transform,
        ctx.tokenizer,
        skips,
        batch_size=cfg.batch_size,
        rank=ctx.rank,
        world_size=ctx.world_size,
        workers=cfg.workers,
        train=train,
        batches_per_worker=per_worker,
        num_batches=None if train else num_batches,
        source=f"{flag} {path}",
        keys=cfg.sample_keys(),
        max_pixels=cfg.max_image_pixels,
        text_pad_id=ctx.text_pad_id,
    )
    loader = worker_loader(stream, cfg.workers, batch_size=None, stateful=train)
    return DataInfo(
        loader,
        num_samples=num_samples or 0,
        num_batches=num_batches or 0,
        sampler=stream,
        skips=skips,
        resumable=train,
        ends_early=train and not resampled,
    )


def _check_prefetch(cfg: DataConfig) -> None:
    """--shard-prefetch-mb reads shards ahead from object storage; local shards are read as decoding asks."""
    if cfg.shard_prefetch_mb == DataConfig.shard_prefetch_mb:
        return
    values = [v for v in (cfg.train_data, cfg.val_data) if v]
    if not any(is_remote(url) for value in values for names in sources(value) for url in names):
        raise UserError(
            "--shard-prefetch-mb: only applies to shards on object storage (an fsspec URL such as s3://); these are "
            "local files; drop the flag"
        )


DATA_SOURCES.register(
    "webdataset",
    DataSource(
        build_webdataset,
        extensions=(".tar",),
        check=_check_prefetch,
        flags=(
            "train_num_samples",
            "val_num_samples",
            "dataset_resampled",
            "shard_prefetch_mb",
            "image_key",
            "text_key",
            "json_text_key",
            "json_text_key_probs",
            "train_data_upsampling_factors",
            "max_image_pixels",
            "workers",
            *IMAGE_FLAGS,
        ),  # fmt: skip
    ),
    help="WebDataset .tar shards, '::' between sources (--train-num-samples per epoch)",
)
