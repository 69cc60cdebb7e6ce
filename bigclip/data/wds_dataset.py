"""WebDataset shards (.tar files of key.jpg/png/jpeg/webp + key.txt) read as a stream of ready batches.

Local shards, brace patterns (`train-{0000..0099}.tar`) and several sources joined by `::`.

Who reads what. The (rank, worker) pairs are "slots". With at least as many shards as slots, each slot
reads its own shards; with fewer shards, every slot reads all shards and keeps every n-th sample.
Either way a sample belongs to exactly one slot, and no worker is ever left without data.

Equal batches on every rank. In training each slot yields exactly `batches_per_worker` full batches:
when its shards run out before that, it starts over on a reshuffled shard list (like OpenCLIP's
--dataset-resampled). So every rank steps the same number of times with full batches, whatever the
shard sizes and however many samples were skipped.

Determinism. The shard order comes from (seed, epoch, pass), the in-slot sample shuffle from
(seed, epoch, slot); the DataLoader takes batches from its workers in turn, so a run is reproducible
for a given worker count. The epoch and the batches to skip live in shared memory because workers
may outlive one epoch (persistent workers).

Resuming mid-epoch skips the first batches without decoding their images: samples are counted after
the cheap checks (image entry and caption present), so an undecodable image inside the skipped part
shifts the rest of the epoch by one sample compared with an uninterrupted run.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import random
import warnings

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from bigclip.data.skips import SkipCounter
from bigclip.errors import UserError

IMAGE_KEYS = ("jpg", "png", "jpeg", "webp")
CAPTION_KEY = "txt"
# Sample shuffle buffer per worker (OpenCLIP's sizes): large enough to mix neighbouring samples of a
# shard, small enough to hold in memory as raw bytes.
SHUFFLE_BUFFER, SHUFFLE_INITIAL = 5000, 1000
_GIVE_UP_AFTER_PASSES = 3


def expand_shards(spec: str, flag: str) -> list[str]:
    """Local shard paths from a brace pattern, `::`-joined sources allowed; each must exist."""
    paths = []
    for url in wds.shardlists.expand_urls(spec):
        if url.startswith("file://"):
            url = url[len("file://") :]
        elif "://" in url:
            raise UserError(f"{flag} {url}: remote shards are not supported yet; copy them to a local disk")
        if not os.path.isfile(url):
            raise UserError(f"{flag} {url}: shard not found; check the path and the brace pattern")
        paths.append(url)
    if not paths:
        raise UserError(f"{flag} {spec}: matches no shards; check the pattern")
    return paths


def batches_per_worker(num_samples: int, batch_size: int, world_size: int, workers: int) -> int:
    """OpenCLIP's epoch arithmetic: whole global batches, rounded up so every worker does the same."""
    global_batches = math.ceil(num_samples / (batch_size * world_size))
    return math.ceil(global_batches / max(1, workers))


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


