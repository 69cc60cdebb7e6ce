"""Moving features between ranks for the contrastive losses, with correct autograd.

Three groups live here:

1. OpenCLIP's exchanges, used by the naive reference and by the SigLIP loss: all-gather
   (with or without gradient), all-reduce with gradient, neighbour exchanges (one way and both
   ways). The gradient a rank receives through a gathered tensor is the sum over ranks.

2. The fused distributed CLIP loss, which never holds a logit matrix larger than a tile:
   - `gather`: all-gather the text features; this rank's images against all texts yields the
     row statistics of its images and partial column statistics of every text; the column
     log-sum-exps are combined across ranks (all-reduce of max, then of the rescaled sums, O(N)
     numbers). Backward recomputes the same strip and sends text gradients home with a
     reduce-scatter. Extra memory O(B_global x D).
   - `ring`: text features travel rank to rank (isend/irecv posted before each block's compute,
     so the transfer overlaps it); each text block's column statistics travel behind it and
     arrive home complete after a full turn. Backward repeats the turn with the text
     gradients riding along. Extra memory O(B_local x D + world_size).
   Each global logit block is computed once, on the rank that owns its images: the global
   flops equal those of one process on the whole batch.

3. `mean_grad_across_ranks`: identity forward; backward replaces each rank's gradient by the
   mean over ranks, used on logit_scale and logit_bias by the fused paths.

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

(Longer than most modules: each exchange's forward and backward are one autograd Function whose two halves
must mirror each other's communication exactly; they are kept side by side on purpose.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bigclip.loss.chunked import merge_lse, positive_logits

# ---------------------------------------------------------------------------- collectives

# torch 2.14 renamed the tensor collectives (the old names warn); older torch has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenation over ranks along dim 0, no autograd."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(),) + tuple(x.shape[1:]))
    _all_gather_single(out, x)
    return out


def reduce_scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, each rank keeping its own slice of dim 0, no autograd."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(),) + tuple(x.shape[1:]))
    _reduce_scatter_single(out, x)
    return out


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return all_gather_rows(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad)


class _AllReduceWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _MeanGradAcrossRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


def mean_grad_across_ranks(x: torch.Tensor) -> torch.Tensor:
    return _MeanGradAcrossRanks.apply(x)


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class _NeighbourExchange(torch.autograd.Function):
    """Send to `to_rank`, receive from `from_rank`; gradients travel back the other way."""

    @staticmethod
    def forward(ctx, from_rank, to_rank, x):
        ctx.peers = (from_rank, to_rank)
        x = x.contiguous()
        received = torch.empty_like(x)
        _exchange([(x, to_rank)], [(received, from_rank)])
        return received

    @staticmethod
    def backward(ctx, grad):
        from_rank, to_rank = ctx.peers
        return None, None, _NeighbourExchange.apply(to_rank, from_rank, grad)


class _NeighbourExchangeBidir(torch.autograd.Function):
    """Send one tensor left and one right; returns (from_right, from_left)."""

    @staticmethod
    def forward(ctx, left_rank, right_rank, to_left, to_right):
        ctx.peers = (left_rank, right_rank)
        to_left, to_right = to_left.contiguous(), to_right.contiguous()
        from_right, from_left = torch.empty_like(to_left), torch.empty_like(to_right)
        _exchange([(to_right, right_rank), (to_left, left_rank)], [(from_right, right_rank), (from_left, left_rank)])
        return from_right, from_left

    @staticmethod
    def backward(ctx, grad_from_right, grad_from_left):
        left_rank, right_rank = ctx.peers
        grads = _NeighbourExchangeBidir.apply(right_rank, left_rank, grad_from_right, grad_from_left)
        return (None, None) + grads


def gather_features(image, text, local_loss: bool, gather_with_grad: bool, rank: int, world_size: int):
    """OpenCLIP's gather_features: (all images, all texts) in rank order."""
    if gather_with_grad:
        return _AllGatherWithGrad.apply(image), _AllGatherWithGrad.apply(text)
    with torch.no_grad():
        all_image, all_text = all_gather_rows(image), all_gather_rows(text)
    if not local_loss:
        # Only this rank's own slice carries gradient, as in OpenCLIP.
        images, texts = list(all_image.chunk(world_size)), list(all_text.chunk(world_size))
        images[rank], texts[rank] = image, text
        all_image, all_text = torch.cat(images), torch.cat(texts)
    return all_image, all_text


# ---------------------------------------------------------------------------- SigLIP exchanges


