"""Distributed losses on real gloo process groups (processes forked from the test, free port).

Conventions asserted here (see bigclip/loss/distributed.py and collectives.py):
- fused paths vs OpenCLIP's naive path, any flags, any per-rank grad_output: the same loss on
  every rank, the same feature gradients on every rank, and scale / bias gradients equal to the
  mean over ranks of OpenCLIP's per-rank gradients, identical on every rank;
- with --local-loss --gather-with-grad (and for SigLIP with any exchange), fused and naive,
  against one process computing the loss on the concatenated global batch (grad_output 1 everywhere):
  mean over ranks of the returned losses == the global loss,
  feature gradients on rank r == world_size x the global gradient of rank r's rows,
  scale / bias gradients on every rank == the global gradient (naive: their mean over ranks).
  So once DDP averages parameter gradients over ranks, each parameter holds exactly the
  gradient of the global-batch loss; `_check_ddp_step` asserts that with real DDP-wrapped towers.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import fork_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BATCH, DIM = 7, 9  # per rank; 7 is not a multiple of the tile size set below


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, mode: str) -> None:
    if mode == "triton":  # a fresh interpreter: TRITON_INTERPRET must be set before triton is imported
        mp.spawn(_worker, args=(world, _free_port(), mode), nprocs=world, join=True)
    else:
        fork_ranks(_worker, (world, _free_port(), mode), world)


def _close(got, want, what, rounding=0.0, natural=0.0):
    size = max(want.abs().max().item(), natural)
    excess = ((got - want).abs() - rounding * want.abs() - 1e-5 * size).max().item()
    assert excess <= 0, f"{what}: max error {(got - want).abs().max().item():.3e}, reference max {size:.3e}"


class _Towers(torch.nn.Module):
    """Two linear towers with a learnt scale and bias: enough for DDP to average real gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.image = torch.nn.Linear(DIM, DIM, dtype=torch.float64)
        self.text = torch.nn.Linear(DIM, DIM, dtype=torch.float64)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.3, dtype=torch.float64))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-4.0, dtype=torch.float64))

    def forward(self, images, texts):
        normalize = torch.nn.functional.normalize
        image, text = normalize(self.image(images), dim=-1), normalize(self.text(texts), dim=-1)
        return image, text, self.logit_scale.exp(), self.logit_bias


def _check_ddp_step(rank, world, images, texts, siglip, flags, impl, dist_impl):
    """DDP-averaged parameter gradients == one process's gradients on the global batch."""
    from helpers import loss_for
    from torch.nn.parallel import DistributedDataParallel

    single = _Towers()
    i, t, s, b = single(images, texts)
    loss_for(siglip, False, False, "naive", None, 0, 1)(i, t, s, b).backward()
    model = DistributedDataParallel(_Towers())
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    i, t, s, b = model(images[mine], texts[mine])
    # The CLIP loss takes the bias too (its gradient is exactly zero): DDP needs every parameter used.
    loss_for(siglip, *flags, impl, dist_impl, rank, world)(i, t, s, b).backward()
    for (name, p), q in zip(model.module.named_parameters(), single.parameters()):
        _close(p.grad, q.grad, f"DDP {impl}/{dist_impl} siglip={siglip} {name}", natural=1.0)


