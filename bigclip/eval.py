"""Evaluation: validation loss and image<->text retrieval, and zero-shot classification.

Every rank takes part and calls the engine's forward (never a rank-0-only forward of the bare model):
with sharded engines each forward is a collective. Each rank evaluates the loader it is given, in lockstep
with the others (a rank with fewer batches steps with a stand-in whose outputs are dropped); per-rank sums
are all-reduced, and retrieval over the whole validation set uses features gathered from all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bigclip.data.imagenet import ZEROSHOT_SETS, imagenet_prompts
from bigclip.dist import World, all_reduce_sum
from bigclip.errors import UserError
from bigclip.flag_fields import EVAL, flag, non_negative_int, positive_int
from bigclip.log import logger

RETRIEVAL_PRECISIONS = ("fp32", "model")


def _gather_rows(x: torch.Tensor, world: World) -> torch.Tensor:
    if not world.distributed:
        return x
    dev = world.device if world.backend == "nccl" else torch.device("cpu")
    x = x.to(dev)
    sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(world.world_size)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=dev))
    biggest = int(max(s.item() for s in sizes))
    padded = torch.zeros((biggest, *x.shape[1:]), dtype=x.dtype, device=dev)
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(world.world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)]).cpu()


def retrieval_ranks(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: float, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's rank (0: first) among all texts for its image, and among all images for its text, exactly,
    without the N x N score matrix: scores are computed `chunk` x `chunk` at a time (memory O(chunk^2) for the
    scores, O(N) for the ranks; chunk 0: one block). A candidate ranks above the true partner when its score is
    higher, or equal with a smaller index (OpenCLIP main's --val-retrieval-chunk-size rule; argsort's order of
    ties in 3.3 is unspecified). The true pair's score is taken from the same block product the candidates'
    scores come from, so it is compared with itself bit for bit."""
    n = image_features.shape[0]
    chunk = n if chunk <= 0 else min(chunk, n)
    starts = range(0, n, chunk)

    def block(i: int, j: int) -> torch.Tensor:
        return logit_scale * image_features[i : i + chunk] @ text_features[j : j + chunk].t()

    targets = torch.cat([block(i, i).diagonal() for i in starts])
    image_ranks = torch.zeros(n, dtype=torch.long)
    text_ranks = torch.zeros(n, dtype=torch.long)
    for i in starts:
        rows = torch.arange(i, min(i + chunk, n))[:, None]
        for j in starts:
            scores = block(i, j)
            cols = torch.arange(j, min(j + chunk, n))[None, :]
            row_target, col_target = targets[rows], targets[cols]
            image_ranks[rows[:, 0]] += ((scores > row_target) | ((scores == row_target) & (cols < rows))).sum(1)
            text_ranks[cols[0]] += ((scores > col_target) | ((scores == col_target) & (rows < cols))).sum(0)
    return image_ranks, text_ranks


def retrieval_metrics(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: float, chunk: int = 0
) -> dict[str, float]:
    """OpenCLIP's retrieval metrics: mean/median rank and R@1/5/10, both directions. Pair i is (i, i)."""
    metrics = {}
    image_ranks, text_ranks = retrieval_ranks(image_features, text_features, logit_scale, chunk)
    for name, ranks in (("image_to_text", image_ranks), ("text_to_image", text_ranks)):
        ranks = ranks.numpy()
        metrics[f"{name}_mean_rank"] = float(ranks.mean()) + 1
        metrics[f"{name}_median_rank"] = float(np.floor(np.median(ranks))) + 1  # numpy's median, as OpenCLIP's
        for k in (1, 5, 10):
            metrics[f"{name}_R@{k}"] = float((ranks < k).mean())
    return metrics


