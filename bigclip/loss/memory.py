"""What the contrastive loss holds at its peak on one rank, for `bigclip plan` and `--dry-run`: by the
implementation --loss-impl picks (auto as on a GPU), the family, the exchange between ranks, the per-rank batch,
the world size and the features' width and dtype.

Checked against the GPU kit's measured peaks (docs/benchmarks.md, GPU section: "the fused contrastive losses";
one rank; tests/test_loss_memory.py): the naive loss holds four logit matrices (32.25 GiB measured at N = 65536
bf16, 32 GiB here); the fused path a chunk of float32 logits, a chunk of G (two parts at exact precision for
16-bit features) and float32 feature gradients (1.51 / 1.25 GiB measured at N = 65536 bf16 exact / fast, 1.50 /
1.25 here).
"""

from __future__ import annotations

import torch

from bigclip.loss import chunked
from bigclip.loss.collectives import text_pieces, texts_per_step
from bigclip.loss.family import LOSSES, LossConfig, check_dist_impl
from bigclip.loss.fused_tuning import launch_plan, naive_max_logits
from bigclip.loss.select import NAIVE_LIVE_MATRICES

CHUNKED_TILE_BUFFERS = 3  # the chunked path's live tiles: logits, one exp, one product (loss/chunked.py)
TRITON_WORKSPACE_ROWS = 2 * 264  # the tile kernels' (programs x N) float32 workspaces: 2 x 2 x 132 SMs


def _family(cfg: LossConfig) -> str:
    return "siglip" if cfg.siglip or cfg.loss == "siglip" else cfg.loss


def chosen_impl(cfg: LossConfig, batch: int, world: int, feature_bytes: int, device_type: str = "cuda") -> str:
    """The implementation --loss-impl names, auto resolved as it would be for this batch (without the free-memory
    check, which needs the GPU)."""
    if cfg.loss_impl != "auto":
        return cfg.loss_impl
    if device_type != "cuda":
        return "chunked"
    family = LOSSES.get(_family(cfg))
    exchange = check_dist_impl(cfg.loss_dist_impl, family)
    if cfg.loss_precision != "exact" or exchange not in (family.naive_dist_impls or (exchange,)):
        return "fused"  # what only the fused path does (loss/select.py's resolve_impl)
    dtype = torch.bfloat16 if feature_bytes == 2 else torch.float32
    return "naive" if naive_logits(cfg, batch, world) <= naive_max_logits(_family(cfg), dtype) else "fused"


def naive_logits(cfg: LossConfig, batch: int, world: int) -> int:
    """Logits OpenCLIP's loss builds on one rank: the global square (or local rows against all with --local-loss)
    for CLIP; one B x B block at a time for SigLIP."""
    if _family(cfg) == "siglip":
        return batch * batch
    rows = batch * world
    return 2 * batch * rows if cfg.local_loss and world > 1 else rows * rows


def loss_peak_bytes(
    cfg: LossConfig, batch: int, world: int, dim: int, feature_bytes: int, device_type: str = "cuda"
) -> float:
    """Bytes the loss holds at its peak on one rank, the feature gradients it returns included."""
    family = _family(cfg)
    dist_impl = check_dist_impl(cfg.loss_dist_impl, LOSSES.get(family)) if world > 1 else "local"
    impl = chosen_impl(cfg, batch, world, feature_bytes, device_type)
    row_bytes = batch * dim  # one rank's features, in elements
    outputs = 2 * row_bytes * feature_bytes
    if impl == "naive":
        gathered = 2 * (world - 1) * row_bytes * feature_bytes if family == "clip" else 0
        kept = world if family == "siglip" else 1  # autograd keeps every SigLIP block's logits until backward
        return NAIVE_LIVE_MATRICES * kept * naive_logits(cfg, batch, world) * feature_bytes + gathered + outputs
    # texts against which this rank's images are computed at once, and what travels with them
    all_texts = dist_impl == "gather"
    columns = batch * world if all_texts else batch
    travelling = row_bytes  # elements of the texts one exchange moves at a time
    if dist_impl in ("ring", "bidir", "shift"):  # pieces (loss/collectives.py), each way bidir's steps go
        per_step = texts_per_step(dist_impl, world)
        travelling = -(-batch // text_pieces(batch, per_step)) * dim * per_step
    texts_held = (world * row_bytes if all_texts else 2 * travelling) * feature_bytes if world > 1 else 0
    grads = (1 + (world if all_texts else 1)) * row_bytes * 4  # float32 image and text gradients
    if world > 1 and not all_texts:
        grads += 2 * travelling * 4  # a text gradient sent and one received while the next texts are computed
    if family == "siglip" and world > 1 and dist_impl in ("gather", "reduce"):
        grads += 2 * (world - 1) * row_bytes * 4  # each block's gradients kept from forward to backward
    if impl == "fused":
        dtype = torch.bfloat16 if feature_bytes == 2 else torch.float32
        rows = min(batch, launch_plan(family, dtype, columns, batch, torch.device("cuda"), None).chunk_rows)
        parts = 2 if feature_bytes == 2 and cfg.loss_precision == "exact" else 1
        buffers = rows * columns * (4 + parts * feature_bytes)
    elif impl == "chunked":
        buffers = CHUNKED_TILE_BUFFERS * min(batch, chunked.TILE) * min(columns, chunked.TILE) * 4
    else:  # triton: tiles in registers, (programs x N) workspaces
        buffers = TRITON_WORKSPACE_ROWS * columns * 4
    # the end: the float32 gradients cast to the features' dtype; SigLIP's, computed in forward and kept, are first
    # scaled by the incoming gradient (one float32 product at a time, itself the output for float32 features)
    end = grads + outputs + (row_bytes * 4 if family == "siglip" and feature_bytes != 4 else 0)
    return max(buffers + grads + texts_held, end)
