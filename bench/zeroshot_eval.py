"""Zero-shot ImageNet evaluation, CPU: bigclip vs open_clip's own zero-shot code on the same weights, side by side.

    python bench/zeroshot_eval.py                       # ViT-B-32, 1 template, 256 images: ~4 min on 2 idle cores
    python bench/zeroshot_eval.py --templates 80 --images 1000      # OpenCLIP's 80 templates: hours on 2 cores
    python bench/zeroshot_eval.py --openclip-classes-per-batch 10   # open_clip_train's own text batching
    python bench/zeroshot_eval.py --repeats 2      # on a shared machine: best of 2 interleaved rounds (~8 min)

Three timed runs, each a fresh child process, on the same randomly initialised OpenCLIP model (open_clip.create_model
after torch.manual_seed(--seed), saved once to a temporary .pt file that both sides load) and the same temporary
ImageNet-layout folder (1000 synset folders; --images JPEGs of random pixels, --image-size 500 375 by default, the
commonest ImageNet val size, spread over distinct classes):

  open_clip   open_clip.create_model_and_transforms(pretrained=FILE) -> open_clip.build_zero_shot_classifier
              (OpenCLIP's 1000 class names x the first --templates of its 80 templates) -> open_clip_train's
              zero_shot.run() loop over a torchvision ImageFolder DataLoader with open_clip's preprocess_val
              (model(image=...), 100 * f @ W); top-k counted here by the rank of the true class
              (open_clip_train's accuracy() fails under numpy 2, see tests/test_zeroshot_imagenet.py)
  bigclip     the `bigclip eval --pretrained FILE --imagenet-val DIR` command itself (bigclip.cli.main), with
              bigclip.evaluation.zero_shot.imagenet_prompts cut to the same templates and timers around its
              zero_shot_classifier and zero_shot_accuracy (each starts after a barrier; with 2 ranks the slower
              rank's time is reported)
  bigclip x2  the same command under `python -m torch.distributed.run --nproc_per_node 2` (gloo, --engine ddp):
              each rank encodes 1/2 of the classes and the shares are all-gathered; each rank evaluates half of
              the images and the counts are all-reduced

Threads, the same cores for every run: the single-process runs (open_clip, bigclip) get --threads intra-op
threads (default: all cores, os.cpu_count()); the two ranks get --threads // 2 each (1 + 1 on 2 cores), through
OMP_NUM_THREADS / MKL_NUM_THREADS and torch.set_num_threads. So "2 ranks vs 1 process" asks whether splitting the
classes and images across processes beats giving one process all the cores.

Both sides run fp32, --batch-size images per forward, no loader workers (the folder is scanned before the clock
starts). Text: bigclip encodes --batch-size // --templates classes per forward (its rule); open_clip gets the same
number by default (the implementations compared at equal batch); --openclip-classes-per-batch 10 gives
open_clip_train's fixed 10. "whole command" is the child's wall time: imports, model build, weight load,
classifier and evaluation (and torchrun's start for 2 ranks). CPU time (getrusage, all threads; summed over the
ranks) is printed beside wall time: it is steadier when other jobs share the cores, though it also counts OpenMP's
spin-waiting. The 1-minute load average before and after each run is printed: the machine may be shared
(with --repeats: the lowest before and the highest after over the rounds).

Agreement: the classifiers are compared element by element; per image, the top-1 class and the set of top-5 classes
are compared with open_clip's (bigclip's from its image features, kept by a forward hook, times its classifier,
after the clock stops). A fourth, untimed run feeds the images through bigclip's eval transform into open_clip's
model and classifier, which tells differences in preprocessing apart from differences in the model or the
zero-shot code.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter

from ranks import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_CLASSES = 1000


def _cpu_seconds() -> float:
    # CPU time of all of this process's threads: steadier than wall time when other jobs share the cores.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


# ---------------------------------------------------------------- children


def openclip_child(spec: dict) -> dict:
    """open_clip's zero-shot code: build_zero_shot_classifier, then open_clip_train.zero_shot.run()'s loop.

    With spec["check"]: no timing run; open_clip's saved classifier and model on images through bigclip's eval
    transform (the one `bigclip eval` builds from its flags), to tell preprocessing apart from the rest."""
    _set_threads(spec["threads"])
    import open_clip
    import torch
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    model, _, preprocess = open_clip.create_model_and_transforms(
        spec["model"], pretrained=spec["weights"], precision="fp32"
    )
    model.eval()
    tokenizer = open_clip.get_tokenizer(spec["model"])

    saved = os.path.join(spec["out"], "classifier_openclip.pt")
    start, cpu = time.perf_counter(), _cpu_seconds()
    if spec.get("check"):
        from bigclip.build import build_transforms
        from bigclip.cli_args import parse_train_args

        run = parse_train_args(spec["check"])[0].sections
        preprocess = build_transforms(run.model, run.data)[1]
        classifier = torch.load(saved, weights_only=True)
    else:
        classifier = open_clip.build_zero_shot_classifier(
            model,
            tokenizer,
            IMAGENET_CLASSNAMES,
            OPENAI_IMAGENET_TEMPLATES[: spec["templates"]],
            num_classes_per_batch=spec["classes_per_batch"],
            device="cpu",
            use_tqdm=False,
        )
        torch.save(classifier, saved)
    build, build_cpu = time.perf_counter() - start, _cpu_seconds() - cpu

    # OpenCLIP's imagenet-val loader (open_clip_train.data.get_imagenet): ImageFolder + preprocess_val.
    dataset = ImageFolder(spec["root"], transform=preprocess, allow_empty=True)
    loader = DataLoader(dataset, batch_size=spec["batch_size"], num_workers=0, shuffle=False)
    start, cpu = time.perf_counter(), _cpu_seconds()
    top1 = top5 = n = 0
    kept = []  # (logits, labels) per batch: the per-image predictions, compared with bigclip's after the clock
    with torch.inference_mode():  # open_clip_train.zero_shot.run(), fp32 (no autocast)
        for images, target in loader:
            output = model(image=images)
            image_features = output["image_features"] if isinstance(output, dict) else output[0]
            logits = 100.0 * image_features @ classifier
            rank_of_truth = (logits > logits.gather(1, target.view(-1, 1))).sum(dim=1)
            top1 += int((rank_of_truth < 1).sum())
            top5 += int((rank_of_truth < 5).sum())
            n += images.size(0)
            kept.append((logits, target))
    evaluate, eval_cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    predictions = [p for logits, target in kept for p in _predictions(logits, target)]
    out = {"build_s": build, "eval_s": evaluate, "build_cpu": build_cpu, "eval_cpu": eval_cpu}
    return {**out, "top1": top1, "top5": top5, "images": n, "predictions": predictions}


def _predictions(logits, labels) -> list[list[int]]:
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return [[int(label), *map(int, row)] for label, row in zip(labels, top)]


def bigclip_child(spec: dict, argv: list[str]) -> int:
    """`bigclip eval ARGV`, templates cut to spec["templates"], the classifier and the evaluation timed."""
    _set_threads(spec["threads"])
    import torch
    import torch.distributed as dist

    import bigclip.evaluation.zero_shot as ev
    from bigclip import cli

    rank = int(os.environ.get("RANK", "0"))
    record: dict = {"rank": rank}
    all_prompts, classifier_fn, accuracy_fn = ev.imagenet_prompts, ev.zero_shot_classifier, ev.zero_shot_accuracy

    def prompts():
        classnames, templates = all_prompts()
        return classnames, templates[: spec["templates"]]

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if dist.is_initialized():
                dist.barrier()  # every rank starts the clock together (model build times differ)
            start, cpu = time.perf_counter(), _cpu_seconds()
            out = fn(*args, **kwargs)
            record[name], record[name.replace("_s", "_cpu")] = time.perf_counter() - start, _cpu_seconds() - cpu
            return out

        return wrapper

    def classifier(*args, **kwargs):
        kwargs["classes_per_batch"] = spec["classes_per_batch"]  # the same text batches as open_clip's
        weights = timed("build_s", classifier_fn)(*args, **kwargs)
        if rank == 0:
            torch.save(weights.cpu(), os.path.join(spec["out"], f"classifier_bigclip{spec['ranks']}.pt"))
        return weights

    def accuracy(engine, loader, weights, world):
        # Keep each real batch's image features and labels (a forward hook, a clone per batch) to compare the
        # per-image predictions with open_clip's after the clock stops.
        steps, features = [], []

        def keep(module, inputs, output):
            features.append(output["image_features"].detach().float().clone())

        def lockstep(loader, world):
            for batch, real in all_lockstep(loader, world):
                steps.append(batch[1] if real else None)
                yield batch, real

        hook = engine.module.register_forward_hook(keep)
        ev.lockstep = lockstep
        try:
            top1, top5, n = timed("eval_s", accuracy_fn)(engine, loader, weights, world)
        finally:
            hook.remove()
            ev.lockstep = all_lockstep
        record.update(top1=round(top1 * n), top5=round(top5 * n), images=n, predictions=[])
        for labels, feats in zip(steps, features):
            if labels is not None:
                record["predictions"] += _predictions(feats @ weights.to(feats.device), labels)
        return top1, top5, n

    all_lockstep = ev.lockstep
    ev.imagenet_prompts, ev.zero_shot_classifier, ev.zero_shot_accuracy = prompts, classifier, accuracy
    code = cli.main(["eval", *argv])
    with open(os.path.join(spec["out"], f"bigclip{spec['ranks']}.rank{rank}.json"), "w") as f:
        json.dump(record, f)
    return code


# ---------------------------------------------------------------- parent


def make_weights(model_name: str, seed: int, path: str) -> None:
    import open_clip
    import torch

    torch.manual_seed(seed)
    model = open_clip.create_model(model_name)  # OpenCLIP's random init, OpenCLIP's layout
    torch.save(model.state_dict(), path)


def make_imagenet_tree(root: str, images: int, size: tuple[int, int], seed: int) -> None:
    """1000 synset-like class folders (sorted order = class index); image i in class i * 997 mod 1000."""
    import numpy as np
    from PIL import Image

    names = [f"n{1440764 + 17 * i:08d}" for i in range(NUM_CLASSES)]
    for name in names:
        os.makedirs(os.path.join(root, name))
    rng = np.random.default_rng(seed)
    for i in range(images):
        label = (i * 997) % NUM_CLASSES  # distinct classes for the first 1000 images, spread over all of them
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, names[label], f"img{i:06d}.JPEG"), quality=90)


def _load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


loads: list[tuple[float, float]] = []  # 1-minute load average before and after each child


def run_child(cmd: list[str], threads: int) -> tuple[float, subprocess.CompletedProcess]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    load, start = _load_average(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    loads.append((load, _load_average()))
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-6000:])
        raise SystemExit(f"child failed ({out.returncode}): {' '.join(cmd)}")
    return wall, out


def measure_openclip(spec: dict) -> dict:
    wall, out = run_child([sys.executable, __file__, "--child", "openclip", json.dumps(spec)], spec["threads"])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "load": loads[-1]}


def bigclip_flags(spec: dict, args) -> list[str]:
    """`bigclip eval`'s flags."""
    return [
        "--model",
        args.model,
        "--pretrained",
        spec["weights"],
        "--imagenet-val",
        spec["root"],
        "--batch-size",
        str(args.batch_size),
        "--workers",
        "0",
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--seed",
        str(args.seed),
    ]


