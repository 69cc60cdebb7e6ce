"""The `triton` backend: the four block primitives of `bigclip.loss.chunked`, as fused kernels.

The losses take a backend module and call `clip_block_stats`, `clip_block_grads`,
`siglip_block_sums` and `siglip_block_grads` on it, so this module only gathers the CLIP and
SigLIP kernels' launchers under those names. It imports Triton: import it only where Triton is
wanted (`bigclip.loss.select.backend_for`).
"""

from __future__ import annotations

from bigclip.loss.triton_clip import clip_block_grads, clip_block_stats
from bigclip.loss.triton_siglip import siglip_block_grads, siglip_block_sums

__all__ = ["clip_block_stats", "clip_block_grads", "siglip_block_sums", "siglip_block_grads"]
