"""GPU kit, decode: the input pipeline on web-sized photographs (long side 1024 px), delivered to the GPU: bigclip
with --image-decode device (workers parse headers and draw crops, nvJPEG decodes the batch on the GPU) and with
--image-decode reduced (workers decode on the CPU at reduced DCT scale) vs OpenCLIP's get_wds_dataset, samples/s
and CPU-seconds per 1000 samples at 2 and 8 loader workers; and how far nvJPEG's pixels are from OpenCLIP's
(PIL, full decoding) on the same crops.

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


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    dev = device()
    pixel_rows(rec, dev, photos=2 if args.smoke else 8)
    shards, per_shard, batch = (2, 16, 8) if args.smoke else (8, 128, 64)
    folder = os.path.join(args.work or ".", "decode-shards")
    os.makedirs(folder, exist_ok=True)
    write_photo_shards(folder, shards, per_shard, [1024], seed=0)
    url = brace(folder + os.sep, shards)
    for workers in (1,) if args.smoke else (2, 8):
        for side, decode in (("bigclip", "device"), ("bigclip", "reduced"), ("openclip", "openclip")):
            spec = {"side": side, "url": url, "resampled": False, "workers": workers, "batch_size": batch,
                    "num_samples": shards * per_shard, "seed": 0, "decode": decode}  # fmt: skip
            r = run_child(spec, dict(os.environ))
            if "error" in r:
                rec.row("loader", side=side, decode=decode, workers=workers, error=r["error"])
                continue
            rec.row(
                "loader",
                side=side,
                decode=decode,
                workers=workers,
                samples=r["samples"],
                samples_per_s=round(r["samples"] / r["seconds"], 1),
                cpu_s_per_1k=round(1000 * r["cpu"] / max(r["samples"], 1), 2),
                first_batches_s=round(r["first_seconds"], 2),
            )
    rec.note(
        "samples/s count the batches after each worker's first; CPU-seconds are the loader process and its workers "
        "(nvJPEG's work is on the GPU). Goal: device decoding at least 2x OpenCLIP's samples per CPU-second."
    )


if __name__ == "__main__":
    main()
