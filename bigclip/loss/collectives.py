"""Moving features between ranks for the contrastive losses, with correct autograd: OpenCLIP's exchanges
(all-gather with or without gradient, all-reduce with gradient, neighbour exchanges one way and both ways),
point-to-point transfers that run while a block is computed (`Transfer`, posted by `post_exchange` /
`post_p2p`; `transfers_in_flight` counts them for the tests), and `mean_grad_across_ranks` (identity forward;
backward replaces each rank's gradient by the mean over ranks, used on logit_scale and logit_bias by the fused
paths). The gradient a rank receives through a gathered tensor is the sum over ranks.

Used by the naive reference, the SigLIP exchanges (siglip_exchange.py) and the fused distributed CLIP loss
(distributed.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


class AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return all_gather_rows(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad)


class AllReduceWithGrad(torch.autograd.Function):
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
        return AllGatherWithGrad.apply(image), AllGatherWithGrad.apply(text)
    with torch.no_grad():
        all_image, all_text = all_gather_rows(image), all_gather_rows(text)
    if not local_loss:
        # Only this rank's own slice carries gradient, as in OpenCLIP.
        images, texts = list(all_image.chunk(world_size)), list(all_text.chunk(world_size))
        images[rank], texts[rank] = image, text
        all_image, all_text = torch.cat(images), torch.cat(texts)
    return all_image, all_text


class Transfer:
    """One batch of point-to-point ops; `wait` gives the received tensors and waits at most once
    (on gloo a second wait on a finished send or receive blocks forever)."""

    in_flight = 0  # posted and not yet waited for, in this process: what overlaps the compute now
    bytes_in_flight = 0  # their sent and receive buffers' bytes: what the overlap costs in memory

    def __init__(self, works, sent: tuple, received: tuple):
        self.works, self.sent, self.received = works, sent, received  # the sent tensors must live until sent
        self.bytes = sum(t.numel() * t.element_size() for t in sent + received) if works else 0
        if works:  # counted while posted ops are outstanding: an empty transfer is never in flight
            Transfer.in_flight += 1
            Transfer.bytes_in_flight += self.bytes

    def wait(self) -> tuple:
        """The received tensors, once; the transfer lets go of them (and of the sent ones), so a ring that keeps
        its transfers until `finish` holds no features of ranks it has passed."""
        if self.works:
            Transfer.in_flight -= 1
            Transfer.bytes_in_flight -= self.bytes
        for work in self.works:
            work.wait()
        received = self.received
        self.works, self.sent, self.received = [], (), ()
        return received


def transfers_in_flight() -> int:
    """Feature transfers posted and not yet waited for (tests check that the compute overlaps them)."""
    return Transfer.in_flight


def bytes_in_flight() -> int:
    """Bytes of the transfers posted and not yet waited for (tests bound what the overlap holds)."""
    return Transfer.bytes_in_flight


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
        posted.append(Transfer(dist.batch_isend_irecv(ops), sent, received))
        return received

    @staticmethod
    def backward(ctx, *grads):
        to_peers, from_peers = ctx.peers
        grads = tuple(g.contiguous() for g in grads)
        back = tuple(torch.empty_like(g) for g in grads)
        _exchange(list(zip(grads, from_peers)), list(zip(back, to_peers)))
        return (None, None, None, *back)


def post_exchange(to_peers: tuple, from_peers: tuple, *tensors) -> tuple[Transfer, tuple]:
    """(the transfer, its receive buffers): read the buffers only after the transfer's wait()."""
    posted: list[Transfer] = []
    received = _PostExchange.apply(posted, to_peers, from_peers, *tensors)
    return posted[0], received


def add_received(total: torch.Tensor, transfer: Transfer) -> None:
    """Waits for `transfer` and adds what it received into `total`, keeping no reference to it."""
    for received in transfer.wait():
        total.add_(received)


def post_p2p(sends: list, recvs: list) -> Transfer:
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    return Transfer(dist.batch_isend_irecv(ops), tuple(t for t, _ in sends), tuple(t for t, _ in recvs))


def gather_grad_outputs(grad: torch.Tensor) -> torch.Tensor:
    """Every rank's grad_output of its loss (W numbers): the fused paths weigh each rank's share by it, so the
    gradients stay exact even if ranks scale their losses differently."""
    return all_gather_rows(grad.detach().float().reshape(1))


# Each rank's texts travel in row pieces, one turn of the exchange per piece (the CLIP ring's, SigLIP's bidir /
# shift walks), so what is in flight during a block is a few pieces whatever the world size. A step moves at most
# 1 / TEXT_PIECES of a rank's texts and at least MIN_PIECE_ROWS rows (bidir's steps move two pieces, so its pieces
# are half as large): each piece is a matmul of all the rank's images against its rows, and 1024 rows keep a step's
# matmuls tensor-core sized; blocks too small to split hold little anyway. Read at call time, so tests and
# benchmarks can change them.
TEXT_PIECES = 4
MIN_PIECE_ROWS = 1024


def text_pieces(batch: int, per_step: int = 1) -> int:
    """How many pieces one rank's `batch` texts travel in (1: whole), when each step of the exchange moves
    `per_step` pieces."""
    return max(1, min(TEXT_PIECES * per_step, per_step * batch // MIN_PIECE_ROWS))


def texts_per_step(dist_impl: str, world: int) -> int:
    """Pieces one step of the exchange brings: bidir's from both neighbours once there are two, else one."""
    return 2 if dist_impl == "bidir" and world > 2 else 1


def row_spans(rows: int, pieces: int) -> list[slice]:
    """`pieces` contiguous row slices of sizes differing by at most one (every rank splits the same way)."""
    bounds = [rows * k // pieces for k in range(pieces + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
