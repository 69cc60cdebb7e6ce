"""Moving features between ranks for the contrastive losses, with correct autograd.

Three groups live here:

1. OpenCLIP's exchanges, used by the naive reference and by the SigLIP loss (`siglip_blocks`):
   all-gather (with or without gradient), all-reduce with gradient, neighbour exchanges (one way
   and both ways). The neighbour exchanges are posted before the block that precedes their use
   (`_PostExchange`), so the texts travel while a block is computed. The gradient a rank receives
   through a gathered tensor is the sum over ranks.

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


class _Transfer:
    """One batch of point-to-point ops; `wait` gives the received tensors and waits at most once
    (on gloo a second wait on a finished send or receive blocks forever)."""

    in_flight = 0  # posted and not yet waited for, in this process: what overlaps the compute now

    def __init__(self, works, sent: tuple, received: tuple):
        self.works, self.sent, self.received = works, sent, received  # the sent tensors must live until sent
        _Transfer.in_flight += 1

    def wait(self) -> tuple:
        """The received tensors, once; the transfer lets go of them (and of the sent ones), so a ring that keeps
        its transfers until `finish` holds no features of ranks it has passed."""
        if self.works:
            _Transfer.in_flight -= 1
        for work in self.works:
            work.wait()
        received = self.received
        self.works, self.sent, self.received = [], (), ()
        return received


def transfers_in_flight() -> int:
    """Feature transfers posted and not yet waited for (tests check that the compute overlaps them)."""
    return _Transfer.in_flight


class _PostExchange(torch.autograd.Function):
    """Posts the sends of `tensors` (tensors[k] to to_peers[k]) and the receives of tensors like them (k-th from
    from_peers[k]) and returns the receive buffers at once: they hold their data once `transfer.wait()` has
    returned, so whatever runs in between overlaps the transfer. Backward sends each received tensor's gradient
    back to where it came from and receives the gradients of the sent ones."""

    @staticmethod
    def forward(ctx, posted: list, to_peers: tuple, from_peers: tuple, *tensors):
        ctx.peers = (to_peers, from_peers)
        sent = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in zip(sent, to_peers)]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in zip(received, from_peers)]
        posted.append(_Transfer(dist.batch_isend_irecv(ops), sent, received))
        return received

    @staticmethod
    def backward(ctx, *grads):
        to_peers, from_peers = ctx.peers
        grads = tuple(g.contiguous() for g in grads)
        back = tuple(torch.empty_like(g) for g in grads)
        _exchange(list(zip(grads, from_peers)), list(zip(back, to_peers)))
        return (None, None, None, *back)


def _post(to_peers: tuple, from_peers: tuple, *tensors) -> tuple[_Transfer, tuple]:
    """(the transfer, its receive buffers): read the buffers only after the transfer's wait()."""
    posted: list[_Transfer] = []
    received = _PostExchange.apply(posted, to_peers, from_peers, *tensors)
    return posted[0], received


# ---------------------------------------------------------------------------- SigLIP exchanges


def siglip_blocks(block, image, text, logit_scale, logit_bias, rank: int, world_size: int, dist_impl: str):
    """This rank's SigLIP loss: its images against its own texts (the positives) plus the negative-only blocks
    against every other rank's texts, moved by OpenCLIP's exchange `dist_impl`.

    `block(image, text, scale, bias, negative_only)` computes one block's loss; the exchanges carry gradients
    back to the text features' owners. bidir and shift post each exchange before the block that precedes its
    use, so the texts travel while a block is computed (the own block hides the first exchange).
    """
    right, left = (rank + 1) % world_size, (rank - 1 + world_size) % world_size
    own = lambda: block(image, text, logit_scale, logit_bias, False)  # noqa: E731
    others = lambda t: block(image, t, logit_scale, logit_bias, True)  # noqa: E731
    if world_size == 1:
        return own()
    if dist_impl == "bidir":
        pairs, odd = divmod(world_size - 1, 2)
        # to_left goes left, to_right goes right; what arrives is (from_right, from_left)
        post_pair = lambda to_left, to_right: _post((left, right), (right, left), to_left, to_right)  # noqa: E731
        post_right = lambda to_right: _post((right,), (left,), to_right)  # noqa: E731
        upcoming = post_pair(text, text) if pairs else post_right(text)
        total = own()
        for i in range(pairs):
            transfer, (from_right, from_left) = upcoming
            transfer.wait()
            if i + 1 < pairs:
                upcoming = post_pair(from_right, from_left)
            elif odd:
                upcoming = post_right(from_left)
            total = total + others(from_right) + others(from_left)
        if odd:
            transfer, (last,) = upcoming
            transfer.wait()
            total = total + others(last)
        return total
    if dist_impl == "shift":
        upcoming = _post((right,), (left,), text)
        total = own()
        for step in range(world_size - 1):
            transfer, (current,) = upcoming
            transfer.wait()
            if step + 1 < world_size - 1:
                upcoming = _post((right,), (left,), current)
            total = total + others(current)
        return total
    total = own()
    if dist_impl == "reduce":
        for source in range(world_size):
            received = _AllReduceWithGrad.apply(text * float(source == rank))
            if source != rank:
                total = total + others(received)
            else:
                # Own block already counted; keep the all-reduce in the graph anyway, since its
                # backward is a collective every rank must join.
                total = total + 0.0 * received.sum()
    elif dist_impl == "gather":
        for source, other in enumerate(_AllGatherWithGrad.apply(text).chunk(world_size)):
            if source != rank:
                total = total + others(other)
    else:
        raise ValueError(f"unknown SigLIP dist_impl {dist_impl!r}")
    return total


