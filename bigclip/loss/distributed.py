"""The fused distributed CLIP loss, which never holds a logit matrix larger than a tile (the exchanges it uses
are in collectives.py, the SigLIP ones in siglip_exchange.py).

   - `gather`: all-gather the text features; this rank's images against all texts yields the
     row statistics of its images and partial column statistics of every text; the column
     log-sum-exps are combined across ranks (all-reduce of max, then of the rescaled sums, O(N)
     numbers). Backward recomputes the same strip and sends text gradients home with a
     reduce-scatter. Extra memory O(B_global x D).
   - `ring`: text features travel rank to rank (isend/irecv posted before each block's compute,
     so the transfer overlaps it), in up to four row pieces, one turn each; each piece's column
     statistics travel behind it and arrive home complete after a full turn. Backward repeats
     the turns with the text gradients riding along. Extra memory O(B_local x D) (a few pieces
     in flight) whatever the world size.
   Each global logit block is computed once, on the rank that owns its images: the global
   flops equal those of one process on the whole batch.

Gradient convention (fused paths; the naive path is OpenCLIP's code and gives the same result
after DDP's averaging):
- Each rank returns OpenCLIP's loss value: with local_loss its own rows (L_r), without it the
  loss of the whole global batch (L_global = mean_r L_r).
- With gather_with_grad the feature gradients on rank r are those of sum over ranks of every
  rank's returned loss (times its grad_output), exactly what OpenCLIP's autograd all-gather
  delivers: W x dL_global/d(features of r) for both local_loss settings. Without
  gather_with_grad they are OpenCLIP's partial gradients (only this rank's own copy of its
  features carries gradient).
- logit_scale / logit_bias gradients are the mean over ranks of the per-rank gradients:
  dL_global/dscale, identical on every rank.
- Hence after DDP averages parameter gradients over ranks, every parameter holds exactly the
  gradient of L_global (gather_with_grad=True), which is what one process computing the loss on
  the concatenated global batch would give.

The grad_outputs of all ranks are all-gathered in backward (W numbers) so the result stays exact
even if ranks scale their losses differently. Batch sizes must be equal on every rank.

(Longer than most modules: each path's forward and backward mirror each other's communication exactly;
they are kept side by side on purpose.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bigclip.loss.chunked import merge_lse, positive_logits
from bigclip.loss.collectives import (
    Transfer,
    add_received,
    all_gather_rows,
    gather_grad_outputs,
    mean_grad_across_ranks,
    reduce_scatter_rows,
    row_spans,
    text_pieces,
)

# ---------------------------------------------------------------------------- fused CLIP


def _owner_weights(grads: torch.Tensor, rank: int, batch: int, local_loss: bool, gather_with_grad: bool):
    """Per-owner weights ((alpha_img, beta_img), (alpha_txt, beta_txt) or None: the same), each (W,),
    indexed by the rank that owns a column; see `chunked.clip_block_grads` for what they multiply.

    grads: every rank's grad_output. The objective is sum_r grads[r] * loss_r.
    """
    world = grads.numel()
    if gather_with_grad:
        # local: row terms of rank r belong to L_r, column terms of a text to its owner's loss.
        # global: every rank returns L_global = (1 / 2B_global) sum of all terms.
        owner = grads if local_loss else grads.mean().expand(world)
        alpha = (owner[rank] / (2 * batch)).expand(world)
        beta = owner / (2 * batch)
        return (alpha, beta), None
    zero = torch.zeros_like(grads)
    if local_loss:
        # OpenCLIP: images get gradient only from their rows, texts only from their columns.
        return ((grads[rank] / (2 * batch)).expand(world), zero), (zero, grads / (2 * batch))
    # OpenCLIP: rank r differentiates L_global w.r.t. its own images and its own texts only.
    mine = (grads[rank] / (2 * batch * world)).expand(world)
    theirs = grads / (2 * batch * world)
    return (mine, mine), (theirs, theirs)


def _column_weights(weights, owners: torch.Tensor):
    """Per-owner weights spread over a block's columns, column j belonging to rank owners[j].

    The weights depend only on which rank owns a text, so they are computed per rank (W numbers)
    and spread here into the per-column vectors that `clip_block_grads` takes.
    """
    image_weights, text_weights = weights
    per_column = tuple(w[owners] for w in image_weights)
    return per_column, None if text_weights is None else tuple(w[owners] for w in text_weights)


def _combine_column_stats(lse: torch.Tensor, mean: torch.Tensor):
    """Log-sum-exp (and softmax-weighted mean) over ranks of per-rank partials, O(N) traffic."""
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    w = torch.exp(lse - peak)
    sums = torch.stack([w, w * mean])
    dist.all_reduce(sums)
    return peak + torch.log(sums[0]), sums[1] / sums[0]


def _loss_and_dscale(row_lse, row_mean, col_lse_own, col_mean_own, pos, scale, batch, world, local_loss):
    """This rank's loss value and its derivative w.r.t. the scale, from O(B) statistics."""
    terms = torch.stack(
        [
            row_lse.sum() + col_lse_own.sum() - 2 * scale * pos.sum(),
            row_mean.sum() + col_mean_own.sum() - 2 * pos.sum(),
        ]
    )
    norm = 2 * batch
    if not local_loss:
        dist.all_reduce(terms)
        norm *= world
    return terms[0] / norm, terms[1] / norm


