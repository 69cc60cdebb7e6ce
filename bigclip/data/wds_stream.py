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

(Longer than most modules: the cursor, the buffer's references and the batch assembly are one saved state,
and what is saved must be read back by the same code that built it, side by side.)
"""

from __future__ import annotations

import io
import itertools
import logging
import multiprocessing
import random
from array import array
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from bigclip.data.decode import ImageTooLarge, decode_rgb
from bigclip.data.device_decode import collate_samples
from bigclip.data.sample_keys import SampleKeys
from bigclip.data.shards import ShardReader
from bigclip.data.skips import SkipCounter
from bigclip.data.wds_plan import ShardPlan, slot_of
from bigclip.errors import UserError

logger = logging.getLogger(__name__)

UNUSABLE_BEFORE_GIVING_UP = 10_000
# Sample shuffle buffer per worker (OpenCLIP's sizes): large enough to mix neighbouring samples of a shard,
# small enough to hold in memory as raw bytes.
SHUFFLE_BUFFER, SHUFFLE_INITIAL = 5000, 1000

Ref = tuple[int, int]  # (shard index in the plan, sample index in the shard)


class ShuffleBuffer:
    """webdataset's shuffle buffer of (ref, sample) items, with the items' refs also kept packed (two int64 per
    item, in the same order) so that the position saved with every batch is one bytes object, copied in
    microseconds, rather than a list of thousands of small lists built and pickled for each batch (which cost
    ~2 ms per batch at 5000 items: at batch size 1 more than the decoding)."""

    def __init__(self):
        self.items: list[tuple[Ref, dict]] = []
        self.refs = array("q")

    def __len__(self) -> int:
        return len(self.items)

    def append(self, item: tuple[Ref, dict]) -> None:
        self.items.append(item)
        self.refs.extend(item[0])

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    def take(self, rng: random.Random) -> tuple[Ref, dict]:
        """A random item, removed (swap with the last, pop): the same draws as webdataset's shuffle."""
        k = rng.randrange(len(self.items))
        items, refs = self.items, self.refs
        items[k], items[-1] = items[-1], items[k]
        refs[2 * k : 2 * k + 2], refs[-2:] = refs[-2:], refs[2 * k : 2 * k + 2]
        del refs[-2:]
        return items.pop()

    def packed_refs(self) -> bytes:
        return self.refs.tobytes()


def unpack_refs(saved) -> list[Ref]:
    """The refs of a saved shuffle buffer: packed bytes, or the list of [shard, index] pairs older positions hold."""
    if isinstance(saved, (bytes, bytearray)):
        flat = array("q")
        flat.frombytes(saved)
        return list(zip(flat[0::2], flat[1::2]))
    return [tuple(ref) for ref in saved]


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rng: random.Random, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class _Cursor:
    """Where a slot is in its work: the current shard and how many of its samples have been read.

    Without resampling the work is a list of items [shard, first sample, picks]: the slot's own shards of the
    epoch ([shard, 0, None]), or, after a resume at another world size or worker count, its share of what the
    old workers had left (a partly read shard from its offset; the samples an old shuffle buffer held, as
    picks). With resampling the next shard is drawn from the slot's generator."""

    def __init__(self, plan: ShardPlan, epoch: int, rank: int, world_size: int, worker: int, workers: int, train):
        self.plan = plan
        self.resampled = plan.resampled and train
        self.position = 0  # index into `items` (not resampled) or shards drawn so far (resampled)
        self.start = 0
        self.picks: set[int] | None = None
        self.leftover = False
        if self.resampled:
            self.sampler = plan.sampler(epoch, rank, worker)
            self.shard: int | None = plan.draw(self.sampler)
        else:
            slot, slots = slot_of(rank, world_size, worker), world_size * workers
            own = plan.slot_shards(epoch, slot, slots) if train else list(range(slot, len(plan.shards), slots))
            self.use_items([[shard, 0, None] for shard in own], leftover=False)

    def use_items(self, items: list[list], leftover: bool = True) -> None:
        self.items, self.leftover = items, leftover
        self._enter(0)

    def _enter(self, position: int) -> None:
        self.position = position
        if position < len(self.items):
            self.shard, self.start, picks = self.items[position]
            self.picks = None if picks is None else set(picks)
        else:
            self.shard, self.start, self.picks = None, 0, None

    def following(self) -> int | None:
        """The shard read after the current one (without moving): for read-ahead."""
        if self.resampled:
            peek = random.Random()
            peek.setstate(self.sampler.getstate())
            return self.plan.draw(peek)
        return self.items[self.position + 1][0] if self.position + 1 < len(self.items) else None

    def advance(self) -> None:
        if self.resampled:
            self.position += 1
            self.start = 0
            self.shard = self.plan.draw(self.sampler)
        else:
            self._enter(self.position + 1)

    def state(self) -> dict[str, Any]:
        state = {"position": self.position, "start": self.start, "shard": self.shard}
        if self.resampled:
            state["sampler"] = _rng_state(self.sampler)
        if self.leftover:
            state["items"] = self.items
        return state

    def restore(self, state: dict[str, Any]) -> None:
        if "items" in state:
            self.items, self.leftover = state["items"], True
        if not self.resampled:
            self._enter(state["position"])
        self.position, self.start, self.shard = state["position"], state["start"], state["shard"]
        if self.resampled:
            _set_rng_state(self.sampler, state["sampler"])