class _Visits:
    """The fused SigLIP loss's walk over every rank's texts (bidir or shift) for one rank's images: each text
    exchange is posted before the block that precedes its use, and the gradient of each visiting text block is
    sent straight to its owner while the next block is computed. Holds O(B d): the own texts' gradient, the
    images' gradient, the texts at hand and in flight."""

    def __init__(self, backend, rank: int, world: int, dist_impl: str):
        self.backend, self.rank, self.world, self.dist_impl = backend, rank, world, dist_impl

    def schedule(self) -> list[tuple[int, ...]]:
        """Per exchange, the offsets o of the owners (rank + o) whose texts it brings (OpenCLIP's order)."""
        if self.dist_impl == "shift":
            return [(-k,) for k in range(1, self.world)]
        pairs, odd = divmod(self.world - 1, 2)
        return [(k, -k) for k in range(1, pairs + 1)] + ([(-(pairs + 1),)] if odd else [])

    def _post_texts(self, offsets: tuple[int, ...], previous: tuple[torch.Tensor, ...], text) -> _Transfer:
        """Texts of owners rank + o: each arrives from the neighbour on o's side, which passes on what it holds
        from one step closer to the owner (its own texts at the first step)."""
        world, rank = self.world, self.rank
        sends, recvs = [], []
        for o, held in zip(offsets, previous):
            toward = 1 if o < 0 else -1  # texts of owners to the left travel right, and the other way
            sends.append((held, (rank + toward) % world))
            recvs.append((torch.empty_like(text), (rank - toward) % world))
        return _post_p2p(sends, recvs)

    def _post_grads(self, offsets: tuple[int, ...], grads: list[torch.Tensor]) -> _Transfer:
        """Each visiting block's text gradient to its owner; ours from the ranks holding our texts now."""
        world, rank = self.world, self.rank
        sends = [(g, (rank + o) % world) for o, g in zip(offsets, grads)]
        recvs = [(torch.empty_like(g), (rank - o) % world) for o, g in zip(offsets, grads)]
        return _post_p2p(sends, recvs)

    def run(self, image, text, scale, bias, coef, with_sums: bool, need_image: bool, need_text: bool):
        """(sums [loss, dz x, dz] over every block, float64; d_image; d_text of this rank's texts), float32."""
        dev = image.device
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        d_image = torch.zeros(image.shape, device=dev) if need_image else None
        d_text = torch.zeros(text.shape, device=dev) if need_text else None

        def block(texts, diag):
            nonlocal sums
            if with_sums:
                s, di, dt = self.backend.siglip_block_sums_and_grads(
                    image, texts, scale, bias, diag, coef, need_image, need_text
                )
                sums = sums + s
            else:
                di, dt = self.backend.siglip_block_grads(image, texts, scale, bias, diag, coef, need_image, need_text)
            if need_image:
                d_image.add_(di)
            return dt

        steps = self.schedule()
        text = text.contiguous()
        texts_in_flight = self._post_texts(steps[0], (text,) * len(steps[0]), text)
        own = block(text, 0)  # while the first texts travel
        if need_text:
            d_text.add_(own)
        del own  # every name below is dropped once used: what is alive during a block is what the walk needs
        grads_in_flight = None
        for k, offsets in enumerate(steps):
            arrived = texts_in_flight.wait()
            if k + 1 < len(steps):
                nxt = steps[k + 1]
                passed_on = arrived if len(nxt) == len(arrived) else arrived[-1:]  # bidir's odd step passes one on
                texts_in_flight = self._post_texts(nxt, passed_on, text)
                del passed_on
            grads = [block(texts, None) for texts in arrived]
            del arrived
            if grads_in_flight is not None:
                _add_received(d_text, grads_in_flight)
            grads_in_flight = self._post_grads(offsets, grads) if need_text else None
            del grads
        if grads_in_flight is not None:
            _add_received(d_text, grads_in_flight)
        return sums, d_image, d_text