def lockstep(loader, world: World):
    """(batch, real) pairs, as many on every rank as the rank with the most batches has.

    Forward passes of sharded engines (FSDP, ZeRO-3) are collectives, and a rank's share of a validation
    set need not be as long as the others' (WebDataset shards split unevenly, or fewer shards than ranks).
    A rank that has run out keeps stepping with a stand-in batch (its first one, or zeros shaped like
    another rank's) whose outputs the caller drops, instead of leaving the others waiting forever."""
    if not world.distributed:
        for batch in loader:
            yield batch, True
        return
    batches, stand_in = iter(loader), None
    while True:
        batch = next(batches, None) if batches is not None else None
        if batch is None:
            batches = None  # exhausted: never asked again
        elif stand_in is None:
            stand_in = batch
        flags = torch.tensor([float(batch is not None), float(stand_in is not None)])
        have_batch, have_stand_in = all_reduce_sum(flags, world).tolist()
        if have_batch == 0:
            return
        if have_stand_in < world.world_size:  # collective: once, when some rank has never had a batch
            stand_in = _zeros_like_anyones(stand_in, world)
        yield (batch, True) if batch is not None else (stand_in, False)


def _zeros_like_anyones(batch, world: World):
    """This rank's batch if it has one, else a one-sample batch of zeros shaped like another rank's."""
    shapes = [None] * world.world_size
    mine = None if batch is None else [(tuple(t.shape[1:]), t.dtype) for t in batch]
    dist.all_gather_object(shapes, mine)
    if batch is not None:
        return batch
    template = next(s for s in shapes if s is not None)
    return tuple(torch.zeros((1, *shape), dtype=dtype) for shape, dtype in template)


@torch.no_grad()
def validate(engine, loader, world: World, chunk: int = 4096, precision: str = "fp32") -> dict[str, float]:
    """Validation loss (per batch, as OpenCLIP) and exact retrieval metrics over every rank's samples (chunk,
    precision: --val-retrieval-chunk-size, --val-retrieval-precision)."""
    device = world.device
    image_chunks, text_chunks = [], []
    # (sum of per-sample loss, samples, sum of per-sample caption loss: a captioning model's, CoCa)
    loss_sum = torch.zeros(3, dtype=torch.float64)
    logit_scale = 1.0
    for (images, texts), real in lockstep(loader, world):
        images = images.to(device, dtype=engine.precision.param_dtype, non_blocking=True)
        texts = texts.to(device, non_blocking=True)
        with engine.autocast():
            out = engine.module(images=images, texts=texts)
        img, txt = out["image_features"].float(), out["text_features"].float()
        # kept for retrieval in float32, or with --val-retrieval-precision model in the features' own dtype
        kept_img, kept_txt = (out["image_features"], out["text_features"]) if precision == "model" else (img, txt)
        logit_scale = float(out["logit_scale"].float().mean())
        if not real:  # a stand-in (lockstep): only its feature width is kept, for an empty share
            image_chunks.append(kept_img[:0].cpu())
            text_chunks.append(kept_txt[:0].cpu())
            continue
        logits = logit_scale * img @ txt.t()
        if "logit_bias" in out:
            logits = logits + out["logit_bias"].float()
        labels = torch.arange(img.shape[0], device=device)
        # Per batch, as OpenCLIP reports it: the contrastive loss within each validation batch.
        batch_loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        caption = 0.0
        if "logits" in out:  # OpenCLIP's val_generative_loss: the caption cross-entropy over every token, padding too
            caption = F.cross_entropy(out["logits"].float().flatten(0, 1), out["labels"].flatten()).item()
        loss_sum += torch.tensor([batch_loss.item(), 1, caption], dtype=torch.float64) * img.shape[0]
        image_chunks.append(kept_img.cpu())
        text_chunks.append(kept_txt.cpu())
    loss_sum = all_reduce_sum(loss_sum, world)
    if loss_sum[1] == 0:
        return {}
    image_features = _gather_rows(torch.cat(image_chunks), world)
    text_features = _gather_rows(torch.cat(text_chunks), world)
    metrics = retrieval_metrics(image_features, text_features, logit_scale, chunk)
    metrics["val_loss"] = float(loss_sum[0] / loss_sum[1])
    if "logits" in out:
        metrics["val_generative_loss"] = float(loss_sum[2] / loss_sum[1])
    metrics["num_samples"] = int(loss_sum[1])
    return metrics