def worker_states(loader_state: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-worker stream states in a StatefulDataLoader state (one entry without worker processes)."""
    snapshot = loader_state.get("_snapshot")
    if snapshot is None:
        return [loader_state.get("dataset_state") or {}]
    workers = snapshot["_worker_snapshots"]
    return [workers[f"worker_{w}"].get("dataset_state") or {} for w in range(len(workers))]


def leftover_items(plan: ShardPlan, epoch: int, positions: dict[int, dict[str, Any]], world_size: int) -> list:
    """What the workers of ranks `positions` (rank -> DataInfo position) of a run of `world_size` ranks had still
    to read of `epoch` when their positions were saved: partly read shards from their offsets, the samples their
    shuffle buffers held, and the shards they had not started. Every sample of those ranks' share of the epoch
    that was not yet taken is in exactly one item. None if a position is of another epoch."""
    states = {}
    for rank in sorted(positions):
        position = positions[rank] or {}
        if position.get("epoch") != epoch:
            return None
        states[rank] = worker_states(position["loader"])
    items: list[list] = []
    for rank, workers in states.items():
        for worker, state in enumerate(workers):
            slots = world_size * len(workers)
            if not state:  # this worker had not yet handed over a batch: all of its shards are left
                items += [[s, 0, None] for s in plan.slot_shards(epoch, slot_of(rank, world_size, worker), slots)]
                continue
            if state["done"]:
                continue
            picks: dict[int, list[int]] = {}
            for shard, index in unpack_refs(state["buffer"]):
                picks.setdefault(shard, []).append(index)
            items += [[shard, min(indices), sorted(indices)] for shard, indices in sorted(picks.items())]
            cursor = state["cursor"]
            own = cursor.get("items") or [
                [s, 0, None] for s in plan.slot_shards(epoch, slot_of(rank, world_size, worker), slots)
            ]
            if cursor["shard"] is not None:
                current = own[cursor["position"]]
                items.append([current[0], cursor["start"], current[2]])
                items += own[cursor["position"] + 1 :]
    return items


class ShardStream(IterableDataset):
    def __init__(
        self,
        plan: ShardPlan,
        read_shard: ShardReader,
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
        keys: SampleKeys = SampleKeys(),
        max_pixels: int | None = None,
        text_pad_id: int | None = None,
    ):
        """`batches_per_worker`: training's quota per worker and epoch; `num_batches`: evaluation's estimate of
        its batches per rank (from --val-num-samples), or None; `keys`: the members holding image and caption."""
        self.plan = plan
        self.read_shard = read_shard
        self.transform = transform
        self.tokenizer = tokenizer
        self.text_pad_id = text_pad_id  # variable-length text: batches cut to their longest caption
        self.skips = skips
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.workers = max(1, workers)
        self.train = train
        self.batches_per_worker = batches_per_worker
        self.num_batches = num_batches
        self.source = source
        self.keys = keys
        self.max_pixels = max_pixels  # --max-image-pixels
        self.shuffle_buffer, self.shuffle_initial = SHUFFLE_BUFFER, SHUFFLE_INITIAL
        # Resampling never runs out of shards: this many unusable samples before the first usable one means
        # the data holds none (rather than drawing bad shards for ever).
        self.max_unusable_before_first = UNUSABLE_BEFORE_GIVING_UP
        # Workers may outlive an epoch (persistent workers): the epoch lives in shared memory.
        self._epoch = multiprocessing.Value("q", 0, lock=False)
        self._resume: dict[str, Any] | None = None  # a saved worker state, used by the next __iter__
        self._leftover: tuple[int, list, bool] | None = None  # after a topology change: see continue_leftover
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

    def continue_leftover(self, epoch: int, items: list[list], this_rank_only: bool = False) -> None:
        """Resume `epoch` from what another topology's workers had left (`leftover_items`): the items are
        dealt to this run's slots in turn (to this rank's workers only, when they are this rank's own
        leftovers), so each is read by exactly one worker of one rank."""
        self._leftover = (epoch, items, this_rank_only)

    # ---------------------------------------------------------------------------- raw samples
    def _on_error(self, kind: str, detail: str = "") -> None:
        self.skips.count("read_error", f"{kind}: {detail}")

    def _read(self, shard: int, start: int, then: int | None = None) -> Iterator[dict]:
        following = None if then is None else self.plan.shards[then]
        return self.read_shard(self.plan.shards[shard], start=start, on_error=self._on_error, then=following)

    def _raw(self, cursor: _Cursor) -> Iterator[tuple[Ref, dict]]:
        empty_in_a_row = 0
        while cursor.shard is not None:
            got = False
            for sample in self._read(cursor.shard, cursor.start, then=cursor.following()):
                got = True
                cursor.start = sample["__index__"] + 1
                if cursor.picks is not None and sample["__index__"] not in cursor.picks:
                    if sample["__index__"] >= max(cursor.picks):
                        break
                    continue
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
            f"{self.keys.describe()} (--image-key, --text-key, --json-text-key)"
        )

    # ---------------------------------------------------------------------------- samples
    @staticmethod
    def _where(sample: dict) -> str:
        return f"{sample.get('__key__')} in {sample.get('__url__')}"

    def _decode(self, sample: dict):
        """(image tensor, tokens), or None (counted by reason) for a sample that cannot be used."""
        where = self._where(sample)
        image_bytes = self.keys.image_bytes(sample)
        if image_bytes is None:
            self.skips.count("missing_image", where)
            return None
        caption = self.keys.caption(sample, self.epoch)
        if not caption.strip():
            self.skips.count("missing_caption", where)
            return None
        try:
            image = decode_rgb(io.BytesIO(image_bytes), self.transform, self.max_pixels)
        except ImageTooLarge as e:
            self.skips.count("too_large", f"{where}: {e}")
            return None
        except Exception as e:  # any decoder or transform failure: this sample is unusable, not the run
            self.skips.count("bad_image", f"{where}: {e}")
            return None
        return image, self.tokenizer([caption])[0]

    def __iter__(self):
        try:
            yield from self._iter_batches()
        finally:
            self.read_shard.close()  # a shard read ahead for a read that will not come

    def _iter_batches(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        epoch = self._epoch.value
        resume, self._resume = self._resume, None
        if resume is not None and resume.get("epoch") != epoch:
            resume = None  # a position saved in another epoch: this epoch starts from its beginning
        cursor = _Cursor(self.plan, epoch, self.rank, self.world_size, worker, self.workers, self.train)
        if resume is None and self._leftover is not None and self._leftover[0] == epoch and not cursor.resampled:
            _, items, this_rank_only = self._leftover
            if this_rank_only:
                cursor.use_items(items[worker :: self.workers])
            else:
                slot, slots = slot_of(self.rank, self.world_size, worker), self.world_size * self.workers
                cursor.use_items(items[slot::slots])
        if not self.train:
            yield from self._batches(((ref, s) for ref, s in self._raw(cursor)), None, None, 0)
            return
        rng = random.Random(f"{self.plan.seed}/{epoch}/{self.rank}/{worker}/shuffle")
        buffer = ShuffleBuffer()
        produced = 0
        if resume is not None:
            if resume.get("done"):
                return
            cursor.restore(resume["cursor"])
            _set_rng_state(rng, resume["rng"])
            produced = resume["produced"]
            refs = unpack_refs(resume["buffer"])
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
                "buffer": buffer.packed_refs(),
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
                    yield buffer.take(rng)
            while len(buffer):  # the slot's shards are done: empty the buffer in random order
                yield buffer.take(rng)

        yield from self._batches(shuffled(), quota, snapshot, produced)

    def _batches(self, items: Iterator[tuple[Ref, dict]], quota: int | None, snapshot, produced: int):
        batch: list = []
        made = usable = unusable = 0
        for _ref, sample in items:
            decoded = self._decode(sample)
            if decoded is None:
                unusable += 1
                if (
                    not usable
                    and not produced
                    and unusable >= self.max_unusable_before_first
                    and self.train
                    and self.plan.resampled
                ):
                    raise self._no_data()
                continue
            usable += 1
            batch.append(decoded)
            if len(batch) == self.batch_size:
                made += 1
                if snapshot is not None:
                    snapshot(produced + made, done=quota is not None and made == quota)
                yield collate_samples(batch, self.skips.key, self.text_pad_id)
                batch = []
                if quota is not None and made == quota:
                    return
        if quota is None:
            if batch:  # evaluation: the last, partial batch counts
                yield collate_samples(batch, self.skips.key, self.text_pad_id)
            return
        if not usable and not produced:
            # This reader's shards held not one usable sample (all failed, or all bad): counted, not fatal; the
            # training loop stops the run if the whole epoch yields nothing.
            logger.warning(f"{self.source}: the shards of reader (rank {self.rank}) held no usable sample")
        # Training ran out of shards before its quota (not resampled): the partial batch is dropped.
        if batch:
            self.skips.count("dropped", f"{len(batch)} samples of a last partial batch", n=len(batch))
        if snapshot is not None:
            snapshot(produced + made, done=True)
