"""WebDataset shards as a stream of ready batches whose position can be saved after any batch and resumed
exactly: the same samples, in the same order, as if the run had never stopped.

Each DataLoader worker ("slot", see wds_plan.py) reads its shards through a cursor (which shard, how many of
its samples are read; with resampling, the shard sampler's generator), mixes samples in a shuffle buffer,
decodes them and yields full batches. After every batch its state is small and plain (JSON): the cursor, the
shuffle generator, and the buffer as references (shard, index in shard) instead of bytes. torchdata's
StatefulDataLoader keeps, per worker, the state that came with the last batch the training loop took, so a
checkpoint holds exactly the consumed position even though workers run ahead. A resumed worker re-reads the
few shards its buffer refers to, rebuilds the buffer, and continues from the cursor.

Training yields `batches_per_worker` batches per worker and epoch (OpenCLIP's epoch arithmetic). Without
resampling a worker can run out of shards first; it then stops, and the samples left in its buffer and last
partial batch are counted as dropped. Evaluation reads its shards in order, once, without a buffer.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from bigclip.data.skips import SkipCounter
from bigclip.data.wds_plan import ShardPlan, slot_of
from bigclip.errors import UserError

IMAGE_KEYS = ("jpg", "png", "jpeg", "webp")
CAPTION_KEY = "txt"
# Sample shuffle buffer per worker (OpenCLIP's sizes): large enough to mix neighbouring samples of a shard,
# small enough to hold in memory as raw bytes.
SHUFFLE_BUFFER, SHUFFLE_INITIAL = 5000, 1000

Ref = tuple[int, int]  # (shard index in the plan, sample index in the shard)
ReadShard = Callable[..., Iterator[dict]]  # (url, start=, on_error=) -> samples with "__index__"


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def _take(buffer: list, rng: random.Random):
    """A random element of the buffer, removed (swap with the last, pop)."""
    k = rng.randrange(len(buffer))
    buffer[k], buffer[-1] = buffer[-1], buffer[k]
    return buffer.pop()


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rng: random.Random, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class _Cursor:
    """Where a slot is in its shards: the current shard and how many of its samples have been read."""

    def __init__(self, plan: ShardPlan, epoch: int, rank: int, world_size: int, worker: int, workers: int, train):
        self.plan = plan
        self.resampled = plan.resampled and train
        self.position = 0  # index into `own` (not resampled) or shards drawn so far (resampled)
        self.start = 0
        if self.resampled:
            self.sampler = plan.sampler(epoch, rank, worker)
            self.shard: int | None = plan.draw(self.sampler)
        else:
            slot, slots = slot_of(rank, world_size, worker), world_size * workers
            self.own = plan.slot_shards(epoch, slot, slots) if train else list(range(slot, len(plan.shards), slots))
            self.shard = self.own[0] if self.own else None

    def advance(self) -> None:
        self.position += 1
        self.start = 0
        if self.resampled:
            self.shard = self.plan.draw(self.sampler)
        else:
            self.shard = self.own[self.position] if self.position < len(self.own) else None

    def state(self) -> dict[str, Any]:
        state = {"position": self.position, "start": self.start, "shard": self.shard}
        if self.resampled:
            state["sampler"] = _rng_state(self.sampler)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self.position, self.start, self.shard = state["position"], state["start"], state["shard"]
        if self.resampled:
            _set_rng_state(self.sampler, state["sampler"])


class ShardStream(IterableDataset):
    def __init__(
        self,
        plan: ShardPlan,
        read_shard: ReadShard,
        transform,
        tokenizer,
        skips: SkipCounter,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        workers: int = 0,
        train: bool = True,
        batches_per_worker: int | None = None,
        num_batches: int | None = None,
        source: str = "--train-data",
    ):
        """`batches_per_worker`: training's quota per worker and epoch; `num_batches`: evaluation's estimate of
        its batches per rank (from --val-num-samples), or None."""
        self.plan = plan
        self.read_shard = read_shard
        self.transform = transform
        self.tokenizer = tokenizer
        self.skips = skips
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.workers = max(1, workers)
        self.train = train
        self.batches_per_worker = batches_per_worker
        self.num_batches = num_batches
        self.source = source
        self.shuffle_buffer, self.shuffle_initial = SHUFFLE_BUFFER, SHUFFLE_INITIAL
        # Workers may outlive an epoch (persistent workers): the epoch lives in shared memory.
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        self._resume: dict[str, Any] | None = None  # a saved worker state, used by the next __iter__
        self._state: dict[str, Any] = {}

    # ---------------------------------------------------------------------------- position
    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Start `epoch` from its beginning; a saved position (load_state_dict) resumes inside it instead."""
        if skip_batches:
            raise ValueError("a shard stream resumes from its saved position, not by skipping batches")
        self._epoch.value = epoch

    def __len__(self) -> int:
        """Batches per rank and epoch (training); evaluation knows it only from --val-num-samples."""
        if self.train:
            return self.batches_per_worker * self.workers
        if self.num_batches is None:
            raise TypeError("length unknown: pass --val-num-samples")
        return self.num_batches

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def state_dict(self) -> dict[str, Any]:
        """This worker's position after the batch it yielded last (called by StatefulDataLoader)."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = dict(state) if state else None

    # ---------------------------------------------------------------------------- raw samples
    def _on_error(self, kind: str, detail: str = "") -> None:
        self.skips.count("read_error", f"{kind}: {detail}")

    def _read(self, shard: int, start: int) -> Iterator[dict]:
        return self.read_shard(self.plan.shards[shard], start=start, on_error=self._on_error)

    def _raw(self, cursor: _Cursor) -> Iterator[tuple[Ref, dict]]:
        empty_in_a_row = 0
        while cursor.shard is not None:
            got = False
            for sample in self._read(cursor.shard, cursor.start):
                got = True
                cursor.start = sample["__index__"] + 1
                yield (cursor.shard, sample["__index__"]), sample
            empty_in_a_row = 0 if got else empty_in_a_row + 1
            # Resampling draws for ever; a long run of shards without one sample means there is no data.
            if cursor.resampled and empty_in_a_row > max(16, 4 * len(self.plan.shards)):
                raise self._no_data()
            cursor.advance()

    def _refetch(self, refs: list[Ref]) -> dict[Ref, dict]:
        """The samples a saved shuffle buffer referred to, read again from their shards."""
        wanted: dict[int, set[int]] = {}
        for shard, index in refs:
            wanted.setdefault(shard, set()).add(index)
        found: dict[Ref, dict] = {}
        for shard, indices in wanted.items():
            last = max(indices)
            for sample in self._read(shard, min(indices)):
                if sample["__index__"] in indices:
                    found[(shard, sample["__index__"])] = sample
                if sample["__index__"] >= last:
                    break
        return found

    def _no_data(self) -> UserError:
        return UserError(
            f"{self.source}: this loader found no usable sample in its shards; check that the shards hold "
            f".jpg/.png/.webp images with .txt captions"
        )

    # ---------------------------------------------------------------------------- samples
    @staticmethod
    def _where(sample: dict) -> str:
        return f"{sample.get('__key__')} in {sample.get('__url__')}"

    def _decode(self, sample: dict):
        """(image tensor, tokens), or None (counted by reason) for a sample that cannot be used."""
        where = self._where(sample)
        image_bytes = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        if image_bytes is None:
            self.skips.count("missing_image", where)
            return None
        caption = sample.get(CAPTION_KEY)
        caption = caption.decode("utf-8", errors="replace") if caption is not None else ""
        if not caption.strip():
            self.skips.count("missing_caption", where)
            return None
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
        info = get_worker_info()
        worker = info.id if info is not None else 0
        epoch = self._epoch.value
        resume, self._resume = self._resume, None
        if resume is not None and resume.get("epoch") != epoch:
            resume = None  # a position saved in another epoch: this epoch starts from its beginning
        cursor = _Cursor(self.plan, epoch, self.rank, self.world_size, worker, self.workers, self.train)
        if not self.train:
            yield from self._batches(((ref, s) for ref, s in self._raw(cursor)), None, None, 0)
            return
        rng = random.Random(f"{self.plan.seed}/{epoch}/{self.rank}/{worker}/shuffle")
        buffer: list[tuple[Ref, dict]] = []
        produced = 0
        if resume is not None:
            if resume.get("done"):
                return
            cursor.restore(resume["cursor"])
            _set_rng_state(rng, resume["rng"])
            produced = resume["produced"]
            refs = [tuple(r) for r in resume["buffer"]]
            found = self._refetch(refs)
            for ref in refs:
                if ref in found:
                    buffer.append((ref, found[ref]))
                else:
                    self.skips.count("read_error", f"sample {ref} of the saved shuffle buffer could not be read again")
        state = {"epoch": epoch, "produced": produced, "done": False}

        def snapshot(produced: int, done: bool = False) -> None:
            self._state = {
                **state,
                "produced": produced,
                "done": done,
                "cursor": cursor.state(),
                "rng": _rng_state(rng),
                "buffer": [list(ref) for ref, _ in buffer],
            }

        quota = self.batches_per_worker - produced
        if quota <= 0:
            snapshot(produced, done=True)
            return

        def shuffled() -> Iterator[tuple[Ref, dict]]:
            # webdataset's shuffle: the buffer grows by two samples per sample taken until it holds
            # shuffle_buffer; taking starts once it holds shuffle_initial.
            raw = self._raw(cursor)
            for item in raw:
                buffer.append(item)
                if len(buffer) < self.shuffle_buffer:
                    buffer.extend(itertools.islice(raw, 1))
                if len(buffer) >= self.shuffle_initial:
                    yield _take(buffer, rng)
            while buffer:  # the slot's shards are done: empty the buffer in random order
                yield _take(buffer, rng)

        yield from self._batches(shuffled(), quota, snapshot, produced)

    def _batches(self, items: Iterator[tuple[Ref, dict]], quota: int | None, snapshot, produced: int):
        batch: list = []
        made = usable = 0
        for _ref, sample in items:
            decoded = self._decode(sample)
            if decoded is None:
                continue
            usable += 1
            batch.append(decoded)
            if len(batch) == self.batch_size:
                made += 1
                if snapshot is not None:
                    snapshot(produced + made, done=quota is not None and made == quota)
                yield _collate(batch)
                batch = []
                if quota is not None and made == quota:
                    return
        if quota is None:
            if batch:  # evaluation: the last, partial batch counts
                yield _collate(batch)
            return
        if not usable and not produced:
            raise self._no_data()  # this worker's shards hold not one usable sample: a data problem, not a hang
        # Training ran out of shards before its quota (not resampled): the partial batch is dropped.
        if batch:
            self.skips.count("dropped", f"{len(batch)} samples of a last partial batch", n=len(batch))
        if snapshot is not None:
            snapshot(produced + made, done=True)
