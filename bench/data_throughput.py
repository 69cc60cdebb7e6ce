"""WebDataset loader throughput, no model: bigclip's shard stream vs OpenCLIP's get_wds_dataset, side by side.

    python bench/data_throughput.py                  # 16 shards x 256 JPEGs, batch 64, 1 and 2 workers, local + S3
    python bench/data_throughput.py --shards 4 --samples-per-shard 64 --batch-size 16   # a quick check (~1 min)
    python bench/data_throughput.py --sources local --modes resampled --workers 2 --repeats 3
    python bench/data_throughput.py --photos 1024 --bigclip-decode reduced --sources local --modes epoch  # photos

What is timed: decode + augment + tokenize + batch, delivered to the training process and moved to the device
(CUDA if present, else the CPU: where --image-decode device decodes), nothing else. Both sides
read the same shards (written once by this script with webdataset's TarWriter: --shards x --samples-per-shard
JPEGs of smooth random pixels plus a little noise, sides drawn from --image-sizes, about 20 KB each, and a
random caption as .txt), apply the same callables (open_clip.image_transform(224, is_train=True), OpenCLIP's
training augmentation, and open_clip.get_tokenizer("ViT-B-32")) and deliver the same number of batches:

  bigclip   bigclip.data.get_data(cfg, ...) with a bigclip.data.DataConfig (train_data, train_num_samples,
            batch_size, workers, dataset_resampled), iterating data["train"].dataloader: the loader training uses
            (ShardStream under torchdata's StatefulDataLoader; s3:// shards are read through s3fs)
  OpenCLIP  open_clip_train.data.get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=...)
            with the same settings, iterating its WebLoader; S3 shards through `pipe:aws s3 cp s3://... -` (the
            way OpenCLIP's docs read S3: one aws CLI process per shard)

Sources: local disk (a temporary folder), and S3 = a moto server on 127.0.0.1 in this (parent) process, found by
both clients through AWS_ENDPOINT_URL and dummy keys in the children's environment. Modes: "epoch" (each shard read
once: --train-num-samples = all samples, so each worker reads exactly its shards, needs shards >= workers) and
"resampled" (--dataset-resampled, shards drawn with replacement, the same --train-num-samples).

Each measurement is a fresh child process (python bench/data_throughput.py --child JSON), bigclip and OpenCLIP
alternating, config by config. Warm-up: the first batch of each worker (process start, imports, the 1000-sample
shuffle buffer both sides fill before yielding) is timed separately ("first batches"); samples/s and CPU count
the remaining batches only. CPU = user + system seconds of the child and all its descendants (DataLoader
workers, aws CLI processes) between the two points, read with psutil (live processes, plus the reaped
children each one has waited for), per 1000 delivered samples. The S3 server's own CPU is not in it: it is
printed below the table (the parent's CPU time while each child ran, which is the server's). With --repeats N
every measurement runs N times and the run with the median samples/s is shown.

open_clip_train.data imports pandas at module level for its CSV dataset only; where pandas is not installed the
OpenCLIP child puts an empty module in its place (the WebDataset path never touches it).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bigclip-bench"
WORDS = (
    "a photo of the small large red blue green dog cat car tree house river mountain city street beach "
    "bird flower person child old new bright dark sunny rainy field road boat sky over under near with"
).split()


# ---------------------------------------------------------------------------------------------- shards
def _write_tars(folder: str, shards: int, per_shard: int, seed: int, make_jpeg) -> list[str]:
    """`shards` tar files of `per_shard` samples: a JPEG from make_jpeg(rng) and a random caption each."""
    import numpy as np
    import webdataset as wds

    rng = np.random.default_rng(seed)
    paths = []
    for s in range(shards):
        path = os.path.join(folder, f"shard-{s:06d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(per_shard):
                jpeg = make_jpeg(rng)
                caption = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 16))))
                sink.write({"__key__": f"{s:06d}_{i:06d}", "jpg": jpeg, "txt": caption})
        paths.append(path)
    return paths


def write_shards(folder: str, shards: int, per_shard: int, sizes: tuple[int, int], seed: int) -> list[str]:
    """Shards of smooth random pixels plus a little noise, sides drawn from `sizes`, JPEG quality 90."""
    import numpy as np
    from PIL import Image

    def make_jpeg(rng) -> bytes:
        w, h = (int(v) for v in rng.integers(sizes[0], sizes[1] + 1, size=2))
        small = rng.integers(0, 256, size=(h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
        pixels = (smooth + rng.normal(0, 6, size=(h, w, 3))).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        return buf.getvalue()

    return _write_tars(folder, shards, per_shard, seed, make_jpeg)


def write_photo_shards(folder: str, shards: int, per_shard: int, sides: list[int], seed: int) -> list[str]:
    """Shards of real photographs: scikit-learn's two sample photos (640x427), each sample a random crop (half to
    all of the photo's area, aspect 3:4 to 4:3) resized so its long side is one of `sides`, JPEG quality 90-95."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]

    def make_jpeg(rng) -> bytes:
        photo = photos[int(rng.integers(len(photos)))]
        area = photo.width * photo.height * rng.uniform(0.5, 1.0)
        ratio = rng.uniform(3 / 4, 4 / 3)
        w = min(photo.width, int(round((area * ratio) ** 0.5)))
        h = min(photo.height, int(round((area / ratio) ** 0.5)))
        x, y = int(rng.integers(photo.width - w + 1)), int(rng.integers(photo.height - h + 1))
        scale = int(rng.choice(sides)) / max(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        buf = io.BytesIO()
        photo.crop((x, y, x + w, y + h)).resize(size, Image.BICUBIC).save(
            buf, format="JPEG", quality=int(rng.integers(90, 96))
        )
        return buf.getvalue()

    return _write_tars(folder, shards, per_shard, seed, make_jpeg)


def brace(prefix: str, shards: int) -> str:
    return f"{prefix}shard-{{000000..{shards - 1:06d}}}.tar"


def aws_cli() -> str | None:
    """The aws CLI's own script (a pyenv shim would add a bash + pyenv start per shard), or None."""
    found = shutil.which("aws")
    if found is None:
        return None
    if os.sep + "shims" + os.sep in found:
        try:
            out = subprocess.run(["pyenv", "which", "aws"], capture_output=True, text=True, check=True)
            return out.stdout.strip() or found
        except (OSError, subprocess.CalledProcessError):
            return found
    return found


# ----------------------------------------------------------------------------------------------- child
def _cpu_tree() -> float:
    """CPU seconds of this process and every descendant: live ones, plus the children each has reaped."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone between the listing and the read: its parent's children_* has it
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _openclip_loader(spec: dict, preprocess, tokenizer):
    try:
        import pandas  # noqa: F401
    except ImportError:  # only open_clip_train's CSV dataset uses it
        import types

        sys.modules["pandas"] = types.ModuleType("pandas")
    import open_clip_train.data as ocd
    from webdataset.tariterators import tar_file_expander, url_opener

    def tarfile_to_samples_nothrow(src, handler=ocd.log_and_continue):
        # open_clip_train's own function, with the end-of-shard marker webdataset >= 0.2.96 yields turned off:
        # OpenCLIP pins webdataset <= 0.2.86 and its group_by_keys_nothrow fails on the marker (KeyError 'fname').
        files = tar_file_expander(url_opener(src, handler=handler), handler=handler, eof_value=None)
        return ocd.group_by_keys_nothrow(files, handler=handler)

    ocd.tarfile_to_samples_nothrow = tarfile_to_samples_nothrow

    args = argparse.Namespace(
        train_data=spec["url"],
        val_data=None,
        train_num_samples=spec["num_samples"],
        val_num_samples=None,
        batch_size=spec["batch_size"],
        workers=spec["workers"],
        world_size=1,
        rank=0,
        seed=spec["seed"],
        dataset_resampled=spec["resampled"],
        train_data_upsampling_factors=None,
    )
    info = ocd.get_wds_dataset(args, preprocess, is_train=True, epoch=0, floor=False, tokenizer=tokenizer)
    return info.dataloader, info.dataloader.num_batches, None


def _bigclip_loader(spec: dict, preprocess, tokenizer):
    import dataclasses

    from bigclip.data import DataConfig, get_data

    cfg = dataclasses.replace(
        DataConfig(),
        train_data=spec["url"],
        train_num_samples=spec["num_samples"],
        batch_size=spec["batch_size"],
        workers=spec["workers"],
        dataset_resampled=spec["resampled"],
        seed=spec["seed"],
        shard_prefetch_mb=spec.get("prefetch_mb", DataConfig().shard_prefetch_mb),
    )
    info = get_data(cfg, preprocess, preprocess, tokenizer, rank=0, world_size=1, epoch=0)["train"]
    return info.dataloader, info.num_batches, info


def child(spec: dict) -> dict:
    start_wall = time.perf_counter()
    import open_clip
    import torch

    torch.manual_seed(spec["seed"])
    # delivered where training reads it: --image-decode device decodes in this step (on CPU, in this process)
    target = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preprocess, chosen = open_clip.image_transform(224, is_train=True), None
    if spec["side"] == "bigclip" and spec.get("decode", "openclip") != "openclip":
        from bigclip.build import build_transforms, image_decode_choice, training_normalize_at
        from bigclip.data import DataConfig
        from bigclip.dist import World
        from bigclip.model.config import ModelConfig

        # as `bigclip train --model ViT-B-32 --image-decode ... --workers N` builds it on this device (bigclip/build.py)
        model, data = ModelConfig(model="ViT-B-32"), DataConfig(image_decode=spec["decode"], workers=spec["workers"])
        choice = image_decode_choice(data, World(device=target))
        preprocess, chosen = build_transforms(model, data, training_normalize_at(target), choice)[0], choice
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    build = _bigclip_loader if spec["side"] == "bigclip" else _openclip_loader
    loader, num_batches, info = build(spec, preprocess, tokenizer)
    warm = max(1, spec["workers"])  # the first batch of each worker: its start and shuffle-buffer fill
    cpu_start, t_start = _cpu_tree(), time.perf_counter()
    batches = samples = 0
    t0 = cpu0 = None
    for images, texts in loader:
        images = images.to(target, non_blocking=True)
        assert images.shape[1:] == (3, 224, 224) and len(texts) == len(images), (images.shape, texts.shape)
        batches += 1
        if batches == warm:
            cpu0, t0 = _cpu_tree(), time.perf_counter()
        elif batches > warm:
            samples += len(images)
    if target.type == "cuda":
        torch.cuda.synchronize()
    t1, cpu1 = time.perf_counter(), _cpu_tree()
    if info is not None:
        info.close()
    else:
        from bigclip.data.workers import shut_down_workers

        shut_down_workers(loader)
    if t0 is None:
        raise SystemExit(f"only {batches} batches: fewer than the {warm} warm-up batches")
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return {
        "batches": batches,
        "expected_batches": num_batches,
        "samples": samples,
        "seconds": t1 - t0,
        "cpu": cpu1 - cpu0,
        "first_seconds": t0 - t_start,
        "first_cpu": cpu0 - cpu_start,
        "whole_cpu": sum(u.ru_utime + u.ru_stime for u in usage),
        "whole_seconds": time.perf_counter() - start_wall,
        # what bigclip decoded where (auto's choice for this device and worker count)
        "decode_choice": None if chosen is None else {"mode": chosen.mode, "min_pixels": chosen.min_pixels},
    }


def run_child(spec: dict, env: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    before = resource.getrusage(resource.RUSAGE_SELF)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_SELF)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # This process only waits for the child; its CPU meanwhile is the S3 server's threads.
    result["server_cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


# ---------------------------------------------------------------------------------------------- parent
class _S3:
    def __init__(self, paths: list[str]):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3_server import S3Server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log

        self.server = S3Server()
        client = self.server.client()
        client.create_bucket(Bucket=BUCKET)
        for path in paths:
            with open(path, "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"shards/{os.path.basename(path)}", Body=f.read())

    def env(self) -> dict:
        return dict(os.environ, **self.server.env())


def _load() -> float:
    return os.getloadavg()[0]


def _fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--samples-per-shard", type=int, default=256)
    p.add_argument("--image-sizes", type=int, nargs=2, default=[192, 320], help="min and max side in pixels")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sources", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    p.add_argument("--modes", nargs="+", default=["epoch", "resampled"], choices=["epoch", "resampled"])
    p.add_argument("--num-samples", type=int, default=None, help="--train-num-samples (default: all samples)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--photos",
        type=int,
        nargs="+",
        default=None,
        help="shards of real photographs, long sides drawn from these (e.g. 512 1024) instead of smooth noise",
    )
    p.add_argument(
        "--bigclip-decode",
        default="openclip",
        choices=["openclip", "auto", "reduced", "full", "device"],
        help="bigclip's transform: OpenCLIP's own callable (default), or bigclip's with --image-decode "
        "reduced/full/device (device: decoded where the batch is delivered, the GPU if there is one, else this CPU)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    num_samples = args.num_samples or args.shards * args.samples_per_shard
    folder = tempfile.mkdtemp(prefix="bigclip-data-bench-")
    started = time.perf_counter()
    try:
        if args.photos:
            paths = write_photo_shards(folder, args.shards, args.samples_per_shard, args.photos, args.seed)
        else:
            paths = write_shards(folder, args.shards, args.samples_per_shard, tuple(args.image_sizes), args.seed)
        mb = sum(os.path.getsize(p) for p in paths) / 2**20
        s3 = _S3(paths) if "s3" in args.sources else None
        aws = aws_cli()
        sides = (
            f"photographs, long side {'/'.join(map(str, args.photos))} px"
            if args.photos
            else f"sides {args.image_sizes[0]}-{args.image_sizes[1]} px"
        )
        transforms = (
            "open_clip.image_transform(224, is_train=True) on both sides"
            if args.bigclip_decode == "openclip"
            else f"bigclip: its image_transform with --image-decode {args.bigclip_decode}; OpenCLIP: its own"
        )
        print(
            f"{args.shards} shards x {args.samples_per_shard} JPEGs ({mb:.0f} MB, {sides}), batch {args.batch_size}, "
            f"--train-num-samples {num_samples}, {transforms}, ViT-B-32 tokenizer; "
            f"{os.cpu_count()} CPU cores; aws CLI: {aws or 'not found'}; load average {_load():.2f} at start"
        )
        header = (
            "| source | mode | workers | samples timed | bigclip samples/s | OpenCLIP samples/s | ratio "
            "| bigclip CPU s / 1k | OpenCLIP CPU s / 1k | ratio | first batches bigclip / OpenCLIP |"
        )
        print()
        print(header)
        print("|" + "---|" * (header.count("|") - 1), flush=True)
        notes = []
        for source in args.sources:
            for mode in args.modes:
                for workers in args.workers:
                    row = {}
                    env = dict(os.environ) if source == "local" else s3.env()
                    for side in ("bigclip", "openclip"):
                        if source == "local":
                            url = brace(folder + os.sep, args.shards)
                        elif side == "bigclip":
                            url = brace(f"s3://{BUCKET}/shards/", args.shards)
                        elif aws is None:
                            row[side] = {"error": "n/a: no aws CLI for OpenCLIP's pipe:aws s3 cp"}
                            continue
                        else:
                            url = f"pipe:{aws} s3 cp --quiet {brace(f's3://{BUCKET}/shards/', args.shards)} -"
                        spec = {
                            "side": side,
                            "url": url,
                            "resampled": mode == "resampled",
                            "workers": workers,
                            "batch_size": args.batch_size,
                            "num_samples": num_samples,
                            "seed": args.seed,
                            "decode": args.bigclip_decode,
                        }
                        row[side] = spec
                    runs = {side: [] for side in row}
                    for _ in range(args.repeats):  # bigclip and OpenCLIP alternate
                        for side, spec in row.items():
                            if "error" in spec:
                                runs[side].append(spec)
                            else:
                                runs[side].append(run_child(spec, env))
                    print(_row(source, mode, workers, runs), flush=True)
                    for side, results in runs.items():
                        for r in results:
                            if "error" in r:
                                notes.append(f"{source}/{mode}/{workers}w {side}: {r['error']}")
                            elif r["batches"] != r["expected_batches"]:
                                notes.append(
                                    f"{source}/{mode}/{workers}w {side}: {r['batches']} batches, "
                                    f"expected {r['expected_batches']}"
                                )
                    if source == "s3":
                        servers = []
                        for side in ("bigclip", "openclip"):
                            ok = [r for r in runs[side] if "error" not in r]
                            if ok:
                                median = _median_run(ok)
                                servers.append(f"{side} {median['server_cpu']:.1f} s")
                        notes.append(f"S3 server CPU, whole child run, {mode}/{workers}w: {', '.join(servers)}")
        if args.bigclip_decode in ("reduced", "full"):
            notes.append(pixel_difference(paths[0], args.bigclip_decode))
        print()
        for note in notes:
            print(f"- {note}")
        print(f"- load average {_load():.2f} at the end; {time.perf_counter() - started:.0f} s in all")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if "s3" in args.sources and s3 is not None:
            s3.server.stop()


def pixel_difference(shard: str, decode: str) -> str:
    """What the model sees, bigclip's transform against OpenCLIP's on the same images and random numbers: the first
    shard's images through each (seed i for image i), the absolute difference of the final tensors in grey levels
    (x std x 255), averaged per image."""
    import tarfile

    import open_clip
    import torch
    from PIL import Image

    from bigclip.data.decode import decode_rgb
    from bigclip.data.transforms import image_transform

    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    theirs = open_clip.image_transform(224, is_train=True)
    ours = image_transform(224, True, mean, std, decode=decode)
    levels = torch.tensor(std)[:, None, None] * 255
    per_image, largest = [], 0.0
    with tarfile.open(shard) as tar:
        jpegs = [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]
    for i, data in enumerate(jpegs):
        torch.manual_seed(i)
        expected = theirs(Image.open(io.BytesIO(data)).convert("RGB"))
        torch.manual_seed(i)
        apart = (decode_rgb(io.BytesIO(data), ours) - expected).abs() * levels
        per_image.append(apart.mean().item())
        largest = max(largest, apart.max().item())
    per_image.sort()
    return (
        f"pixels, bigclip ({decode}) vs OpenCLIP, {len(per_image)} images of the first shard, same random numbers: "
        f"mean absolute difference {sum(per_image) / len(per_image):.2f} grey levels (per image: median "
        f"{per_image[len(per_image) // 2]:.2f}, largest {per_image[-1]:.2f}); largest on a pixel {largest:.0f}"
    )


def _median_run(results: list[dict]) -> dict:
    ranked = sorted(results, key=lambda r: r["samples"] / r["seconds"])
    return ranked[(len(ranked) - 1) // 2]


def _row(source: str, mode: str, workers: int, runs: dict) -> str:
    cells = {}
    for side, results in runs.items():
        ok = [r for r in results if "error" not in r]
        cells[side] = _median_run(ok) if ok else None
    b, o = cells.get("bigclip"), cells.get("openclip")

    def rate(r):
        return r["samples"] / r["seconds"] if r else 0.0

    def cpu(r):
        return 1000 * r["cpu"] / r["samples"] if r else 0.0

    def text(r, fn, fmt):
        return fmt.format(fn(r)) if r else "n/a"

    def first(r):
        return f"{r['first_seconds']:.1f} s" if r else "n/a"

    timed = sorted({r["samples"] for r in (b, o) if r})
    spread = ""
    if any(len(results) > 1 for results in runs.values()):
        spread = " (median of " + str(max(len(results) for results in runs.values())) + ")"
    return (
        f"| {source} | {mode} | {workers} | {' / '.join(map(str, timed))}{spread} | "
        f"{text(b, rate, '{:.0f}')} | {text(o, rate, '{:.0f}')} | {_fmt_ratio(rate(b), rate(o))} | "
        f"{text(b, cpu, '{:.2f}')} | {text(o, cpu, '{:.2f}')} | {_fmt_ratio(cpu(b), cpu(o))} | "
        f"{first(b)} / {first(o)} |"
    )


if __name__ == "__main__":
    main()