class _Path:
    """How texts travel between ranks for the fused CLIP loss (`dist_impl`), on one backend.

    statistics(image, text, scale) -> ((row_lse, row_mean, col_lse, col_mean of this rank's
    texts), (texts, their column lse)): what the loss needs, then what backward recomputes from.
    feature_grads(image, texts, scale, row_lse, texts_lse, weights, need_image, need_text) ->
    (d_image, d_text) in float32, from per-owner weights (`_owner_weights`).
    """

    def __init__(self, backend, rank: int, world: int):
        self.backend, self.rank, self.world = backend, rank, world


class _GatherPath(_Path):
    """`gather`: all texts on every rank at once; column statistics are combined by all-reduce and
    text gradients go home by reduce-scatter."""

    def statistics(self, image, text, scale):
        batch = image.shape[0]
        all_text = all_gather_rows(text)
        row_lse, row_mean, col_lse, col_mean = self.backend.clip_block_stats(image, all_text, scale)
        col_lse, col_mean = _combine_column_stats(col_lse, col_mean)
        own = slice(self.rank * batch, (self.rank + 1) * batch)
        return (row_lse, row_mean, col_lse[own], col_mean[own]), (all_text, col_lse)

    def feature_grads(self, image, all_text, scale, row_lse, col_lse, weights, need_image, need_text):
        batch = image.shape[0]
        owners = torch.arange(self.world, device=image.device).repeat_interleave(batch)
        d_image, d_all_text = self.backend.clip_block_grads(
            image,
            all_text,
            scale,
            row_lse,
            col_lse,
            *_column_weights(weights, owners),
            diag=self.rank * batch,
            need_image=need_image,
            need_text=need_text,
        )
        return d_image, None if d_all_text is None else reduce_scatter_rows(d_all_text)


class _Ring:
    """Shifts tensors one rank to the right (receiving the same shapes from the left).

    Each shift posts its sends and receives as one batch_isend_irecv group, so two ranks that
    are each other's left and right neighbour (world size 2) cannot block each other on NCCL, and
    every rank posts the same sequence of groups. A transfer is waited for only when its data is
    needed, so it runs while the caller computes.
    """

    def __init__(self, rank: int, world: int):
        self.right, self.left = (rank + 1) % world, (rank - 1 + world) % world
        self.transfers: list[Transfer] = []

    def shift(self, *tensors: torch.Tensor) -> Transfer:
        tensors = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.right) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.left) for t in received]
        transfer = Transfer(dist.batch_isend_irecv(ops), tensors, received)
        self.transfers.append(transfer)
        return transfer

    def finish(self) -> None:
        for transfer in self.transfers:
            transfer.wait()
        self.transfers.clear()