def measure_bigclip(spec: dict, args) -> dict:
    child = [__file__, "--child", "bigclip", json.dumps(spec), *bigclip_flags(spec, args)]
    if spec["ranks"] == 1:
        cmd = [sys.executable, *child]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={spec['ranks']}",
            f"--master_port={free_port()}",
            child[0],
            "--",  # see README (torchrun vs --logs)
            *child[1:],
        ]
    wall, out = run_child(cmd, spec["threads"])
    printed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"model"')]
    if len(printed) != 1:
        raise SystemExit(f"bigclip eval printed {len(printed)} JSON results, expected 1:\n{out.stdout[-2000:]}")
    ranks = []
    for r in range(spec["ranks"]):
        with open(os.path.join(spec["out"], f"bigclip{spec['ranks']}.rank{r}.json")) as f:
            ranks.append(json.load(f))
    metrics = printed[0]["metrics"]
    return {
        "build_s": max(r["build_s"] for r in ranks),  # the ranks finish together (the gather); the slowest
        "eval_s": max(r["eval_s"] for r in ranks),
        "build_cpu": sum(r["build_cpu"] for r in ranks),
        "eval_cpu": sum(r["eval_cpu"] for r in ranks),
        "top1": ranks[0]["top1"],
        "top5": ranks[0]["top5"],
        "images": ranks[0]["images"],
        "printed_top1": metrics["imagenet-zeroshot-val-top1"],
        "printed_top5": metrics["imagenet-zeroshot-val-top5"],
        "wall_s": wall,
        "load": loads[-1],
        "predictions": [p for r in ranks for p in r["predictions"]],
    }


