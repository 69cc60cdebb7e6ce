"""The `triton` backend: the block primitives of `bigclip.loss.chunked`, as fully fused tile kernels.

The losses take a backend and call `clip_block_stats`, `clip_block_grads`, `siglip_block_sums`,
`siglip_block_grads` and `siglip_block_sums_and_grads` on it, so this module only gathers the CLIP and
SigLIP kernels' launchers under those names. It imports Triton: import it only where Triton is
wanted (`bigclip.loss.select.backend_for`).
"""

from __future__ import annotations

from bigclip.loss.triton_clip import clip_block_grads, clip_block_stats
from bigclip.loss.triton_siglip import siglip_block_grads, siglip_block_sums

__all__ = [
    "clip_block_stats",
    "clip_block_grads",
    "siglip_block_sums",
    "siglip_block_grads",
    "siglip_block_sums_and_grads",
]


def siglip_block_sums_and_grads(image, text, scale, bias, diag, coef, need_image=True, need_text=True, tile=None):
    """The tile kernels have no one-pass form: the sums, then the gradients (two passes over the tiles)."""
    sums = siglip_block_sums(image, text, scale, bias, diag)
    return (sums, *siglip_block_grads(image, text, scale, bias, diag, coef, need_image, need_text))