class WebDatasetStream(IterableDataset):
    def __init__(
        self,
        shards: list[str],
        transform,
        tokenizer,
        skips: SkipCounter,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        workers: int = 0,
        seed: int = 0,
        train: bool = True,
        num_batches: int | None = None,
        source: str = "--train-data",
    ):
        """`num_batches`: per rank and epoch; required for training (it fixes the epoch length)."""
        self.shards = shards
        self.transform = transform
        self.tokenizer = tokenizer
        self.skips = skips
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.workers = max(1, workers)
        self.seed = seed
        self.train = train
        self.source = source
        if train:
            self.batches_per_worker = math.ceil(num_batches / self.workers)
            self.num_batches = self.batches_per_worker * self.workers
        else:
            self.num_batches = num_batches
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        self._skip_batches = multiprocessing.Value("q", 0, lock=False)
        self._pass_size = 0  # most raw samples one pass gave this slot (per process)
        self.shuffle_buffer, self.shuffle_initial = SHUFFLE_BUFFER, SHUFFLE_INITIAL

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        if not self.train and skip_batches:
            raise ValueError("evaluation streams cannot skip batches")
        if self.train and not 0 <= skip_batches <= self.num_batches:
            raise ValueError(f"skip_batches={skip_batches} outside 0..{self.num_batches}")
        self._epoch.value = epoch
        self._skip_batches.value = skip_batches

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("length unknown: pass --val-num-samples")
        return self.num_batches - self._skip_batches.value

    # -------------------------------------------------------------------------------- raw samples
    def _slot(self, skip_batches: int) -> tuple[int, int, int]:
        """(this slot, number of slots, this worker's role among the rank's workers).

        The DataLoader takes batch j from worker j % workers. Batch b of the epoch belongs to role
        b % workers; after skipping k batches the DataLoader still starts at worker 0, so worker w
        plays role (w + k) % workers and the batches arrive in the uninterrupted order.
        """
        info = get_worker_info()
        worker = info.id if info is not None else 0
        workers = info.num_workers if info is not None else 1
        role = (worker + skip_batches) % workers
        return self.rank * workers + role, self.world_size * workers, role

    def _skip_tar_error(self, exn: Exception) -> bool:
        self.skips.count("read_error", repr(exn))
        return True  # keep going with the next member or shard

    def _one_pass(self, shard_order: list[str], slot: int, slots: int):
        """Raw samples (dicts of bytes) of this slot for one pass over the shard list."""
        if len(shard_order) >= slots:
            mine = shard_order[slot::slots]
            yield from wds.tarfile_samples(({"url": s} for s in mine), handler=self._skip_tar_error)
            return
        samples = wds.tarfile_samples(({"url": s} for s in shard_order), handler=self._skip_tar_error)
        for i, sample in enumerate(samples):
            if i % slots == slot:
                yield sample

    def _raw_samples(self, slot: int, slots: int):
        epoch = self._epoch.value
        if not self.train:
            yield from self._one_pass(self.shards, slot, slots)
            return
        empty_passes = 0
        for pass_index in range(1 << 62):
            order = list(self.shards)
            random.Random(f"{self.seed}/{epoch}/{pass_index}").shuffle(order)
            size = 0
            for sample in self._one_pass(order, slot, slots):
                size += 1
                yield sample
            self._pass_size = max(self._pass_size, size)
            # A pass draws other shards for this slot; only repeated empty passes mean there is no data.
            empty_passes = empty_passes + 1 if size == 0 else 0
            if empty_passes == _GIVE_UP_AFTER_PASSES:
                raise self._no_data()

    def _no_data(self) -> UserError:
        return UserError(
            f"{self.source}: this loader found no usable sample in a whole pass over its "
            f"shards; check that the shards hold .jpg/.png/.webp images with .txt captions"
        )

    # -------------------------------------------------------------------------------------- samples
    @staticmethod
    def _where(sample: dict) -> str:
        return f"{sample.get('__key__')} in {sample.get('__url__')}"

    def _check(self, sample: dict) -> tuple[bytes, str] | None:
        """(image bytes, caption) if the sample has both, else count it and return None."""
        where = self._where(sample)
        image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        if image is None:
            self.skips.count("missing_image", where)
            return None
        caption = sample.get(CAPTION_KEY)
        caption = caption.decode("utf-8", errors="replace") if caption is not None else ""
        if not caption.strip():
            self.skips.count("missing_caption", where)
            return None
        return image, caption

    def _decode(self, image_bytes: bytes, caption: str, where: str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(io.BytesIO(image_bytes)) as img:
                    image = self.transform(img.convert("RGB"))
        except Exception as e:  # any decoder or transform failure: this sample is unusable, not the run
            self.skips.count("bad_image", f"{where}: {e}")
            return None
        return image, self.tokenizer([caption])[0]

    def __iter__(self):
        skip = self._skip_batches.value if self.train else 0
        slot, slots, role = self._slot(skip)
        raw = iter(self._raw_samples(slot, slots))
        if self.train:
            rng = random.Random(f"{self.seed}/{self._epoch.value}/slot{slot}")
            raw = wds.shuffle(self.shuffle_buffer, self.shuffle_initial, rng=rng)(raw)
            skip_mine = len(range(role, skip, slots // self.world_size))
            quota = self.batches_per_worker - skip_mine
            samples_to_skip = skip_mine * self.batch_size
        else:
            quota, samples_to_skip = None, 0
        if quota == 0:
            return
        batch, produced, unusable_run = [], 0, 0
        for sample in raw:
            checked = self._check(sample)
            if checked is not None and samples_to_skip:
                samples_to_skip -= 1
                continue
            decoded = None if checked is None else self._decode(*checked, where=self._where(sample))
            if decoded is None:
                unusable_run += 1
                # The shuffle moves a sample at most a buffer away, so a run this long spans a whole pass
                # without one good sample: training would loop forever.
                if self.train and self._pass_size and unusable_run > self._pass_size + self.shuffle_buffer:
                    raise self._no_data()
                continue
            unusable_run = 0
            batch.append(decoded)
            if len(batch) == self.batch_size:
                yield _collate(batch)
                batch, produced = [], produced + 1
                if produced == quota:
                    return
        if batch:  # evaluation only: training streams never end before their quota
            yield _collate(batch)