def _max_diff(out: str, a: str, b: str) -> float:
    import torch

    x = torch.load(os.path.join(out, a), weights_only=True).float()
    y = torch.load(os.path.join(out, b), weights_only=True).float()
    return float((x - y).abs().max())


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "--":  # torchrun passes the separator through
        argv = argv[1:]
    if argv[:1] == ["--child"]:
        kind, spec = argv[1], json.loads(argv[2])
        if kind == "openclip":
            print(json.dumps(openclip_child(spec)))
        else:
            sys.exit(bigclip_child(spec, argv[3:]))
        return

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--templates", type=int, default=1, help="first K of OpenCLIP's 80 templates (default 1)")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward; bigclip's --batch-size")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of a single process")
    parser.add_argument(
        "--openclip-classes-per-batch",
        type=int,
        default=None,
        help="open_clip's num_classes_per_batch (default: bigclip's here, --batch-size // --templates)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        nargs=2,
        default=(500, 375),
        metavar=("W", "H"),
        help="JPEG size (default 500 375, the commonest in ImageNet val)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="interleaved rounds of the three runs; each time: the lowest"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.templates <= 80:
        parser.error("--templates must be 1 ... 80")
    ranks_threads = max(1, args.threads // 2)
    bigclip_cpb = max(1, args.batch_size // args.templates)  # --batch-size prompts per text forward
    openclip_cpb = args.openclip_classes_per_batch or bigclip_cpb

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "val")
        weights = os.path.join(tmp, f"{args.model}.pt")
        make_imagenet_tree(root, args.images, args.image_size, args.seed)
        make_weights(args.model, args.seed, weights)
        base = {"model": args.model, "weights": weights, "root": root, "out": tmp, "templates": args.templates}
        base["batch_size"] = args.batch_size
        rounds = []  # interleaved: open_clip, bigclip, bigclip x2, open_clip, ...
        for _ in range(args.repeats):
            rounds.append(
                (
                    measure_openclip({**base, "threads": args.threads, "classes_per_batch": openclip_cpb}),
                    measure_bigclip(
                        {**base, "threads": args.threads, "ranks": 1, "classes_per_batch": bigclip_cpb}, args
                    ),
                    measure_bigclip(
                        {**base, "threads": ranks_threads, "ranks": 2, "classes_per_batch": bigclip_cpb}, args
                    ),
                )
            )
        openclip, one, two = (_fastest([r[i] for r in rounds]) for i in range(3))
        # Not timed: open_clip's model and classifier on bigclip's eval transform (separates preprocessing).
        check = {**base, "threads": args.threads, "check": bigclip_flags(base, args)}
        openclip["same_transform"] = measure_openclip(check)
        diff_one = _max_diff(tmp, "classifier_openclip.pt", "classifier_bigclip1.pt")
        diff_two = _max_diff(tmp, "classifier_bigclip1.pt", "classifier_bigclip2.pt")

    report(args, openclip, one, two, (openclip_cpb, bigclip_cpb, ranks_threads), (diff_one, diff_two))


def _fastest(runs: list[dict]) -> dict:
    """The first run, with each time the lowest of all runs and the load average range over them."""
    best = dict(runs[0])
    for key in ("build_s", "eval_s", "build_cpu", "eval_cpu", "wall_s"):
        best[key] = min(r[key] for r in runs)
    best["load"] = (min(r["load"][0] for r in runs), max(r["load"][1] for r in runs))
    return best


def _same_predictions(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """Images (matched by label, as multisets) whose top-1, and whose set of top-5 classes, are the same."""
    top1 = Counter((p[0], p[1]) for p in a) & Counter((p[0], p[1]) for p in b)
    top5 = Counter((p[0], frozenset(p[1:])) for p in a) & Counter((p[0], frozenset(p[1:])) for p in b)
    return sum(top1.values()), sum(top5.values())


def report(args, openclip: dict, one: dict, two: dict, batching: tuple, diffs: tuple) -> None:
    openclip_cpb, bigclip_cpb, ranks_threads = batching
    prompts = NUM_CLASSES * args.templates
    print(
        f"{args.model}, random init (seed {args.seed}), fp32, CPU ({os.cpu_count()} cores); "
        f"{NUM_CLASSES} classes x {args.templates} template(s) = {prompts} prompts"
        + (" (OpenCLIP's recipe has 80; fewer to fit in minutes)" if args.templates < 80 else "")
        + f"; {openclip['images']} images of {args.image_size[0]}x{args.image_size[1]}, {args.batch_size} per forward; "
        f"text forwards of {openclip_cpb * args.templates} prompts (open_clip) / "
        f"{bigclip_cpb * args.templates} (bigclip); time ratios < 1 are faster"
        + (f"; each time the lowest of {args.repeats} interleaved rounds" if args.repeats > 1 else "")
    )
    print()
    print(
        "| setup | threads | classifier build | prompts/s | build vs open_clip | build CPU time (vs open_clip) "
        "| eval | images/s | eval vs open_clip | eval CPU time (vs open_clip) | whole command | load avg before/after |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [
        ("open_clip: build_zero_shot_classifier + zero_shot.run loop", f"{args.threads}", openclip),
        ("bigclip eval, 1 process", f"{args.threads}", one),
        ("bigclip eval, 2 ranks (gloo)", f"{ranks_threads} per rank", two),
    ]
    for label, threads, r in rows:
        print(
            f"| {label} | {threads} | {r['build_s']:.1f} s | {prompts / r['build_s']:.1f} | "
            f"{r['build_s'] / openclip['build_s']:.2f}x | "
            f"{r['build_cpu']:.0f} s ({r['build_cpu'] / openclip['build_cpu']:.2f}x) | "
            f"{r['eval_s']:.1f} s | {r['images'] / r['eval_s']:.1f} | {r['eval_s'] / openclip['eval_s']:.2f}x | "
            f"{r['eval_cpu']:.0f} s ({r['eval_cpu'] / openclip['eval_cpu']:.2f}x) | {r['wall_s']:.1f} s | "
            f"{r['load'][0]:.1f} / {r['load'][1]:.1f} |"
        )
    print()
    print(
        f"bigclip 2 ranks vs 1 process (time ratio): classifier build {two['build_s'] / one['build_s']:.2f}x "
        f"(CPU time {two['build_cpu'] / one['build_cpu']:.2f}x), eval {two['eval_s'] / one['eval_s']:.2f}x "
        f"(CPU time {two['eval_cpu'] / one['eval_cpu']:.2f}x), whole command {two['wall_s'] / one['wall_s']:.2f}x"
    )
    printed = all(
        abs(r["printed_top1"] - r["top1"] / r["images"]) < 1e-9
        and abs(r["printed_top5"] - r["top5"] / r["images"]) < 1e-9
        for r in (one, two)
    )
    print(
        f"Classifier max |diff|: open_clip vs bigclip {diffs[0]:.1e}, bigclip 1 process vs 2 ranks {diffs[1]:.1e}; "
        f"bigclip eval's printed JSON equals its counts: {'yes' if printed else 'NO'}. Per image (matched by "
        f"label), the same top-1 / the same set of top-5 classes as open_clip's; random weights and images, so "
        f"top-k themselves are near chance (0.1% / 0.5%) and only the per-image columns test much:"
    )
    print()
    print("| run | image transform | top-1 | top-5 | vs open_clip | vs open_clip on bigclip's transform |")
    print("|---|---|---:|---:|---:|---:|")
    checked = openclip["same_transform"]
    rows = [
        ("open_clip", "open_clip's", openclip),
        ("open_clip (not timed)", "bigclip's", checked),
        ("bigclip eval, 1 process", "bigclip's", one),
        ("bigclip eval, 2 ranks", "bigclip's", two),
    ]
    for label, transform, r in rows:
        same = [_same_predictions(ref["predictions"], r["predictions"]) for ref in (openclip, checked)]
        print(
            f"| {label} | {transform} | {r['top1']}/{r['images']} | {r['top5']}/{r['images']} | "
            + " | ".join(f"{a} / {b}" for a, b in same)
            + " |"
        )


if __name__ == "__main__":
    main()
