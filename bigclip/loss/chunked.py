"""Tile primitives of the exact contrastive losses in plain torch (the `chunked` implementation).

A *block* is a set of rows (image features, M x D) against a set of columns (text features,
N x D): the whole batch on one process, or one rank's share against another rank's in the
distributed variants. The primitives walk a block in tiles of at most TILE x TILE logits, so the
largest tensor they ever create is one tile; nothing of size M x N exists, forward or backward.

Choices, and why:
- Tiles are large (2048 x 2048 by default): one tile is a single big matmul, so Python overhead
  is negligible next to BLAS and the chunked path runs at about the speed of the naive one.
- Every tile is computed in float32 from features upcast tile by tile. The product of two bf16
  (or fp16) numbers is exact in fp32, so this equals a low-precision matmul with fp32
  accumulation; gradients are accumulated in fp32 and cast to the input dtype by the caller.
- The CLIP forward pass yields both directions from one pass over the tiles: per-row and
  per-column log-sum-exp, plus the softmax-weighted mean of the unscaled logit x = i.t in each
  row and column. Those means are d lse / d logit_scale, so the scale gradient needs no extra
  pass in backward. Backward recomputes each tile from the features and the saved O(M + N)
  statistics (the FlashAttention recipe).
- SigLIP needs no normalisation, so its forward pass only sums the loss and the two numbers
  that make the scale and bias gradients: sum(dz * x) and sum(dz) with dz = dloss/dlogit.

`diag` names the positive pairs: row i's positive is column i + diag (None: no positives, the
negative-only blocks of the distributed SigLIP loss).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

TILE = 2048


def full_precision(fn):
    """Run fn outside any autocast region: autocast would turn the fp32 tile matmuls into bf16."""

    @functools.wraps(fn)
    def wrapper(image, *args, **kwargs):
        with torch.autocast(image.device.type, enabled=False):
            return fn(image, *args, **kwargs)

    return wrapper


@full_precision
def positive_logits(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Unscaled logits of the positive pairs, image_i . text_i, in float32 (both backends)."""
    return torch.linalg.vecdot(image.float(), text.float(), dim=1)


def _spans(n: int, tile: int | None):
    tile = tile or TILE  # read at call time, so tests and benchmarks can change TILE
    return [(start, min(start + tile, n)) for start in range(0, n, tile)]


def _tiles(image: torch.Tensor, text: torch.Tensor, tile: int | None):
    """(row slice, column slice, image rows, text columns) for each tile of a block, row-major.

    Each tile's features are upcast to float32 here, image rows once per row of tiles.
    """
    for r0, r1 in _spans(image.shape[0], tile):
        rows = image[r0:r1].float()
        for c0, c1 in _spans(text.shape[0], tile):
            yield slice(r0, r1), slice(c0, c1), rows, text[c0:c1].float()


def _diagonal(tile: torch.Tensor, r0: int, c0: int, diag: int | None):
    """The view of a tile's positive pairs and the global column index of its first element."""
    if diag is None:
        return None, 0
    k = r0 + diag - c0  # positive pairs sit on the k-th diagonal of this tile
    rows, cols = tile.shape
    if k >= cols or -k >= rows:
        return None, 0
    return tile.diagonal(k), c0 + max(k, 0)


def merge_lse(lse: torch.Tensor, mean: torch.Tensor, other_lse: torch.Tensor, other_mean: torch.Tensor):
    """(log-sum-exp, softmax-weighted mean) over the union of two sets of logits, from each set's own.

    This is how statistics are built piece by piece: over tiles here, over ranks in the distributed
    ring. Each mean counts with its set's share exp(lse - combined lse) of the softmax mass.
    """
    new = torch.logaddexp(lse, other_lse)
    return new, mean * torch.exp(lse - new) + other_mean * torch.exp(other_lse - new)