def _worker(rank: int, world: int, port: int, mode: str) -> None:
    if mode == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton in this process
    # a short collective timeout turns a mismatched exchange into an error instead of a hang
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )
    try:
        from helpers import loss_for
        from test_loss_reference import unit_features

        import bigclip.loss.chunked as chunked
        from bigclip.loss import collectives

        chunked.TILE = 4
        if mode != "odd_world":  # the ring's and SigLIP's texts travel in pieces of 2, 2 and 3 rows; whole with 3 ranks
            collectives.MIN_PIECE_ROWS = 2
        image_all, text_all = unit_features(world * BATCH, DIM, seed=11, dtype=torch.float64)
        scale, bias = torch.tensor([9.0], dtype=torch.float64), torch.tensor([-4.0], dtype=torch.float64)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)

        def run(siglip, local_loss, gather_with_grad, impl, dist_impl, dtype=torch.float32, grad_output=1.0):
            inputs = [image_all[mine], text_all[mine], scale] + ([bias] if siglip else [])
            inputs = [
                t.to(dtype if i < 2 else torch.float32 if dtype != torch.float64 else dtype).clone().requires_grad_()
                for i, t in enumerate(inputs)
            ]
            loss_fn = loss_for(siglip, local_loss, gather_with_grad, impl, dist_impl, rank, world)
            loss = loss_fn(inputs[0], inputs[1], inputs[2], inputs[3] if siglip else None)
            (loss * grad_output).backward()
            return loss.detach().double(), [t.grad.double() for t in inputs]

        def mean_over_ranks(t):
            t = t.clone()
            dist.all_reduce(t)
            return t / world

        def global_reference(siglip, dtype):
            # on the features as the ranks see them (rounded to dtype), computed in float64
            features = [image_all.to(dtype).double(), text_all.to(dtype).double()]
            inputs = features + [scale] + ([bias] if siglip else [])
            inputs = [t.clone().requires_grad_() for t in inputs]
            loss = loss_for(siglip, False, False, "naive", None, 0, 1)(
                inputs[0], inputs[1], inputs[2], inputs[3] if siglip else None
            )
            loss.backward()
            return loss.detach(), [t.grad for t in inputs]

        def check_against_openclip(siglip, flags, impl, dist_impl):
            grad_output = 1.0 + 0.5 * rank  # ranks may scale their losses differently
            what = f"{impl}/{dist_impl} siglip={siglip} flags={flags} rank={rank}"
            naive_dist_impl = dist_impl if siglip else None
            ref_loss, ref_grads = run(siglip, *flags, "naive", naive_dist_impl, torch.float64, grad_output)
            loss, grads = run(siglip, *flags, impl, dist_impl, grad_output=grad_output)
            _close(loss, ref_loss, what + " loss", natural=1.0)
            for i, (g, r) in enumerate(zip(grads, ref_grads)):
                if i >= 2:
                    r = mean_over_ranks(r)
                    assert torch.equal(mean_over_ranks(g), g), f"{what}: scalar grad {i} differs across ranks"
                _close(g, r, f"{what} grad {i}", natural=9.0 / BATCH if i < 2 else 1.0)

        def check_against_global(siglip, flags, impl, dist_impl, dtype=torch.float32):
            what = f"{impl}/{dist_impl} siglip={siglip} flags={flags} {dtype} rank={rank} vs global"
            rounding = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 2.0**-8}[dtype]
            g_loss, g_grads = global_reference(siglip, dtype)
            loss, grads = run(siglip, *flags, impl, dist_impl, dtype)
            local_loss = flags[0] or siglip
            _close(mean_over_ranks(loss) if local_loss else loss, g_loss, what + " loss", natural=1.0)
            _close(grads[0], world * g_grads[0][mine], what + " d image", rounding, natural=9.0 / BATCH)
            _close(grads[1], world * g_grads[1][mine], what + " d text", rounding, natural=9.0 / BATCH)
            for i in range(2, len(grads)):
                # OpenCLIP's own per-rank scale gradients differ; only their mean (DDP's) is global.
                got = mean_over_ranks(grads[i]) if impl == "naive" else grads[i]
                _close(got, g_grads[i], f"{what} scalar grad {i}", natural=1.0)

        clip_flags = [(True, True), (True, False), (False, True), (False, False)]
        if mode == "full":
            for flags in clip_flags:
                for dist_impl in ("gather", "ring"):
                    check_against_openclip(False, flags, "chunked", dist_impl)
            for dist_impl in ("bidir", "shift", "reduce", "gather"):
                check_against_openclip(True, (False, False), "chunked", dist_impl)
                check_against_global(True, (False, False), "chunked", dist_impl)
                check_against_global(True, (False, False), "naive", dist_impl)
            for dist_impl in ("gather", "ring"):
                check_against_global(False, (True, True), "chunked", dist_impl)
                check_against_global(False, (False, True), "chunked", dist_impl)
            check_against_global(False, (True, True), "naive", None)
            check_against_global(False, (True, True), "chunked", "ring", torch.bfloat16)
            same_everywhere = torch.Generator().manual_seed(5)
            shape = (world * BATCH, DIM)
            raw_images, raw_texts = (
                torch.randn(shape, dtype=torch.float64, generator=same_everywhere) for _ in range(2)
            )
            for siglip, flags, dist_impl in [
                (False, (True, True), "gather"),
                (False, (True, True), "ring"),
                (False, (False, True), "ring"),
                (True, (False, False), "bidir"),
            ]:
                _check_ddp_step(rank, world, raw_images, raw_texts, siglip, flags, "chunked", dist_impl)
        elif mode == "odd_world":
            for dist_impl in ("gather", "ring"):
                check_against_global(False, (True, True), "chunked", dist_impl)
                check_against_openclip(False, (True, False), "chunked", dist_impl)
            for dist_impl in ("bidir", "shift"):
                check_against_global(True, (False, False), "chunked", dist_impl)
                check_against_openclip(True, (False, False), "chunked", dist_impl)  # ranks' weights differ
        elif mode == "overlap":
            _check_transfers_overlap_blocks(rank, world, loss_for, unit_features)
            for dist_impl in ("bidir", "shift"):  # four ranks: bidir's odd last step
                check_against_global(True, (False, False), "chunked", dist_impl)
                check_against_openclip(True, (False, False), "chunked", dist_impl)
        elif mode == "triton":
            for dist_impl in ("gather", "ring"):
                check_against_global(False, (True, True), "triton", dist_impl)
                check_against_openclip(False, (False, False), "triton", dist_impl)
            check_against_global(True, (False, False), "triton", "bidir")
            for dist_impl in ("gather", "ring"):  # the fused path (cuBLAS chunks + Triton kernels) across ranks
                check_against_global(False, (True, True), "fused", dist_impl)
                check_against_openclip(False, (True, False), "fused", dist_impl)
            for dist_impl in ("bidir", "gather"):
                check_against_openclip(True, (False, False), "fused", dist_impl)
        dist.barrier()
    finally:
        from bigclip.dist import shutdown

        shutdown()  # frees the DDP wrappers of _check_ddp_step before the process group goes