def _check_val_count(evaluated: int, val, expected: int | None, world: World) -> None:
    """Every validation sample is evaluated exactly once: with --val-num-samples, the samples evaluated plus
    those skipped as unusable (summed over ranks) must make up that number; a difference is reported."""
    if not expected:
        return
    counts = val.skipped()
    skipped = int(all_reduce_sum(torch.tensor([float(sum(counts.values()))], dtype=torch.float64), world)[0])
    if evaluated + skipped != expected and world.is_main:
        logger.warning(
            f"validation: {evaluated} samples evaluated and {skipped} skipped as unusable, but --val-num-samples "
            f"is {expected}; check the flag against the validation shards"
        )


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
    return _gather_rows(torch.cat(embeddings), world)[: len(classnames)].to(world.device).t()


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


@dataclass(frozen=True)
class EvalConfig:
    """When evaluation runs (OpenCLIP's frequencies, in epochs) and what the validation set should hold."""

    val_frequency: int = flag(1, "Validate every N epochs.", EVAL, check=positive_int)
    zeroshot_frequency: int = flag(2, "Zero-shot evaluation every N epochs.", EVAL, check=positive_int)
    val_retrieval_chunk_size: int = flag(
        4096,
        "Validation retrieval ranks are exact and computed this many rows and columns at a time, never the whole "
        "N x N score matrix; 0: one block (OpenCLIP main's flag).",
        EVAL,
        check=non_negative_int,
    )
    val_retrieval_precision: str = flag(
        "fp32",
        "fp32: retrieval scores in float32; model: in the features' own dtype (OpenCLIP main's flag).",
        EVAL,
        choices=RETRIEVAL_PRECISIONS,
    )
    eval_ema: bool = flag(
        False,
        "With --ema-decay: also evaluate the moving average of the weights; its metrics are named ema_<metric> "
        "(new in bigclip).",
        EVAL,
    )
    # read here, owned by another slice (its flag is declared there)
    epochs: int = 32  # the last epoch always evaluates
    val_num_samples: int | None = None
    ema_decay: float | None = None


def evaluate(engine, data: dict, tokenizer, cfg: EvalConfig, completed_epoch: int, world: World) -> dict[str, float]:
    """Run what is due after `completed_epoch` epochs (OpenCLIP's frequencies; the last epoch always); with
    --eval-ema the same again with the moving average of the weights swapped in (metrics named ema_<metric>)."""
    engine.eval()
    metrics = _evaluate_weights(engine, data, tokenizer, cfg, completed_epoch, world)
    if cfg.eval_ema and engine.ema is not None and metrics:
        with engine.ema.swapped_in():
            averaged = _evaluate_weights(engine, data, tokenizer, cfg, completed_epoch, world)
        metrics.update({f"ema_{k}": v for k, v in averaged.items()})
    engine.train()
    return metrics


def _evaluate_weights(engine, data: dict, tokenizer, cfg: EvalConfig, completed_epoch: int, world: World) -> dict:
    metrics: dict[str, float] = {}
    last = completed_epoch == cfg.epochs
    if completed_epoch % cfg.zeroshot_frequency == 0 or last:
        if "zeroshot" in data:
            metrics.update(
                zero_shot(engine, data["zeroshot"].dataloader, tokenizer, data["classnames"], data["templates"], world)
            )
        metrics.update(imagenet_zero_shot(engine, data, tokenizer, world))
    if "val" in data and (completed_epoch % cfg.val_frequency == 0 or last):
        chunk, precision = cfg.val_retrieval_chunk_size, cfg.val_retrieval_precision
        metrics.update(validate(engine, data["val"].dataloader, world, chunk, precision))
        _check_val_count(metrics.get("num_samples", 0), data["val"], cfg.val_num_samples, world)
    return metrics


def check_eval(cfg: EvalConfig) -> None:
    if cfg.eval_ema and cfg.ema_decay is None:
        raise UserError("--eval-ema: there is no moving average to evaluate without --ema-decay; add it")