@full_precision
def clip_block_stats(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, tile: int | None = None):
    """Row and column statistics of the logits scale * image @ text.T.

    Returns (row_lse, row_mean, col_lse, col_mean), float32, where *_mean is the softmax-weighted
    mean of the unscaled logit along that row or column.
    """
    m, n = image.shape[0], text.shape[0]
    dev = image.device
    row_lse = torch.empty(m, device=dev)
    row_mean = torch.empty(m, device=dev)
    col_lse = torch.full((n,), float("-inf"), device=dev)
    col_mean = torch.zeros(n, device=dev)
    for r0, r1 in _spans(m, tile):
        rows = image[r0:r1].float()
        r_lse = torch.full((r1 - r0,), float("-inf"), device=dev)
        r_mean = torch.zeros(r1 - r0, device=dev)
        for c0, c1 in _spans(n, tile):
            x = rows @ text[c0:c1].float().T
            s = x * scale
            for dim, lse, mean in ((1, r_lse, r_mean), (0, col_lse[c0:c1], col_mean[c0:c1])):
                peak = s.amax(dim, keepdim=True)
                e = torch.sub(s, peak).exp_()  # in-place steps: at most three tiles alive
                total = e.sum(dim)
                weighted = e.mul_(x).sum(dim) / total
                merged_lse, merged_mean = merge_lse(lse, mean, peak.squeeze(dim) + torch.log(total), weighted)
                lse.copy_(merged_lse)  # lse and mean are views into the running statistics
                mean.copy_(merged_mean)
        row_lse[r0:r1] = r_lse
        row_mean[r0:r1] = r_mean
    return row_lse, row_mean, col_lse, col_mean


def _clip_tile_grad(s, row_lse, col_lse, alpha, beta, r0, c0, diag):
    """G = alpha_j softmax_row + beta_j softmax_col - (alpha_j + beta_j) [positive] for one tile.

    alpha and beta arrive sliced to this tile's columns.
    """
    g = torch.sub(s, row_lse[:, None]).exp_().mul_(alpha)
    g.add_(torch.sub(s, col_lse[None, :]).exp_().mul_(beta))
    pos, first = _diagonal(g, r0, c0, diag)
    if pos is not None:
        local = slice(first - c0, first - c0 + pos.numel())
        pos.sub_(alpha[local] + beta[local])
    return g


def _feature_grads(image, text, scale, need_image, need_text, tile, tile_grads):
    """(d_image, d_text) = scale * (sum over tiles of G @ text, G.T @ image), float32, None where not wanted.

    Both losses' backward passes have this shape and differ only in G, dL/dS of one tile:
    `tile_grads(rows, cols, row_slice, col_slice)` gives (G for the images, G for the texts).
    The factor scale of dS/dfeatures is applied once at the end, not per tile.
    """
    dev = image.device
    d_image = torch.zeros(image.shape, device=dev) if need_image else None
    d_text = torch.zeros(text.shape, device=dev) if need_text else None
    for rs, cs, rows, cols in _tiles(image, text, tile):
        g_image, g_text = tile_grads(rows, cols, rs, cs)
        if need_image:
            d_image[rs].addmm_(g_image, cols)
        if need_text:
            d_text[cs].addmm_(g_text.T, rows)
    if need_image:
        d_image.mul_(scale)
    if need_text:
        d_text.mul_(scale)
    return d_image, d_text


@full_precision
def clip_block_grads(
    image: torch.Tensor,
    text: torch.Tensor,
    scale: torch.Tensor,
    row_lse: torch.Tensor,
    col_lse: torch.Tensor,
    weights_image: tuple[torch.Tensor, torch.Tensor],
    weights_text: tuple[torch.Tensor, torch.Tensor] | None,
    diag: int | None,
    need_image: bool = True,
    need_text: bool = True,
    tile: int | None = None,
):
    """Gradients of a weighted CLIP objective w.r.t. a block's image and text features.

    With S = scale * image @ text.T, P_row = softmax over each row and P_col over each column,
    dL/dS = alpha_j P_row + beta_j P_col - (alpha_j + beta_j) at positive pairs, where
    (alpha, beta) are per-column float32 vectors. `weights_image` gives the weights whose
    gradient flows into the image features, `weights_text` those for the text features (None:
    the same). Returns (d_image, d_text) in float32 (None where not needed).
    """

    def tile_grads(rows, cols, rs, cs):
        s = (rows @ cols.T).mul_(scale)
        args = (s, row_lse[rs], col_lse[cs])
        a_i, b_i = weights_image
        g_i = _clip_tile_grad(*args, a_i[cs], b_i[cs], rs.start, cs.start, diag)
        if not need_text or weights_text is None:
            return g_i, g_i  # the texts' G is the images' G, or not wanted
        a_t, b_t = weights_text
        return g_i, _clip_tile_grad(*args, a_t[cs], b_t[cs], rs.start, cs.start, diag)

    return _feature_grads(image, text, scale, need_image, need_text, tile, tile_grads)