def _check_transfers_overlap_blocks(rank, world, loss_for, unit_features) -> None:
    """The ring and neighbour exchanges post the next transfer before computing the current block: every block
    but those of the last transfer is computed while a transfer is in flight (the last one for shift and the CLIP
    ring, forward and backward; for bidir the two of its last pair, or the last one after an odd shift)."""
    import bigclip.loss.chunked as chunked
    from bigclip.loss import collectives

    seen: list[tuple[str, int]] = []

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            seen.append((name, collectives.transfers_in_flight(), collectives.bytes_in_flight()))
            return fn(*args, **kwargs)

        return wrapper

    image, text = unit_features(BATCH, DIM, seed=rank)
    scale, bias = torch.tensor(9.0), torch.tensor(-4.0)
    for siglip, dist_impl in ((True, "shift"), (True, "bidir"), (False, "ring")):
        seen.clear()
        loss = loss_for(siglip, True, True, "chunked", dist_impl, rank, world)
        backend = chunked
        names = ("siglip_block_sums_and_grads",) if siglip else ("clip_block_stats", "clip_block_grads")
        saved = {n: getattr(backend, n) for n in names}
        try:
            for n in names:
                setattr(backend, n, recording(n, saved[n]))
            i, t = image.clone().requires_grad_(), text.clone().requires_grad_()
            loss(i, t, scale.clone().requires_grad_(), bias.clone().requires_grad_() if siglip else None).backward()
        finally:
            for n in names:
                setattr(backend, n, saved[n])
        last = 2 if dist_impl == "bidir" and (world - 1) % 2 == 0 else 1
        # every rank's texts piece by piece, this rank's own first; bidir's steps bring two
        per_exchange = collectives.texts_per_step(dist_impl, world)
        pieces = collectives.text_pieces(BATCH, per_exchange)
        blocks = world * pieces
        assert pieces > 1  # the pieces are on
        for n in names:
            in_flight = [count for name, count, _ in seen if name == n]
            assert len(in_flight) == blocks, (dist_impl, n, seen)
            assert all(count > 0 for count in in_flight[:-last]), (dist_impl, n, in_flight)
        # in flight during a block: a piece of texts sent and one received per exchange, and as many gradients
        # (the ring's with its pieces' column statistics or log-sum-exps, a few numbers per row)
        largest_rows = -(-BATCH // pieces)
        bound = 4 * per_exchange * largest_rows * DIM * text.element_size() + (
            0 if siglip else 4 * 2 * largest_rows * 4
        )
        assert max(b for _, _, b in seen) <= bound, (dist_impl, bound, seen)
        assert collectives.transfers_in_flight() == 0  # every transfer was waited for


def test_two_ranks_all_variants_chunked():
    _run(2, "full")


def test_three_ranks_ring_and_exchanges():
    _run(3, "odd_world")


@pytest.mark.parametrize("world", [pytest.param(3, marks=pytest.mark.extended), 4])  # in CI: 4 ranks
def test_exchanges_overlap_the_blocks(world):
    _run(world, "overlap")


def test_two_ranks_triton_interpreted():
    _run(2, "triton")
