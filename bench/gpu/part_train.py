"""GPU kit, training throughput: bigclip (launch/train.py) vs OpenCLIP 3.3's open_clip_train, the same flags
(ViT-B-32, synthetic data, batch 256, --precision amp, one process each), side by side and alternating, two
repetitions each: samples/s per GPU, median over the steps after the first 10.

The two synthetic sources differ: open_clip_train's makes a PIL image per sample and runs the model's transform
on it; bigclip's makes normalised tensors directly. The data-time column says whether a run waited for its
loader (bigclip's metrics.jsonl; open_clip_train's "Data (t)" of the same log lines).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO, Recorder, part_args
from harness import bigclip_records, open_clip_records, trainer_env, trainer_flags

SKIP = 10  # warm-up steps left out of the median (compilation, allocator growth, loader start)

TINY = {  # the smoke run's model, as an OpenCLIP local-dir: config both trainers read
    "model_cfg": {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2},
    },
    "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]},
}


def bigclip_run(common: list[str], logs: str, name: str) -> tuple[list[float], list[float]]:
    subprocess.run([sys.executable, os.path.join(REPO, "launch", "train.py"), *common], check=True, env=trainer_env())
    records = bigclip_records(logs, name)
    return [r["samples_per_s_per_gpu"] for r in records], [r["data_time"] / r["batch_time"] for r in records]


def open_clip_run(common: list[str], logs: str, name: str) -> tuple[list[float], list[float]]:
    subprocess.run([sys.executable, "-m", "open_clip_train.main", *common], check=True, env=trainer_env())
    rows = open_clip_records(logs, name)
    # "Data (t)" is the step's data wait in seconds; samples/s/gpu = batch / step time gives the step time.
    return [per_gpu for _, per_gpu in rows], [data_s * per_gpu / BATCH[0] for data_s, per_gpu in rows]


BATCH = [256]


def main() -> None:
    args = part_args(__doc__.split("\n\n")[0])
    rec = Recorder(args.out)
    with tempfile.TemporaryDirectory(prefix="bigclip-gpu-train-", dir=args.work) as work:
        measure(args.smoke, work, rec)


def measure(smoke: bool, work: str, rec: Recorder) -> None:
    if smoke:
        os.makedirs(os.path.join(work, "tiny"), exist_ok=True)
        with open(os.path.join(work, "tiny", "open_clip_config.json"), "w") as f:
            json.dump(TINY, f)
        model, BATCH[0], steps, precision, workers, reps = f"local-dir:{work}/tiny", 8, SKIP + 2, "fp32", 0, 1
    else:
        model, BATCH[0], steps, precision, workers, reps = "ViT-B-32", 256, SKIP + 40, "amp", 8, 2
    results: dict[str, list[float]] = {"bigclip": [], "open_clip_train": []}
    for rep in range(reps):
        for trainer, run in (("open_clip_train", open_clip_run), ("bigclip", bigclip_run)):
            name = f"{trainer}-{rep}"
            t = time.perf_counter()
            common = trainer_flags(model, BATCH[0], BATCH[0] * steps, work, name, precision, workers)
            per_gpu, data_share = run(common, work, name)
            steady, share = per_gpu[SKIP:] or per_gpu, data_share[SKIP:] or data_share
            results[trainer].append(statistics.median(steady))
            rec.row(
                "runs",
                trainer=trainer,
                repetition=rep,
                model=model,
                batch=BATCH[0],
                precision=precision,
                steps_measured=len(steady),
                samples_per_s_per_gpu=round(statistics.median(steady), 1),
                data_time_share=f"{statistics.median(share):.1%}",
                wall_s=round(time.perf_counter() - t, 1),
            )
    ratio = statistics.median(results["bigclip"]) / statistics.median(results["open_clip_train"])
    rec.row(
        "summary",
        bigclip_samples_per_s=round(statistics.median(results["bigclip"]), 1),
        open_clip_train_samples_per_s=round(statistics.median(results["open_clip_train"]), 1),
        bigclip_vs_open_clip=f"{ratio:.2f}x",
    )


if __name__ == "__main__":
    main()
