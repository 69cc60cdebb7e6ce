"""EvalConfig: the slice of the flags evaluation reads (when it runs, how retrieval is computed), and its
rules."""

from __future__ import annotations

from dataclasses import dataclass

from bigclip.errors import UserError
from bigclip.flag_fields import EVAL, flag, non_negative_int, positive_int

RETRIEVAL_PRECISIONS = ("fp32", "model")


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


def check_eval(cfg: EvalConfig) -> None:
    if cfg.eval_ema and cfg.ema_decay is None:
        raise UserError("--eval-ema: there is no moving average to evaluate without --ema-decay; add it")