class _RingPath(_Path):
    """`ring`: this rank's texts go round in pieces (collectives.text_pieces), one turn per piece, the turns back to
    back; step k of a turn computes this rank's images against the piece of rank - k. The piece moves on before its
    block is computed; what belongs to it (its column statistics forward, its gradient backward) follows one step
    behind and arrives home complete after a full turn, where it is collected once the next piece's first block has
    been computed (so that last leg, too, overlaps a block)."""

    def statistics(self, image, text, scale):
        batch, world = image.shape[0], self.world
        ring = _Ring(self.rank, world)
        dev = image.device
        row_lse = torch.full((batch,), float("-inf"), device=dev)
        row_mean = torch.zeros(batch, device=dev)
        columns_home = torch.empty(batch, 2, device=dev)  # [lse, mean] of this rank's own columns, row by row
        text = text.contiguous()
        home = None  # (own rows, the transfer bringing their complete column statistics)
        for span in row_spans(batch, text_pieces(batch)):
            current = text[span]
            columns = None  # brings [lse, mean] of `current`'s columns from the ranks it visited before
            for step in range(world):
                upcoming = ring.shift(current) if step < world - 1 else None
                r_lse, r_mean, c_lse, c_mean = self.backend.clip_block_stats(image, current, scale)
                row_lse, row_mean = merge_lse(row_lse, row_mean, r_lse, r_mean)
                home = _collect(home, columns_home)
                if columns is not None:
                    (before,) = columns.wait()
                    c_lse, c_mean = merge_lse(before[:, 0], before[:, 1], c_lse, c_mean)
                columns = ring.shift(torch.stack([c_lse, c_mean], dim=1))
                if upcoming is not None:
                    (current,) = upcoming.wait()
            home = (span, columns)  # after a full turn: this rank's own piece, complete
        _collect(home, columns_home)
        ring.finish()
        col_lse, col_mean = columns_home.T.contiguous()
        return (row_lse, row_mean, col_lse, col_mean), (text, col_lse)

    def feature_grads(self, image, text, scale, row_lse, col_lse, weights, need_image, need_text):
        batch, rank, world = image.shape[0], self.rank, self.world
        ring = _Ring(rank, world)
        d_image = torch.zeros(image.shape, device=image.device) if need_image else None
        d_text = torch.empty(text.shape, device=image.device) if need_text else None
        text, col_lse = text.contiguous(), col_lse.contiguous()
        home = None  # (own rows, the transfer bringing their complete gradient)
        for span in row_spans(batch, text_pieces(batch)):
            current, current_lse = text[span], col_lse[span]
            text_grads = None  # brings the gradient of `current` from the ranks it visited before
            for step in range(world):
                owner = (rank - step) % world
                upcoming = ring.shift(current, current_lse) if step < world - 1 else None
                d_img_part, d_txt_part = self.backend.clip_block_grads(
                    image,
                    current,
                    scale,
                    row_lse,
                    current_lse,
                    *_column_weights(weights, torch.full((current.shape[0],), owner, device=image.device)),
                    diag=-span.start if owner == rank else None,  # image row i's positive: the piece's i - start
                    need_image=need_image,
                    need_text=need_text,
                )
                if need_image:
                    d_image += d_img_part
                del d_img_part
                home = _collect(home, d_text)
                if need_text:
                    if text_grads is not None:
                        add_received(d_txt_part, text_grads)
                    text_grads = ring.shift(d_txt_part)
                del d_txt_part  # the shift holds it until sent; nothing else of this block outlives it
                if upcoming is not None:
                    current, current_lse = upcoming.wait()
            if need_text:
                home = (span, text_grads)  # after a full turn: this rank's own piece, complete
        _collect(home, d_text)
        ring.finish()
        return d_image, d_text


def _collect(home, into: torch.Tensor) -> None:
    """Waits for what `home` = (own rows, transfer) brings, a piece's complete column statistics or gradient after
    its turn, and writes it into those rows of `into`; nothing when `home` is None. Returns None: the caller's
    `home` is spent."""
    if home is not None:
        span, transfer = home
        (into[span],) = transfer.wait()


class _FusedClipDistributed(torch.autograd.Function):
    """The fused CLIP loss on several ranks. The path moves the texts and computes the blocks; the
    loss, the scale derivative and the backward weights are the same for every path, from O(B)
    statistics."""

    @staticmethod
    def forward(ctx, image, text, logit_scale, path, local_loss, gather_with_grad):
        scale = logit_scale.detach().reshape(()).float()
        (row_lse, row_mean, col_lse, col_mean), (texts, texts_lse) = path.statistics(image, text, scale)
        pos = positive_logits(image, text)
        loss, d_scale = _loss_and_dscale(
            row_lse, row_mean, col_lse, col_mean, pos, scale, image.shape[0], path.world, local_loss
        )
        ctx.save_for_backward(image, texts, scale, row_lse, texts_lse, d_scale)
        ctx.path, ctx.flags = path, (local_loss, gather_with_grad)
        ctx.scale_meta = (logit_scale.shape, logit_scale.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        image, texts, scale, row_lse, texts_lse, d_scale = ctx.saved_tensors
        path = ctx.path
        weights = _owner_weights(gather_grad_outputs(grad), path.rank, image.shape[0], *ctx.flags)
        d_image, d_text = path.feature_grads(
            image, texts, scale, row_lse, texts_lse, weights, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        shape, dtype = ctx.scale_meta
        return (
            None if d_image is None else d_image.to(image.dtype),
            None if d_text is None else d_text.to(texts.dtype),
            (grad * d_scale).reshape(shape).to(dtype),
            None,
            None,
            None,
        )


def clip_loss_distributed(
    image,
    text,
    logit_scale,
    *,
    local_loss: bool,
    gather_with_grad: bool,
    rank: int,
    world_size: int,
    dist_impl: str,
    backend,
) -> torch.Tensor:
    """The fused CLIP loss on `world_size` ranks (see the module docstring for the conventions)."""
    path = {"gather": _GatherPath, "ring": _RingPath}[dist_impl](backend, rank, world_size)
    logit_scale = mean_grad_across_ranks(logit_scale)
    return _FusedClipDistributed.apply(image, text, logit_scale, path, local_loss, gather_with_grad)
