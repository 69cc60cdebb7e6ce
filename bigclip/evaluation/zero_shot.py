"""Zero-shot classification: a classifier from the text embeddings of every class's prompts (split across
ranks), then top-1/top-5 over a set of labelled images; the embedded demo's digits and ImageNet
(--imagenet-val, --imagenet-v2) with OpenCLIP's class names, templates and metric names."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bigclip.data.imagenet import ZEROSHOT_SETS, imagenet_prompts
from bigclip.dist import World, all_reduce_sum
from bigclip.evaluation.lockstep import gather_rows, lockstep

# open_clip_train's zero-shot evaluation encodes 10 classes' prompts per forward (800 with ImageNet's 80
# templates), whatever the training batch size.
CLASSES_PER_FORWARD = 10


@torch.no_grad()
def zero_shot_classifier(
    engine,
    tokenizer,
    classnames: list[str],
    templates: list[str],
    world: World,
    classes_per_batch: int = CLASSES_PER_FORWARD,
) -> torch.Tensor:
    """(embed_dim, num_classes): the normalised mean text embedding of every class's prompts.

    Computed once per evaluation and split across ranks: each rank encodes 1/world of the classes (the last
    share padded with repeats), `classes_per_batch` whole classes per forward, and the shares are
    all-gathered. Every rank runs the same number of forwards, as sharded engines need (each forward is a
    collective)."""
    per_rank = math.ceil(len(classnames) / world.world_size)
    mine = list(range(world.rank * per_rank, min(len(classnames), (world.rank + 1) * per_rank)))
    mine += [mine[-1] if mine else 0] * (per_rank - len(mine))
    embeddings = []
    for start in range(0, per_rank, classes_per_batch):
        chunk = mine[start : start + classes_per_batch]
        tokens = tokenizer([t.format(classnames[c]) for c in chunk for t in templates]).to(world.device)
        with engine.autocast():
            feats = engine.module(texts=tokens)["text_features"].float()
        embeddings.append(F.normalize(feats.view(len(chunk), len(templates), -1).mean(dim=1), dim=-1))
    return gather_rows(torch.cat(embeddings), world)[: len(classnames)].to(world.device).t()


@torch.no_grad()
def zero_shot_accuracy(engine, loader, classifier: torch.Tensor, world: World) -> tuple[float, float, int]:
    """(top-1, top-5, images) over the whole set, every rank evaluating its share in lockstep."""
    counts = torch.zeros(3, dtype=torch.float64)  # top-1 hits, top-5 hits, samples
    for (images, labels), real in lockstep(loader, world):
        images, labels = images.to(world.device, dtype=engine.precision.param_dtype), labels.to(world.device)
        with engine.autocast():
            feats = engine.module(images=images)["image_features"].float()
        if not real:
            continue
        logits = feats @ classifier
        topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = topk == labels.view(-1, 1)
        counts += torch.tensor([hits[:, :1].sum().item(), hits.sum().item(), labels.numel()], dtype=torch.float64)
    counts = all_reduce_sum(counts, world)
    n = max(1.0, float(counts[2]))
    return float(counts[0]) / n, float(counts[1]) / n, int(counts[2])


def zero_shot(engine, loader, tokenizer, classnames: list[str], templates: list[str], world: World) -> dict[str, float]:
    """The embedded demo's held-out digits."""
    classifier = zero_shot_classifier(engine, tokenizer, classnames, templates, world)
    top1, top5, n = zero_shot_accuracy(engine, loader, classifier, world)
    return {"zeroshot_top1": top1, "zeroshot_top5": top5, "zeroshot_samples": n, "zeroshot_chance": 1 / len(classnames)}


def imagenet_zero_shot(engine, data: dict, tokenizer, world: World) -> dict[str, float]:
    """--imagenet-val / --imagenet-v2 with OpenCLIP's class names, templates and metric names; one classifier
    serves both sets."""
    sets = {prefix: data[prefix] for prefix in ZEROSHOT_SETS.values() if prefix in data}
    if not sets:
        return {}
    classnames, templates = imagenet_prompts()
    classifier = zero_shot_classifier(engine, tokenizer, classnames, templates, world)
    metrics = {}
    for prefix, info in sets.items():
        top1, top5, _ = zero_shot_accuracy(engine, info.dataloader, classifier, world)
        metrics[f"{prefix}-top1"], metrics[f"{prefix}-top5"] = top1, top5
    return metrics