def siglip_exchange(block, image, text, logit_scale, logit_bias, rank: int, world_size: int, dist_impl: str):
    """Sum of the negative-only blocks of this rank's images against every other rank's texts.

    `block(image, text, scale, bias, negative_only)` computes one block's loss; the exchanges
    carry gradients back to the text features' owners (OpenCLIP's meanings of dist_impl).
    """
    right, left = (rank + 1) % world_size, (rank - 1 + world_size) % world_size
    total = 0.0

    def add(other_text):
        nonlocal total
        total = total + block(image, other_text, logit_scale, logit_bias, True)

    if dist_impl == "bidir":
        to_left = to_right = text
        pairs, odd = divmod(world_size - 1, 2)
        for _ in range(pairs):
            from_right, from_left = _NeighbourExchangeBidir.apply(left, right, to_left, to_right)
            add(from_right)
            add(from_left)
            to_left, to_right = from_right, from_left
        if odd:
            add(_NeighbourExchange.apply(left, right, to_right))
    elif dist_impl == "shift":
        to_right = text
        for _ in range(world_size - 1):
            to_right = _NeighbourExchange.apply(left, right, to_right)
            add(to_right)
    elif dist_impl == "reduce":
        for source in range(world_size):
            received = _AllReduceWithGrad.apply(text * float(source == rank))
            if source != rank:
                add(received)
            else:
                # Own block already counted; keep the all-reduce in the graph anyway, since its
                # backward is a collective every rank must join.
                total = total + 0.0 * received.sum()
    elif dist_impl == "gather":
        for source, other in enumerate(_AllGatherWithGrad.apply(text).chunk(world_size)):
            if source != rank:
                add(other)
    else:
        raise ValueError(f"unknown SigLIP dist_impl {dist_impl!r}")
    return total


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


def _grad_outputs(grad: torch.Tensor) -> torch.Tensor:
    return all_gather_rows(grad.detach().float().reshape(1))


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


class _Transfer:
    """One batch of point-to-point ops; `wait` gives the received tensors and waits at most once
    (on gloo a second wait on a finished send or receive blocks forever)."""

    def __init__(self, works, sent: tuple, received: tuple):
        self.works, self.sent, self.received = works, sent, received  # the sent tensors must live until sent

    def wait(self) -> tuple:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], ()
        return self.received


class _Ring:
    """Shifts tensors one rank to the right (receiving the same shapes from the left).

    Each shift posts its sends and receives as one batch_isend_irecv group, so two ranks that
    are each other's left and right neighbour (world size 2) cannot block each other on NCCL, and
    every rank posts the same sequence of groups. A transfer is waited for only when its data is
    needed, so it runs while the caller computes.
    """

    def __init__(self, rank: int, world: int):
        self.right, self.left = (rank + 1) % world, (rank - 1 + world) % world
        self.transfers: list[_Transfer] = []

    def shift(self, *tensors: torch.Tensor) -> _Transfer:
        tensors = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.right) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.left) for t in received]
        transfer = _Transfer(dist.batch_isend_irecv(ops), tensors, received)
        self.transfers.append(transfer)
        return transfer

    def finish(self) -> None:
        for transfer in self.transfers:
            transfer.wait()
        self.transfers.clear()


class _RingPath(_Path):
    """`ring`: step k computes this rank's images against the texts of rank - k. The texts move on
    before the block is computed; what belongs to a text block (its column statistics forward,
    its gradient backward) follows one step behind and arrives home complete after a full turn."""

    def statistics(self, image, text, scale):
        batch, world = image.shape[0], self.world
        ring = _Ring(self.rank, world)
        row_lse = torch.full((batch,), float("-inf"), device=image.device)
        row_mean = torch.zeros(batch, device=image.device)
        current = text.contiguous()
        columns = None  # brings [lse; mean] of `current`'s columns from the ranks it visited before
        for step in range(world):
            upcoming = ring.shift(current) if step < world - 1 else None
            r_lse, r_mean, c_lse, c_mean = self.backend.clip_block_stats(image, current, scale)
            row_lse, row_mean = merge_lse(row_lse, row_mean, r_lse, r_mean)
            if columns is not None:
                (before,) = columns.wait()
                c_lse, c_mean = merge_lse(before[0], before[1], c_lse, c_mean)
            columns = ring.shift(torch.stack([c_lse, c_mean]))
            if upcoming is not None:
                (current,) = upcoming.wait()
        (own,) = columns.wait()  # after a full turn: this rank's own texts, complete
        ring.finish()
        return (row_lse, row_mean, own[0], own[1]), (text, own[0])

    def feature_grads(self, image, text, scale, row_lse, col_lse, weights, need_image, need_text):
        batch, rank, world = image.shape[0], self.rank, self.world
        ring = _Ring(rank, world)
        d_image = torch.zeros(image.shape, device=image.device) if need_image else None
        current, current_lse = text.contiguous(), col_lse.contiguous()
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
                *_column_weights(weights, torch.full((batch,), owner, device=image.device)),
                diag=0 if owner == rank else None,
                need_image=need_image,
                need_text=need_text,
            )
            if need_image:
                d_image += d_img_part
            if need_text:
                if text_grads is not None:
                    (before,) = text_grads.wait()
                    d_txt_part = d_txt_part + before
                text_grads = ring.shift(d_txt_part)
            if upcoming is not None:
                current, current_lse = upcoming.wait()
        d_text = None
        if need_text:
            (d_text,) = text_grads.wait()  # after a full turn: this rank's own texts, complete
        ring.finish()
        return d_image, d_text


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
        weights = _owner_weights(_grad_outputs(grad), path.rank, image.shape[0], *ctx.flags)
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
