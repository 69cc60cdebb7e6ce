"""The contrastive loss's memory model (bigclip.loss.memory), which `bigclip plan` and --dry-run add to the peak:
against the peaks the GPU kit measured (docs/gpu-runs), and the implementation --loss-impl auto picks."""

from __future__ import annotations

import glob
import json
import os

import pytest
from helpers import REPO

import bigclip.engine  # noqa: F401  (the engines list their memory setups, which peak_parts reads)
from bigclip.loss import LossConfig
from bigclip.loss.memory import chosen_impl, loss_peak_bytes
from bigclip.memory import StateRecipe, contrastive_loss_bytes, model_facts, peak_parts

GiB = 2**30


def _kit_rows():
    runs = sorted(glob.glob(os.path.join(REPO, "docs", "gpu-runs", "*-losses.json")))  # date-time first: newest last
    assert runs, "no GPU kit losses run in docs/gpu-runs"
    with open(runs[-1]) as f:
        return json.load(f)["parts"]["losses"]["tables"]["rows"]


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_the_model_is_within_10_percent_of_the_kits_measured_peaks(family):
    checked = 0
    for row in _kit_rows():
        measured = isinstance(row.get("peak_gib"), float)
        if row["family"] != family or row["impl"] not in ("fused", "naive") or not measured:
            continue
        if row["n"] < 16384:  # the smallest batches' peaks are a few cuBLAS workspaces, not the loss's buffers
            continue
        cfg = LossConfig(loss=family, loss_impl=row["impl"], loss_precision=row["precision"] or "exact")
        feature_bytes = 2 if row["dtype"] == "bfloat16" else 4
        model = loss_peak_bytes(cfg, row["n"], 1, row["d"], feature_bytes) / GiB
        assert abs(model - row["peak_gib"]) <= 0.1 * row["peak_gib"], (row, model)
        checked += 1
    assert checked >= 8


def test_auto_picks_naive_where_it_was_measured_faster_and_fused_beyond():
    cfg = LossConfig()
    assert chosen_impl(cfg, 2048, 1, 2) == "naive"  # 2048^2 logits in bf16: naive was faster on the H200
    assert chosen_impl(cfg, 4096, 16, 2) == "fused"  # 65536 global
    assert chosen_impl(cfg, 4096, 16, 2, device_type="cpu") == "chunked"
    assert chosen_impl(LossConfig(loss_impl="naive"), 4096, 16, 2) == "naive"
    # never the naive loss where it would drop what the flags ask for: the ring exchange, the fast arithmetic
    assert chosen_impl(LossConfig(loss_dist_impl="ring"), 2048, 1, 2) == "fused"
    assert chosen_impl(LossConfig(loss_precision="fast"), 2048, 1, 2) == "fused"
    assert chosen_impl(LossConfig(loss="siglip", loss_dist_impl="shift"), 2048, 1, 2) == "naive"  # SigLIP's naive


def test_the_plan_counts_the_loss_of_the_global_batch():
    facts = model_facts("ViT-B-32")
    amp = StateRecipe("amp")
    small = peak_parts("fsdp", facts, 8, amp, 256, True)  # 2048 global: naive, four 2048^2 float32 matrices
    assert small["loss"] == pytest.approx(4 * 2048**2 * 4 + 2 * 7 * 256 * 512 * 4 + 2 * 256 * 512 * 4)
    # 1024 ranks x 256: the naive loss would hold four 262144^2 matrices (1 TiB); auto's fused path a few GiB
    big = peak_parts("fsdp", facts, 1024, amp, 256, True)
    naive = contrastive_loss_bytes(LossConfig(loss_impl="naive"), facts, 1024, amp, 256)
    assert naive > 2**40 and big["loss"] < 4 * GiB
    ring = contrastive_loss_bytes(LossConfig(loss_dist_impl="ring"), facts, 1024, amp, 256)
    assert ring < big["loss"] / 10  # the ring holds one rank's texts at a time, the gather path all of them
    assert big["backward"] - peak_parts("fsdp", facts, 1024, amp, 256, True, loss=LossConfig(loss_dist_impl="ring"))[
        "backward"
    ] == pytest.approx(big["loss"] - ring)


def test_the_exchanges_hold_the_same_at_every_world_size():
    """The CLIP ring and SigLIP's bidir and shift move one rank's texts in pieces (loss/collectives.py): what they
    hold besides the gradients does not grow with the world, and is a few pieces, not whole blocks
    (bench/loss_ranks.py measures it on gloo ranks)."""
    batch, dim = 4096, 1024
    for family, dist_impl in (("clip", "ring"), ("siglip", "bidir"), ("siglip", "shift")):
        cfg = LossConfig(loss=family, loss_dist_impl=dist_impl, loss_impl="chunked")
        at = {world: loss_peak_bytes(cfg, batch, world, dim, 4) for world in (2, 4, 64)}
        assert at[2] == at[4] == at[64], (dist_impl, at)
        gather = loss_peak_bytes(
            LossConfig(loss=family, loss_dist_impl="gather", loss_impl="chunked"), batch, 64, dim, 4
        )
        assert at[64] < gather / 10
        single = loss_peak_bytes(cfg, batch, 1, dim, 4)
        # a quarter of the texts sent and one received per step, as many gradients (bidir: twice, half the size)
        assert at[64] - single == 4 * (batch // 4) * dim * 4, (dist_impl, at[64] - single)


def test_a_transfer_is_counted_in_flight_only_while_it_has_posted_ops():
    """collectives.Transfer's counters (what the overlap test bounds): a transfer with no ops (a rank with nothing
    to send) is never in flight, so waiting on it leaves the counts as they were."""
    import torch

    from bigclip.loss import collectives

    before = (collectives.transfers_in_flight(), collectives.bytes_in_flight())
    empty = collectives.Transfer([], (), ())
    assert (collectives.transfers_in_flight(), collectives.bytes_in_flight()) == before
    assert empty.wait() == () and (collectives.transfers_in_flight(), collectives.bytes_in_flight()) == before

    class Done:
        def wait(self):
            return True

    sent, received = torch.zeros(4), torch.zeros(2, dtype=torch.float64)
    posted = collectives.Transfer([Done()], (sent,), (received,))
    assert (collectives.transfers_in_flight(), collectives.bytes_in_flight()) == (before[0] + 1, before[1] + 32)
    assert posted.wait() == (received,) and posted.wait() == ()  # once
    assert (collectives.transfers_in_flight(), collectives.bytes_in_flight()) == before
