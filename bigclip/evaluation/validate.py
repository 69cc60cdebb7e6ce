"""Validation: the loss per batch (as OpenCLIP reports it) and exact retrieval metrics over every rank's
samples, and the check that --val-num-samples were all evaluated or skipped."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from bigclip.dist import World, all_reduce_sum
from bigclip.evaluation.lockstep import gather_rows, lockstep
from bigclip.evaluation.retrieval import retrieval_metrics

logger = logging.getLogger("bigclip")


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
    image_features = gather_rows(torch.cat(image_chunks), world)
    text_features = gather_rows(torch.cat(text_chunks), world)
    metrics = retrieval_metrics(image_features, text_features, logit_scale, chunk)
    metrics["val_loss"] = float(loss_sum[0] / loss_sum[1])
    if "logits" in out:
        metrics["val_generative_loss"] = float(loss_sum[2] / loss_sum[1])
    metrics["num_samples"] = int(loss_sum[1])
    return metrics


def check_val_count(evaluated: int, val, expected: int | None, world: World) -> None:
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
