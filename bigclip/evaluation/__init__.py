"""Evaluation: validation loss and image<->text retrieval, and zero-shot classification; `evaluate` runs what is
due after an epoch of training (`bigclip eval`, commands/eval.py, runs the zero-shot part alone).

Every rank takes part and calls the engine's forward (never a rank-0-only forward of the bare model):
with sharded engines each forward is a collective. Each rank evaluates the loader it is given, in lockstep
with the others (a rank with fewer batches steps with a stand-in whose outputs are dropped); per-rank sums
are all-reduced, and retrieval over the whole validation set uses features gathered from all ranks.

    config.py     EvalConfig: when evaluation runs and how retrieval is computed, and its rules
    lockstep.py   every rank steps together (lockstep) and the rows each computed are gathered (gather_rows)
    retrieval.py  OpenCLIP's retrieval metrics, exact, a block of scores at a time
    validate.py   validation loss and retrieval over every rank's samples
    zero_shot.py  zero-shot classification: the demo's digits, ImageNet and ImageNet-v2
"""

from __future__ import annotations

from bigclip.dist import World
from bigclip.evaluation.config import EvalConfig
from bigclip.evaluation.validate import check_val_count, validate
from bigclip.evaluation.zero_shot import imagenet_zero_shot, zero_shot


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
        check_val_count(metrics.get("num_samples", 0), data["val"], cfg.val_num_samples, world)
    return metrics