def _add_received(total: torch.Tensor, transfer: _Transfer) -> None:
    """Waits for `transfer` and adds what it received into `total`, keeping no reference to it."""
    for received in transfer.wait():
        total.add_(received)


def _post_p2p(sends: list, recvs: list) -> _Transfer:
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    return _Transfer(dist.batch_isend_irecv(ops), tuple(t for t, _ in sends), tuple(t for t, _ in recvs))


class _FusedSigLipExchange(torch.autograd.Function):
    """The fused SigLIP loss of one rank under bidir or shift (`_Visits`), gradients computed beside the loss.

    Backward scales them by the incoming gradient when every rank's is the same (one all-gather of W numbers);
    when ranks weigh their losses differently the texts' gradients mix those weights, so they are recomputed in
    a second walk with this rank's own weight (exact either way)."""

    @staticmethod
    def forward(ctx, image, text, logit_scale, logit_bias, visits: _Visits):
        n = image.shape[0]
        scale = logit_scale.detach().reshape(()).float()
        bias = None if logit_bias is None else logit_bias.detach().reshape(()).float()
        need = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        coef = torch.tensor(1.0 / n, device=image.device)
        if need[0] or need[1]:
            sums, d_image, d_text = visits.run(image, text, scale, bias, coef, True, *need)
        else:  # no feature gradients wanted: the sums alone, from the same walk without its gradient sends
            sums, d_image, d_text = visits.run(image, text, scale, bias, coef, True, False, False)
        ctx.save_for_backward(image, text, scale, bias, d_image, d_text, (sums[1:] / n).float())
        ctx.visits = visits
        ctx.metas = (
            (logit_scale.shape, logit_scale.dtype),
            (None if logit_bias is None else (logit_bias.shape, logit_bias.dtype)),
        )
        return (sums[0] / n).float()

    @staticmethod
    def backward(ctx, grad):
        image, text, scale, bias, d_image, d_text, d_scale_bias = ctx.saved_tensors
        need = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = _grad_outputs(grad)
        g = grad.float()
        if need[0] or need[1]:
            if bool((grads == grads[0]).all()):
                d_image = None if d_image is None else d_image * g
                d_text = None if d_text is None else d_text * g
            else:
                coef = g / image.shape[0]
                _, d_image, d_text = ctx.visits.run(image, text, scale, bias, coef, False, *need)
        (scale_shape, scale_dtype), bias_meta = ctx.metas
        d_scale = (grad * d_scale_bias[0]).reshape(scale_shape).to(scale_dtype)
        d_bias = None if bias_meta is None else (grad * d_scale_bias[1]).reshape(bias_meta[0]).to(bias_meta[1])
        return (
            None if d_image is None else d_image.to(image.dtype),
            None if d_text is None else d_text.to(text.dtype),
            d_scale,
            d_bias,
            None,
        )


def siglip_loss_exchanged(image, text, logit_scale, logit_bias, backend, rank: int, world: int, dist_impl: str):
    """The fused SigLIP loss on `world` ranks with bidir or shift, O(B d) memory per rank."""
    return _FusedSigLipExchange.apply(image, text, logit_scale, logit_bias, _Visits(backend, rank, world, dist_impl))


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
            del d_img_part
            if need_text:
                if text_grads is not None:
                    _add_received(d_txt_part, text_grads)
                text_grads = ring.shift(d_txt_part)
            del d_txt_part  # the shift holds it until sent; nothing else of this block outlives it
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
