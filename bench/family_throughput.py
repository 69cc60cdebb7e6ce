"""Throughput of OpenCLIP's model families: bigclip (launch/train.py) vs OpenCLIP 3.3's open_clip_train, the same
flags, side by side: a CLIP, the same CLIP distilled from a teacher, and a CoCa.

    python bench/family_throughput.py [--batch-size 32] [--steps 40] [--reps 2] [--threads 2]

Student, teacher and CoCa are small ViTs given to both trainers as OpenCLIP local-dir: configs (the teacher's
weights an OpenCLIP state dict both load), synthetic data, fp32, one process each, runs alternating. Setups: plain
(the student), distill (the student with `--distill-model/--distill-pretrained`), coca (the CoCa: contrastive +
caption loss); samples/s is the median over the steps after the first 10 (bigclip: its metrics.jsonl;
open_clip_train: its log lines). The two synthetic sources differ: open_clip_train's makes a PIL image per sample
and runs the transform; bigclip's makes tensors directly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from harness import REPO, bigclip_records, open_clip_records, trainer_env, trainer_flags

SKIP = 10
PREPROCESS = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}
TEXT = {"context_length": 32, "vocab_size": 49408, "heads": 4}
STUDENT = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 4, "width": 128, "head_width": 32, "patch_size": 8},
    "text_cfg": {**TEXT, "width": 128, "layers": 4},
}
TEACHER = {
    "embed_dim": 128,
    "vision_cfg": {"image_size": 64, "layers": 6, "width": 256, "head_width": 32, "patch_size": 8},
    "text_cfg": {**TEXT, "width": 256, "layers": 6},
}

# the student's towers with CoCa's pooler, class token and a caption decoder as wide as the text tower. The model
# name (its local-dir: path) must contain "coca": that is how open_clip_train picks CoCa's loss.
COCA = {
    "embed_dim": 128,
    "vision_cfg": {**STUDENT["vision_cfg"], "attentional_pool": True, "attn_pooler_heads": 4, "output_tokens": True},
    "text_cfg": {**TEXT, "context_length": 31, "width": 128, "layers": 4, "embed_cls": True, "output_tokens": True},
    "multimodal_cfg": {**TEXT, "context_length": 31, "width": 128, "layers": 4},
    "custom_text": True,  # how OpenCLIP's factory tells a CoCa config (with the multimodal_cfg)
}


def _write_model(work: str, name: str, cfg: dict) -> str:
    directory = os.path.join(work, name)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": cfg, "preprocess_cfg": PREPROCESS}, f)
    return f"local-dir:{directory}"


def _teacher_weights(teacher: str, path: str) -> None:
    import open_clip
    import torch

    torch.manual_seed(0)
    torch.save(open_clip.create_model(teacher).state_dict(), path)


def bigclip_run(args, flags: list[str], logs: str, name: str) -> list[float]:
    subprocess.run(
        [sys.executable, os.path.join(REPO, "launch", "train.py"), *flags], check=True,
        env=trainer_env(OMP_NUM_THREADS=str(args.threads)), capture_output=True, text=True,
    )  # fmt: skip
    return [r["samples_per_s"] for r in bigclip_records(logs, name)]


def open_clip_run(args, flags: list[str], logs: str, name: str) -> list[float]:
    subprocess.run(
        [sys.executable, "-m", "open_clip_train.main", "--device", "cpu", *flags], check=True,
        env=trainer_env(OMP_NUM_THREADS=str(args.threads)), capture_output=True, text=True,
    )  # fmt: skip
    return [per_gpu for _, per_gpu in open_clip_records(logs, name)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bigclip-family-bench-") as work:
        student, teacher = _write_model(work, "student", STUDENT), _write_model(work, "teacher", TEACHER)
        coca = _write_model(work, "coca", COCA)
        weights = os.path.join(work, "teacher.pt")
        _teacher_weights(teacher, weights)
        results: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            for setup, model, extra in (
                ("plain", student, []),
                ("distill", student, ["--distill-model", teacher, "--distill-pretrained", weights]),
                ("coca", coca, []),
            ):
                for trainer, run in (("open_clip_train", open_clip_run), ("bigclip", bigclip_run)):
                    name = f"{trainer}-{setup}-{rep}"
                    flags = trainer_flags(model, args.batch_size, args.batch_size * args.steps, work, name)
                    per_step = run(args, [*flags, *extra], work, name)
                    results.setdefault((setup, trainer), []).append(statistics.median(per_step[SKIP:] or per_step))
    median = {key: statistics.median(values) for key, values in results.items()}
    print("| setup | open_clip_train samples/s | bigclip samples/s | bigclip vs open_clip |")
    print("|---|---:|---:|---:|")
    for setup in ("plain", "distill", "coca"):
        oc, ours = median[(setup, "open_clip_train")], median[(setup, "bigclip")]
        print(f"| {setup} | {oc:.1f} | {ours:.1f} | {ours / oc:.2f}x |")
    for trainer in ("open_clip_train", "bigclip"):
        cost = median[("distill", trainer)] / median[("plain", trainer)]
        print(f"{trainer}: with the teacher at {cost:.2f}x of its samples/s without")


if __name__ == "__main__":
    main()
