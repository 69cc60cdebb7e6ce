"""Names of the loss implementations and the rule that picks one for a batch.

`impl` says how the logits are computed (``--loss-impl``), for every loss family; how features move
between ranks (``--loss-dist-impl``) is each family's own choice (loss/family.py).
"""

from __future__ import annotations

import torch

from bigclip.errors import UserError
from bigclip.loss import chunked
from bigclip.loss.fused_tuning import PRECISIONS, naive_max_logits

# naive: OpenCLIP's reference (materialises the logit matrix); chunked: exact tiled torch code;
# fused: cuBLAS chunks + fused Triton kernels (bigclip.loss.fused; the GPU default);
# triton: fully fused Triton tiles (bigclip.loss.triton_tiles: no chunk buffer, slower);
# auto: on CUDA the naive loss where its logits are few enough to be faster (measured, fused_tuning.json)
# and fit, the fused path otherwise; chunked on CPU.
LOSS_IMPLS = ("auto", "naive", "chunked", "fused", "triton")
LOSS_PRECISIONS = PRECISIONS  # --loss-precision: the fused path's arithmetics (loss/fused_tuning.py)
# The naive loss holds about four logit matrices at once (logits, softmax, their gradients).
NAIVE_LIVE_MATRICES = 4


def check_impl(impl: str) -> str:
    if impl not in LOSS_IMPLS:
        raise UserError(f"--loss-impl {impl!r}: choose one of {', '.join(LOSS_IMPLS)}")
    return impl


def check_precision(precision: str) -> str:
    if precision not in LOSS_PRECISIONS:
        raise UserError(f"--loss-precision {precision!r}: choose one of {', '.join(LOSS_PRECISIONS)}")
    return precision


def triton_importable() -> bool:
    """Triton is optional: CPU-only installs must import this package without it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def naive_fits(logits: int, features: torch.Tensor) -> bool:
    """Whether the naive loss's logit matrices take at most half the GPU memory free now."""
    free, _ = torch.cuda.mem_get_info(features.device)
    return NAIVE_LIVE_MATRICES * logits * features.element_size() <= free // 2


def resolve_impl(
    impl: str,
    features: torch.Tensor,
    family: str = "clip",
    logits: int | None = None,
    precision: str = "exact",
    naive_ok: bool = True,
) -> str:
    """The concrete implementation for features on their device: naive, chunked, fused or triton.

    `logits` is how many logits the naive loss would build for this call (auto's choice on a GPU). auto never
    picks a path that would ignore what the flags asked for: --loss-precision other than exact is the fused
    path's alone, and `naive_ok` is False where the naive loss would not make the exchange asked for
    (--loss-dist-impl)."""
    if impl == "auto":
        if precision != "exact":
            if not (features.is_cuda and triton_importable()):
                raise UserError(
                    f"--loss-precision {precision}: only the fused loss has it, which needs a CUDA GPU and triton; "
                    f"drop the flag"
                )
            return "fused"
        if not (features.is_cuda and triton_importable()):
            return "chunked"
        n = logits if logits is not None else features.shape[0] ** 2
        fits = n <= naive_max_logits(family, features.dtype) and naive_fits(n, features)
        return "naive" if naive_ok and fits else "fused"
    if impl in ("triton", "fused"):
        if not triton_importable():
            raise UserError(f"--loss-impl {impl} needs the 'triton' package; install it or use --loss-impl chunked.")
        from bigclip.loss.triton_tiles import triton_interpreted  # imports triton, which is known to import now

        if not features.is_cuda and not triton_interpreted():
            raise UserError(
                f"--loss-impl {impl} needs CUDA tensors (or TRITON_INTERPRET=1 for the slow CPU interpreter); "
                "use --loss-impl chunked on CPU."
            )
    return impl


def backend_for(impl: str, precision: str = "exact"):
    """The object offering the block primitives for a tiled implementation (chunked, fused or triton).

    The Triton backends are imported here, on first use, so that Triton stays optional.
    """
    if impl == "fused":
        from bigclip.loss.fused import FusedBackend

        return FusedBackend(precision)
    if impl == "triton":
        from bigclip.loss import triton as triton_backend

        return triton_backend
    return chunked
