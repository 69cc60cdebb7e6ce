"""EvalConfig: the slice of the flags evaluation reads (when it runs, how retrieval is computed), and its
rules."""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.data import reads_without_path
from bigclip.errors import UserError
from bigclip.flag_fields import EVAL, Applies, flag, non_negative_int, positive_int

RETRIEVAL_PRECISIONS = ("fp32", "model")

# What each evaluation acts on (flag_fields.Applies): a validation split (--val-data; synthetic data's
# --val-num-samples; the demo's digits), the zero-shot sets (--imagenet-val / --imagenet-v2; the demo's digits)
WITH_VAL = Applies(
    lambda c: bool(c.val_data or c.demo or (reads_without_path(c.dataset_type) and c.val_num_samples)),
    "with validation data (--val-data)",
)
WITH_ZEROSHOT = Applies(
    lambda c: bool(c.imagenet_val or c.imagenet_v2 or c.demo), "with --imagenet-val or --imagenet-v2"
)
# in fp32 the features' own dtype is float32 already
IN_16_BITS = Applies(
    lambda c: c.precision != "fp32", "where the model computes in 16 bits (--precision other than fp32)"
)


@dataclass(frozen=True)
class EvalConfig:
    """When evaluation runs (OpenCLIP's frequencies, in epochs) and what the validation set should hold."""

    val_frequency: int = flag(1, "Validate every N epochs.", EVAL, check=positive_int, applies=WITH_VAL)
    zeroshot_frequency: int = flag(
        2, "Zero-shot evaluation every N epochs.", EVAL, check=positive_int, applies=WITH_ZEROSHOT
    )
    val_retrieval_chunk_size: int = flag(
        4096,
        "Validation retrieval ranks are exact and computed this many rows and columns at a time, never the whole "
        "N x N score matrix; 0: one block (OpenCLIP main's flag).",
        EVAL,
        check=non_negative_int,
        applies=WITH_VAL,
    )
    val_retrieval_precision: str = flag(
        "fp32",
        "fp32: retrieval scores in float32; model: in the features' own dtype (OpenCLIP main's flag).",
        EVAL,
        choices=RETRIEVAL_PRECISIONS,
        applies=(WITH_VAL, IN_16_BITS),
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


def check_eval(cfg: EvalConfig) -> None:
    if cfg.eval_ema and cfg.ema_decay is None:
        raise UserError("--eval-ema: there is no moving average to evaluate without --ema-decay; add it")
