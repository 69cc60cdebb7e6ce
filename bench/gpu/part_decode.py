"""GPU kit, decode: the input pipeline on web-sized photographs (long side 512 and 1024 px), delivered to the GPU,
at 2, 4 and 8 loader workers: bigclip with --image-decode device (workers parse headers and draw crops, nvJPEG
decodes the batch on the GPU) and with --image-decode reduced (workers decode on the CPU at reduced DCT scale),
samples/s and CPU-seconds per 1000 samples; which of the two --image-decode auto picks for each (the rule of
bigclip/data/decode_choice.py) beside which was faster; OpenCLIP's get_wds_dataset at 1024 px as the reference; and
how far nvJPEG's pixels are from OpenCLIP's (PIL, full decoding) on the same crops.

The loader runs are bench/data_throughput.py's children (a fresh process each, the same shards and tokenizer,
the batch moved to the device inside the timed loop).
"""

from __future__ import annotations

import io
import os

import torch
from common import Recorder, device, part_args
from data_throughput import brace, run_child, write_photo_shards


def pixel_rows(rec: Recorder, dev: torch.device, photos: int) -> None:
    """Mean and largest |difference| in 8-bit grey levels between the device path and OpenCLIP's full decoding."""
    import open_clip
    from PIL import Image
    from sklearn.datasets import load_sample_images

    from bigclip.data.decode import decode_rgb
    from bigclip.data.device_decode import collate_samples
    from bigclip.data.transforms import image_transform

    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    levels = torch.tensor(std)[:, None, None] * 255
    for train in (True, False):
        means, largest = [], 0.0
        for i in range(photos):
            image = Image.fromarray(load_sample_images().images[i % 2])
            scale = 1024 / max(image.size)
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
            buf = io.BytesIO()
            image.save(buf, "JPEG", quality=92)
            out = {}
            for decode in ("full", "device"):
                torch.manual_seed(i)
                transform = image_transform(224, train, mean, std, decode=decode)
                out[decode] = decode_rgb(io.BytesIO(buf.getvalue()), transform)
            on_device = collate_samples([(out["device"], torch.zeros(1))])[0].to(dev)[0].cpu()
            diff = (out["full"] - on_device).abs() * levels
            means.append(diff.mean().item())
            largest = max(largest, diff.max().item())
        rec.row("pixels", transform="train" if train else "eval", device=dev.type, photos=photos,
                mean_grey_levels=round(sum(means) / len(means), 3), max_grey_levels=round(largest, 1))  # fmt: skip


def loader_row(rec: Recorder, spec: dict, side: int, **extra) -> dict | None:
    r = run_child(spec, dict(os.environ))
    common = {"side": spec["side"], "decode": spec["decode"], "long_side": side, "workers": spec["workers"]}
    if "error" in r:
        rec.row("loader", **common, error=r["error"])
        return None
    row = {
        **common,
        "samples": r["samples"],
        "samples_per_s": round(r["samples"] / r["seconds"], 1),
        "cpu_s_per_1k": round(1000 * r["cpu"] / max(r["samples"], 1), 2),
        "first_batches_s": round(r["first_seconds"], 2),
        **extra,
    }
    rec.row("loader", **row)
    return row


def crossover_row(rec: Recorder, dev: torch.device, side: int, workers: int, rows: dict, pixels: float) -> None:
    """One (size, workers) pair: the faster path measured, and what --image-decode auto picks on this device for
    the shards' mean image (bigclip/data/decode_choice.py, as a run with this many workers chooses)."""
    from bigclip.data.decode_choice import choose_image_decode, loading_cores

    if not {"device", "reduced"} <= set(rows):
        return
    choice = choose_image_decode("auto", dev.type, {}, loading_cores(workers, 1))
    picks = "device" if choice.mode == "device" and pixels >= choice.min_pixels else "reduced"
    faster = max(("device", "reduced"), key=lambda d: rows[d]["samples_per_s"])
    rec.row(
        "crossover", long_side=side, workers=workers, mean_pixels=round(pixels),
        device_samples_per_s=rows["device"]["samples_per_s"], reduced_samples_per_s=rows["reduced"]["samples_per_s"],
        faster=faster, auto_picks=picks, auto_right=picks == faster,
    )  # fmt: skip


def main() -> None:
    from bigclip.data.decode_choice import PHOTO_AREA

    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    pixel_rows(rec, dev, photos=2 if args.smoke else 8)
    # batch 32: 8 workers' first batches (their start) are left out of the timing and 24 batches remain
    shards, per_shard, batch = (2, 16, 8) if args.smoke else (8, 128, 32)
    sides, worker_counts = ((512,), (1,)) if args.smoke else ((1024, 512), (2, 4, 8))
    for side in sides:
        folder = os.path.join(args.work or ".", f"decode-shards-{side}")
        os.makedirs(folder, exist_ok=True)
        write_photo_shards(folder, shards, per_shard, [side], seed=0)
        url = brace(folder + os.sep, shards)
        for workers in worker_counts:
            spec = {"url": url, "resampled": False, "workers": workers, "batch_size": batch,
                    "num_samples": shards * per_shard, "seed": 0}  # fmt: skip
            rows = {}
            for decode in ("device", "reduced"):
                row = loader_row(rec, {**spec, "side": "bigclip", "decode": decode}, side)
                if row is not None:
                    rows[decode] = row
            crossover_row(rec, dev, side, workers, rows, PHOTO_AREA * side * side)
            if side == max(sides) and workers in (min(worker_counts), max(worker_counts)):
                loader_row(rec, {**spec, "side": "openclip", "decode": "openclip"}, side)
    rec.note(
        "samples/s count the batches after each worker's first; CPU-seconds are the loader process and its workers "
        "(nvJPEG's work is on the GPU). `crossover`: per size and worker count, the faster of device and reduced "
        "decoding and what --image-decode auto picks for the shards' mean image (bigclip/data/decode_choice.py); "
        "auto_right false anywhere means the rule's figures need the measured ones."
    )


if __name__ == "__main__":
    main()
