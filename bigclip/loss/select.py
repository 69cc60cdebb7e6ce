"""Names of the loss implementations and the rule that picks one for a batch.

`impl` says how the logits are computed (``--loss-impl``), for every loss family; how features move
between ranks (``--loss-dist-impl``) is each family's own choice (loss/family.py).
"""

from __future__ import annotations

import torch

from bigclip.errors import UserError
from bigclip.loss import chunked

# naive: OpenCLIP's reference (materialises the logit matrix); chunked: exact tiled torch code;
# triton: fused kernels; auto: triton on CUDA tensors when Triton imports, chunked elsewhere.
LOSS_IMPLS = ("auto", "naive", "chunked", "triton")


def check_impl(impl: str) -> str:
    if impl not in LOSS_IMPLS:
        raise UserError(f"--loss-impl {impl!r}: choose one of {', '.join(LOSS_IMPLS)}")
    return impl


def triton_importable() -> bool:
    """Triton is optional: CPU-only installs must import this package without it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, features: torch.Tensor) -> str:
    """The concrete implementation for features on their device: naive, chunked or triton."""
    if impl == "auto":
        return "triton" if features.is_cuda and triton_importable() else "chunked"
    if impl == "triton":
        if not triton_importable():
            raise UserError("--loss-impl triton needs the 'triton' package; install it or use --loss-impl chunked.")
        from bigclip.loss.triton_tiles import triton_interpreted  # imports triton, which is known to import now

        if not features.is_cuda and not triton_interpreted():
            raise UserError(
                "--loss-impl triton needs CUDA tensors (or TRITON_INTERPRET=1 for the slow CPU interpreter); "
                "use --loss-impl chunked on CPU."
            )
    return impl


def backend_for(impl: str):
    """The module offering the four block primitives for a fused implementation (chunked or triton).

    The Triton backend is imported here, on first use, so that Triton stays optional.
    """
    if impl == "triton":
        from bigclip.loss import triton as triton_backend

        return triton_backend
    return chunked