def _siglip_tile_logits(rows, cols, scale, bias):
    x = rows @ cols.T
    z = x * scale
    if bias is not None:
        z.add_(bias)
    return x, z


def _siglip_tile(x, z, rs: slice, cs: slice, diag):
    """([sum of -log sigmoid(y z), sum of dz * x, sum of dz] in float64, dz) for one tile; dz in z's storage."""
    # -log sigmoid(-z) = softplus(z) for negatives, softplus(-z) = softplus(z) - z for positives
    loss = F.softplus(z).sum()
    positives, _ = _diagonal(z, rs.start, cs.start, diag)
    if positives is not None:
        loss = loss - positives.sum()
    dz = _siglip_dz(z, rs, cs, diag)
    return torch.stack([loss, torch.linalg.vecdot(dz.flatten(), x.flatten()), dz.sum()]).double(), dz


def _siglip_dz(z, rs: slice, cs: slice, diag):
    """dz = d(-log sigmoid(y z))/dz = sigmoid(z) - [positive], in z's storage."""
    dz = torch.sigmoid_(z)
    pos, _ = _diagonal(dz, rs.start, cs.start, diag)
    if pos is not None:
        pos.sub_(1.0)
    return dz


@full_precision
def siglip_block_sums(
    image: torch.Tensor,
    text: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    diag: int | None,
    tile: int | None = None,
) -> torch.Tensor:
    """[sum of -log sigmoid(y z), sum of dz * x, sum of dz] over a block, float64.

    z = scale * x + bias with x = image @ text.T, y = +1 at positive pairs and -1 elsewhere,
    dz = d(-log sigmoid(y z))/dz = sigmoid(z) - [positive].
    """
    sums = torch.zeros(3, dtype=torch.float64, device=image.device)
    for rs, cs, rows, cols in _tiles(image, text, tile):
        sums += _siglip_tile(*_siglip_tile_logits(rows, cols, scale, bias), rs, cs, diag)[0]
    return sums


@full_precision
def siglip_block_sums_and_grads(
    image: torch.Tensor,
    text: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    diag: int | None,
    coef: torch.Tensor,
    need_image: bool = True,
    need_text: bool = True,
    tile: int | None = None,
):
    """`siglip_block_sums` and `siglip_block_grads` from one pass over the tiles: (sums, d_image, d_text).

    A training step's forward pass computes the gradients at once, one tile matmul fewer than recomputing
    the tiles in backward.
    """
    sums = torch.zeros(3, dtype=torch.float64, device=image.device)

    def tile_grads(rows, cols, rs, cs):
        tile_sums, dz = _siglip_tile(*_siglip_tile_logits(rows, cols, scale, bias), rs, cs, diag)
        sums.add_(tile_sums)
        dz.mul_(coef)
        return dz, dz

    d_image, d_text = _feature_grads(image, text, scale, need_image, need_text, tile, tile_grads)
    return sums, d_image, d_text


@full_precision
def siglip_block_grads(
    image: torch.Tensor,
    text: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    diag: int | None,
    coef: torch.Tensor,
    need_image: bool = True,
    need_text: bool = True,
    tile: int | None = None,
):
    """Gradients of coef * sum(-log sigmoid(y z)) w.r.t. a block's image and text features (float32)."""

    def tile_grads(rows, cols, rs, cs):
        _, z = _siglip_tile_logits(rows, cols, scale, bias)
        dz = _siglip_dz(z, rs, cs, diag).mul_(coef)
        return dz, dz

    return _feature_grads(image, text, scale, need_image, need_text, tile, tile_grads)
