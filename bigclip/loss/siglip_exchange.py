"""The SigLIP loss across ranks (`siglip_blocks`: OpenCLIP's exchanges around any block backend;
`siglip_loss_exchanged`: the fused bidir / shift exchange, one autograd node whose texts and gradients travel
while blocks are computed). The neighbour exchanges are posted before the block that precedes their use, so
the texts travel while a block is computed.

(The exchange's forward and backward are one autograd Function whose two halves mirror each other's
communication exactly; they are kept side by side on purpose.)
"""

from __future__ import annotations

import torch

from bigclip.loss.collectives import (
    AllGatherWithGrad,
    AllReduceWithGrad,
    Transfer,
    add_received,
    gather_grad_outputs,
    post_exchange,
    post_p2p,
    row_spans,
    text_pieces,
    texts_per_step,
)


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
        post_pair = lambda to_left, to_right: post_exchange((left, right), (right, left), to_left, to_right)  # noqa: E731
        post_right = lambda to_right: post_exchange((right,), (left,), to_right)  # noqa: E731
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
        upcoming = post_exchange((right,), (left,), text)
        total = own()
        for step in range(world_size - 1):
            transfer, (current,) = upcoming
            transfer.wait()
            if step + 1 < world_size - 1:
                upcoming = post_exchange((right,), (left,), current)
            total = total + others(current)
        return total
    total = own()
    if dist_impl == "reduce":
        for source in range(world_size):
            received = AllReduceWithGrad.apply(text * float(source == rank))
            if source != rank:
                total = total + others(received)
            else:
                # Own block already counted; keep the all-reduce in the graph anyway, since its
                # backward is a collective every rank must join.
                total = total + 0.0 * received.sum()
    elif dist_impl == "gather":
        for source, other in enumerate(AllGatherWithGrad.apply(text).chunk(world_size)):
            if source != rank:
                total = total + others(other)
    else:
        raise ValueError(f"unknown SigLIP dist_impl {dist_impl!r}")
    return total


class _Visits:
    """The fused SigLIP loss's walk over every rank's texts (bidir or shift) for one rank's images.

    Each rank's texts travel in row pieces (`text_pieces`), one walk of OpenCLIP's exchange per piece, the walks
    back to back: each text exchange is posted before the block that precedes its use (a walk's last visit posts
    the next walk's first exchange, of the rank's own next piece), and each visiting piece's text gradient is sent
    straight to its owner while the next piece is computed. What is alive during a block is a fixed number of
    pieces (those at hand, those in flight, a gradient on its way to its owner and one arriving) plus the images'
    and own texts' float32 gradients: O(B d) and the same at 2 ranks as at 64 (a 2-rank walk of a whole block
    would have nothing in flight while its one visit is computed, so its memory would grow to 4 ranks' by 3 blocks)."""

    def __init__(self, backend, rank: int, world: int, dist_impl: str):
        self.backend, self.rank, self.world, self.dist_impl = backend, rank, world, dist_impl

    def schedule(self) -> list[tuple[int, ...]]:
        """Per exchange of one walk, the offsets o of the owners (rank + o) whose texts it brings (OpenCLIP's
        order)."""
        if self.dist_impl == "shift":
            return [(-k,) for k in range(1, self.world)]
        pairs, odd = divmod(self.world - 1, 2)
        return [(k, -k) for k in range(1, pairs + 1)] + ([(-(pairs + 1),)] if odd else [])

    def _post_texts(self, offsets: tuple[int, ...], previous: tuple[torch.Tensor, ...]) -> Transfer:
        """Texts of owners rank + o: each arrives from the neighbour on o's side, which passes on what it holds
        from one step closer to the owner (its own piece at a walk's first step)."""
        world, rank = self.world, self.rank
        sends, recvs = [], []
        for o, held in zip(offsets, previous):
            toward = 1 if o < 0 else -1  # texts of owners to the left travel right, and the other way
            sends.append((held, (rank + toward) % world))
            recvs.append((torch.empty_like(held), (rank - toward) % world))
        return post_p2p(sends, recvs)

    def _post_grads(self, offsets: tuple[int, ...], grads: list[torch.Tensor]) -> Transfer:
        """Each visiting piece's text gradient to its owner; ours from the ranks holding that piece of ours now."""
        world, rank = self.world, self.rank
        sends = [(g, (rank + o) % world) for o, g in zip(offsets, grads)]
        recvs = [(torch.empty_like(g), (rank - o) % world) for o, g in zip(offsets, grads)]
        return post_p2p(sends, recvs)

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

        text = text.contiguous()
        walk = self.schedule()
        spans = row_spans(text.shape[0], text_pieces(text.shape[0], texts_per_step(self.dist_impl, self.world)))
        pieces = [text[s] for s in spans]  # views: the own texts are alive anyway
        visits = [(piece, offsets) for piece in range(len(spans)) for offsets in walk]
        texts_in_flight = self._post_texts(visits[0][1], (pieces[0],) * len(visits[0][1]))
        for span, piece in zip(spans, pieces):  # the own blocks (positives: image i, text i), while the first travel
            own = block(piece, -span.start)
            if need_text:
                d_text[span].add_(own)
        del own  # every name below is dropped once used: what is alive during a block is what the walk needs
        grads_in_flight = None
        for v, (piece, offsets) in enumerate(visits):
            arrived = texts_in_flight.wait()
            if v + 1 < len(visits):
                next_piece, next_offsets = visits[v + 1]
                if next_piece != piece:  # a new walk starts from this rank's own next piece
                    passed_on = (pieces[next_piece],) * len(next_offsets)
                else:  # bidir's odd last step passes one of the two on
                    passed_on = arrived if len(next_offsets) == len(arrived) else arrived[-1:]
                texts_in_flight = self._post_texts(next_offsets, passed_on)
                del passed_on
            grads = [block(texts, None) for texts in arrived]
            del arrived
            if grads_in_flight is not None:
                add_received(d_text[grads_in_flight[0]], grads_in_flight[1])
            grads_in_flight = (spans[piece], self._post_grads(offsets, grads)) if need_text else None
            del grads
        if grads_in_flight is not None:
            add_received(d_text[grads_in_flight[0]], grads_in_flight[1])
        return sums, d_image, d_text


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
        grads = gather_grad_outputs(grad)
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
