"""`bigclip plan`'s peak memory: how it is composed, and one setup measured against it (bench/plan_check.py's full
grid, every precision x optimizer x engine x stepping for ViT-B-32 and ViT-L-14, is in docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, subprocess_env

import bigclip.engine  # noqa: F401  (the engines list their memory setups)
from bigclip.memory import StateRecipe, activation_bytes, max_batch, model_facts, peak_parts, state_bytes
from bigclip.optim import ADAMW8BIT_BYTES
from bigclip.optim.packed_window import PACKED_WINDOW_VALUES


def test_the_peak_is_the_largest_of_its_moments():
    facts = model_facts("ViT-L-14")
    psi, batch = facts.params, 32
    fp32, amp = StateRecipe("fp32"), StateRecipe("amp")
    # DDP keeps its gradient buckets between steps: the backward starts with the whole state beside the activations
    ddp = peak_parts("ddp", facts, 8, fp32, batch, False, "cpu")
    assert ddp["backward"] == (
        state_bytes("ddp", psi, 8, fp32, facts) + ddp["inputs"] + activation_bytes(facts, batch, False, 4) + ddp["loss"]
    )
    # the batch on the device: float32 images (the weights' dtype) and int64 token ids
    assert ddp["inputs"] == batch * (3 * 224 * 224 * 4 + 77 * 8)
    # fp32 activations are twice the 16-bit ones; amp keeps a bf16 copy of every weight through the backward
    assert activation_bytes(facts, batch, False, 4) == 2 * activation_bytes(facts, batch, False, 2)
    amp_ddp = peak_parts("ddp", facts, 8, amp, batch, False, "cpu")
    assert amp_ddp["backward"] == (
        state_bytes("ddp", psi, 8, amp, facts) + amp_ddp["inputs"] + amp_ddp["activations"] + 2 * psi + amp_ddp["loss"]
    )
    # FSDP2 frees the gradients after each step: its backward starts with one block's gradient shards
    fsdp = peak_parts("fsdp", facts, 8, fp32, batch, False, "cpu")
    one_block = state_bytes("fsdp", psi, 8, dataclasses.replace(fp32, in_backward=True), facts)
    assert fsdp["backward"] == one_block + fsdp["inputs"] + fsdp["activations"] + fsdp["loss"]
    # torch's AdamW on CUDA (multi-tensor) builds a float32 temporary per parameter in the step: with few
    # activations (checkpointing) the step is the peak; on CPU (tensor by tensor) two of the largest tensor
    cuda = peak_parts("fsdp", facts, 1, amp, 1, True, "cuda")
    assert cuda["step"] == state_bytes("fsdp", psi, 1, amp, facts) + cuda["inputs"] + 4 * psi
    assert cuda["peak"] == cuda["step"]
    cpu = peak_parts("fsdp", facts, 1, amp, 1, True, "cpu")
    assert cpu["step"] == state_bytes("fsdp", psi, 1, amp, facts) + cpu["inputs"] + 2 * 4 * facts.largest_tensor
    # the packed 8-bit update steps a window of values at a time: the window's packed bf16 weights and gradients,
    # 8-bit moments and the compiled update's temporaries; stepped in the backward there is no step of its own:
    # the token embedding is updated at the end of the text tower, its unsharded gradient and its shard in flight,
    # the image tower's activations alive
    lean_recipe = StateRecipe("pure_bf16", "adamw8bit", True)
    lean = peak_parts("fsdp", facts, 1, lean_recipe, 1, True, "cuda")
    window = (2 * 2 + ADAMW8BIT_BYTES + 8) * PACKED_WINDOW_VALUES  # 8 bytes of temporaries with 8-bit moments
    assert lean["working"] == window and lean["step"] == 0
    # a window spans at most what is stepped together: in the backward one unit (a block, or the root's
    # parameters), with gradients kept the whole shard
    per_value = window / PACKED_WINDOW_VALUES
    small_units = dataclasses.replace(facts, block_params=10_000, root_params=30_000)
    assert peak_parts("fsdp", small_units, 2, lean_recipe, 1, True, "cuda")["working"] == per_value * 15_000
    kept_lean = StateRecipe("pure_bf16", "adamw8bit")
    assert peak_parts("fsdp", small_units, 2, kept_lean, 1, True, "cuda")["working"] == window
    assert peak_parts("ddp", small_units, 2, lean_recipe, 1, True, "cuda")["working"] == per_value * 30_000
    assert lean["peak"] == max(lean["backward"], lean["text_end"])
    image_tower = dataclasses.replace(facts, towers=facts.towers[:1])
    assert (
        lean["text_end"]
        == state_bytes("fsdp", psi, 1, lean_recipe, facts)
        + (3 * 224 * 224 * 2 + 77 * 8)  # one sample; its image in bfloat16, as the weights
        + activation_bytes(image_tower, 1, True, 2)
        + 2 * 2 * facts.largest_tensor
        + window
    )
    # DistributedDataParallel rebuilds its gradient buckets once, at the second step's start. Accumulating, the
    # gradients still view the old bucket then (engine/ddp.py): beside the whole state and the inputs, a second copy
    # of every gradient (checkpointed, the peak); else they are None between steps and the old bucket goes first. On
    # one rank, or stepped in the backward, no DistributedDataParallel is built, and FSDP2 has no buckets
    fp32_accum, pure_accum = StateRecipe("fp32", accum_freq=2), StateRecipe("pure_bf16", accum_freq=2)
    accumulating = peak_parts("ddp", facts, 8, fp32_accum, batch, True, "cpu")
    assert accumulating["rebucket"] == state_bytes("ddp", psi, 8, fp32_accum, facts) + accumulating["inputs"] + 4 * psi
    assert accumulating["inputs"] == 2 * ddp["inputs"]  # both micro-batches on the device
    assert accumulating["peak"] == accumulating["rebucket"] > accumulating["step"]
    assert peak_parts("ddp", facts, 8, pure_accum, batch, True, "cpu")["rebucket"] == (
        state_bytes("ddp", psi, 8, pure_accum, facts) + 2 * batch * (3 * 224 * 224 * 2 + 77 * 8) + 2 * psi
    )
    assert ddp["rebucket"] == amp_ddp["rebucket"] == 0
    assert peak_parts("ddp", facts, 1, fp32_accum, batch, True, "cpu")["rebucket"] == 0
    assert peak_parts("ddp", facts, 8, StateRecipe("fp32", in_backward=True), batch, True, "cpu")["rebucket"] == 0
    assert peak_parts("fsdp", facts, 8, fp32_accum, batch, True, "cpu")["rebucket"] == 0
    # --dry-run names the moment
    from bigclip import dry_run
    from bigclip.config import resolve
    from bigclip.dist import World

    cfg = resolve({"model": "ViT-L-14", "dataset_type": "synthetic", "batch_size": batch, "precision": "fp32",
                   "grad_checkpointing": True, "accum_freq": 2}).sections.engine  # fmt: skip
    (line,) = dry_run._memory_lines(cfg, World(world_size=8), "ddp", facts)
    moment = "the second step's start (DDP rebuilds its gradient buckets)"
    assert f"peak at {moment} {accumulating['rebucket'] / 2**30:.1f} GiB" in line
    # DeepSpeed cannot run 8-bit moments: no prediction rather than a wrong one
    assert peak_parts("zero3", facts, 8, StateRecipe("amp", "adamw8bit"), batch, False) is None


def test_accumulation_in_the_plan(capsys):
    """--accum-freq k: the activations are one micro-batch's, the contrastive loss runs over all k micro-batches'
    features; ZeRO-1's last backward starts with every full gradient (DeepSpeed reduces them into partitions only
    at the accumulation boundary), FSDP2's with every gradient shard (reduce-scattered each micro-batch), DDP's
    gradients are its buckets either way. Measured on CPU: bench/plan_check.py --accum-freq 2 (docs/benchmarks.md)."""
    from bigclip import cli
    from bigclip.loss import LossConfig

    facts = model_facts("ViT-L-14")
    psi, n, batch = facts.params, 8, 32
    naive = LossConfig(loss_impl="naive")
    once = {e: peak_parts(e, facts, n, StateRecipe("amp"), batch, True, loss=naive) for e in ("ddp", "fsdp", "zero1")}
    accum = {e: peak_parts(e, facts, n, StateRecipe("amp", accum_freq=4), batch, True, loss=naive) for e in once}
    for engine in once:
        assert accum[engine]["activations"] == once[engine]["activations"]
        assert (
            accum[engine]["loss"]
            == peak_parts(engine, facts, n, StateRecipe("amp"), 4 * batch, True, loss=naive)["loss"]
        )
        assert accum[engine]["loss"] > 4 * once[engine]["loss"]  # the naive loss's logits grow with the square
    # every micro-batch's inputs stay on the device for the whole step
    assert all(accum[e]["inputs"] == 4 * once[e]["inputs"] for e in once)
    extra = {
        e: accum[e]["backward"] - accum[e]["loss"] - accum[e]["inputs"] - (once[e]["backward"] - once[e]["loss"]
                                                                          - once[e]["inputs"])
        for e in once
    }  # fmt: skip
    assert extra["ddp"] == 0
    assert extra["zero1"] == 2 * psi  # every bf16 gradient, whole
    kept = state_bytes("fsdp", psi, n, StateRecipe("amp"), facts)
    one_block = state_bytes("fsdp", psi, n, StateRecipe("amp", in_backward=True), facts)
    assert extra["fsdp"] == kept - one_block > 3.8 * psi / n  # every float32 gradient shard (but one block's)
    assert cli.main(["plan", "--model", "ViT-L-14", "--gpus", "8", "--gpu-mem", "80", "--accum-freq", "4"]) == 0
    assert "Contrastive loss per GPU at 128 samples per GPU" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "ViT-L-14", "--accum-freq", "0"]) == 2
    assert "--accum-freq: 0 is not a positive integer" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "ViT-L-14", "--accum-freq", "2", "--optimizer-in-backward"]) == 2
    assert "--optimizer-in-backward cannot accumulate micro-batches" in capsys.readouterr().err
    # what fits with accumulation never steps the optimizer in the backward
    from bigclip.memory import fitting_setups

    fits = fitting_setups(facts, n, 80e9, batch, naive, accum_freq=4)
    assert fits and not any(recipe.in_backward for _, _, recipe in fits)
    assert any(recipe.in_backward for _, _, recipe in fitting_setups(facts, n, 80e9, batch, naive))
    # --dry-run's memory line plans the run's accumulation
    from bigclip import dry_run
    from bigclip.config import resolve
    from bigclip.dist import World

    lines = {}
    for k in (1, 4):
        cfg = resolve({"model": "ViT-B-32", "dataset_type": "synthetic", "batch_size": 16, "accum_freq": k})
        lines[k] = dry_run.report(cfg.sections.model, cfg.sections.engine, World())[-1]
    assert "--accum-freq 4" in lines[4] and "--accum-freq" not in lines[1]


def plan_check_rows(tmp_path, args: list[str], timeout: float = 900) -> list[dict]:
    """bench/plan_check.py with `args` in a fresh process; the rows it measured (its --json file)."""
    rows_file = tmp_path / "rows.json"
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "plan_check.py"), *args, "--json", str(rows_file)],
        capture_output=True, text=True, timeout=timeout, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(rows_file.read_text())["rows"]


@pytest.mark.extended  # 2-5 min of measured steps; in CI the planner's peak rule on its own (above)
@pytest.mark.slow
def test_the_predicted_peak_of_the_leanest_setup_is_within_10_percent_of_the_measured(tmp_path):
    """bench/plan_check.py on one setup: 2 FSDP2 ranks, bf16 weights, 8-bit AdamW stepped in the backward, ViT-B-32;
    the rank's resident memory above its baseline against the plan's peak plus the runtime measured on test-tiny."""
    (row,) = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "4", "--steps", "2", "--engines", "fsdp", "--precisions",
         "pure_bf16", "--opts", "adamw8bit", "--stepping", "in-backward"],
    )  # fmt: skip
    facts = model_facts("ViT-B-32")
    parts = peak_parts("fsdp", facts, 2, StateRecipe("pure_bf16", "adamw8bit", True), 4, False, "cpu")
    predicted = parts["peak"] + row["runtime"]
    assert row["measured"] == pytest.approx(predicted, rel=0.10), (row, parts)
    assert row["runtime"] < 0.3 * row["measured"]  # the model, not the runtime, is what was measured


def test_locked_towers_in_the_plan(capsys):
    """--lock-image / --lock-text: the model's own lock methods freeze the meta model; frozen parameters count as
    weights only, placed and typed as each engine holds the model's weights, and the blocks below the first
    trainable one save no activations (a meta forward says which run under autograd)."""
    from bigclip import cli, dry_run
    from bigclip.config import resolve
    from bigclip.dist import World
    from bigclip.memory import Locks, locked_weight_bytes, model_state_bytes
    from bigclip.model import create_model

    model = create_model("ViT-B-32", device="meta")
    image_params = sum(p.numel() for p in model.visual.parameters())
    whole = model_facts("ViT-B-32")
    lit = model_facts("ViT-B-32", None, Locks(image_unlocked_groups=0))
    assert lit.frozen_params == image_params and lit.trainable_params == whole.params - image_params
    assert lit.towers[0][0] == 0 and lit.towers[1] == whole.towers[1]  # the image tower keeps nothing
    assert model_facts("ViT-B-32", None, Locks(image_unlocked_groups=2)).towers[0][0] == 1  # the last block + head
    # --lock-text leaves the LayerNorms trainable unless --lock-text-freeze-layer-norm: every block still saves
    assert model_facts("ViT-B-32", None, Locks(text_unlocked_layers=0)).towers[1][0] == 12
    assert model_facts("ViT-B-32", None, Locks(text_unlocked_layers=0, text_freeze_layer_norm=True)).towers[1][0] == 0
    # a ResNet image tower (traced, no formula) wholly locked: nothing traced, nothing uncounted
    rn50 = model_facts("RN50", None, Locks(image_unlocked_groups=0))
    assert rn50.traced == () and rn50.uncounted is None and len(rn50.towers) == 1
    amp, n, f = StateRecipe("amp"), 8, lit.frozen_params
    # frozen weights: fp32 under amp, whole (DDP, ZeRO-1/2: DeepSpeed's working bf16) or sharded (FSDP2, ZeRO-3)
    expected = {"ddp": 4 * f, "fsdp": 4 * f / n, "zero1": 2 * f, "zero2": 2 * f, "zero3": 2 * f / n}
    for setup, locked in expected.items():
        assert locked_weight_bytes(setup, f, n, amp) == locked, setup
        assert model_state_bytes(setup, lit, n, amp) == state_bytes(setup, lit.trainable_params, n, amp, lit) + locked
        assert model_state_bytes(setup, lit, n, amp) < model_state_bytes(setup, whole, n, amp)
    assert locked_weight_bytes("zero3_offload", f, n, amp) == 0
    parts = peak_parts("ddp", lit, n, amp, 32, False, "cpu")
    assert parts["activations"] == activation_bytes(lit, 32, False, 2) < activation_bytes(whole, 32, False, 2)
    # DDP amp: autocast caches 16-bit copies of trainable weights only
    assert parts["working"] - peak_parts("ddp", whole, n, amp, 32, False, "cpu")["working"] == -2 * image_params
    assert cli.main(["plan", "--model", "ViT-B-32", "--gpus", "8", "--gpu-mem", "80", "--lock-image"]) == 0
    assert "0.09B locked" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "ViT-B-32", "--lock-text-unlocked-layers", "2"]) == 2
    assert "--lock-text-unlocked-layers: acts only with --lock-text" in capsys.readouterr().err
    cfg = resolve({"model": "ViT-B-32", "dataset_type": "synthetic", "batch_size": 16, "lock_image": True})
    lines = dry_run.report(cfg.sections.model, cfg.sections.engine, World())
    assert f"model ViT-B-32: 151.3M parameters ({image_params / 1e6:.1f}M of them locked)" in lines


@pytest.mark.extended  # 4-7 min of measured steps; in CI the plan's accumulation arithmetic (above) and the
@pytest.mark.slow  # engine matrix's gradient memory between micro-batches (test_engine_multiprocess.py)
def test_the_predicted_peak_with_accumulation_is_within_10_percent_of_the_measured(tmp_path):
    """bench/plan_check.py --accum-freq 2 on DDP and FSDP2 (amp, AdamW, ViT-B-32): before bigclip kept DDP's
    gradients in its buckets across micro-batches and reduce-scattered FSDP2's every micro-batch, they measured
    1.20x and 1.32x of this plan (a whole float32 gradient, and every block's unsharded one, beside it)."""
    rows = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "8", "--steps", "2", "--accum-freq", "2", "--engines", "ddp",
         "fsdp", "--precisions", "amp", "--opts", "adamw", "--stepping", "kept"],
        timeout=1200,
    )  # fmt: skip
    facts = model_facts("ViT-B-32")
    for row in rows:
        parts = peak_parts(row["engine"], facts, 2, StateRecipe("amp", accum_freq=2), 8, False, "cpu")
        assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)
    assert [row["engine"] for row in rows] == ["ddp", "fsdp"]


@pytest.mark.extended  # ~3 min of measured steps; in CI the plan's rebucket arithmetic (above) and the engine
@pytest.mark.slow  # matrix's DDP buckets built anew at the second step (test_engine_multiprocess.py)
@pytest.mark.parametrize("accum", [1, 2])
def test_the_predicted_peak_of_ddp_with_checkpointing_is_within_10_percent_of_the_measured(tmp_path, accum):
    """bench/plan_check.py --grad-checkpointing on DDP (fp32, AdamW, ViT-B-32). DistributedDataParallel rebuilds
    its gradient buckets at the second step's start: gradients that still viewed the old bucket then kept it beside
    the new ones, which measured 1.15x of the plan (the whole gradient, 577 MiB, beside the state). Without
    accumulation they are None between steps now, and the peak is the step's; accumulating, they must view the
    buckets, and the plan counts the rebuild (its peak then)."""
    (row,) = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "8", "--steps", "3", "--grad-checkpointing", "--accum-freq",
         str(accum), "--engines", "ddp", "--precisions", "fp32", "--opts", "adamw", "--stepping", "kept"],
    )  # fmt: skip
    parts = peak_parts("ddp", model_facts("ViT-B-32"), 2, StateRecipe("fp32", accum_freq=accum), 8, True, "cpu")
    assert parts["peak"] == (parts["rebucket"] if accum > 1 else parts["step"])
    assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)


@pytest.mark.extended  # ~3 min of measured steps; in CI the swap's allocations (test_ema.py)
@pytest.mark.slow
def test_an_evaluation_with_the_average_swapped_in_stays_under_the_planned_peak(tmp_path):
    """bench/plan_check.py --eval --ema: after the steps, validation with the live weights and again with the
    average swapped in (--eval-ema), measured with them; the plan counts the training step only, so evaluation
    must not raise the peak (its swap copied every weight until 2026-11-29). DDP, amp, checkpointed, ViT-B-32."""
    (row,) = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "8", "--steps", "2", "--grad-checkpointing", "--ema", "--eval",
         "--engines", "ddp", "--precisions", "amp", "--opts", "adamw", "--stepping", "kept"],
    )  # fmt: skip
    parts = peak_parts("ddp", model_facts("ViT-B-32"), 2, StateRecipe("amp", ema=True), 8, True, "cpu")
    assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)


@pytest.mark.extended  # ~2 min of measured steps; in CI the HSDP rows' arithmetic (test_engines.py) and HSDP's
@pytest.mark.slow  # training against DDP on a 2x2 mesh (test_engine_multiprocess.py)
def test_the_predicted_peak_of_hsdp_is_within_10_percent_of_the_measured(tmp_path):
    """bench/plan_check.py --replicas 2: FSDP2 in 2 replica groups of 1 rank (each rank holds the whole state, through
    the 2-D mesh), bf16 weights and 8-bit AdamW, ViT-B-32; the plan's state over one rank."""
    (row,) = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "4", "--steps", "2", "--replicas", "2", "--engines", "fsdp",
         "--precisions", "pure_bf16", "--opts", "adamw8bit", "--stepping", "kept"],
    )  # fmt: skip
    facts = model_facts("ViT-B-32")
    recipe = StateRecipe("pure_bf16", "adamw8bit")
    parts = peak_parts("fsdp", facts, 2, recipe, 4, False, "cpu", state_ranks=1)
    assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)
    assert parts["state"] > 1.5 * peak_parts("fsdp", facts, 2, recipe, 4, False, "cpu")["state"]  # not sharded


@pytest.mark.extended  # ~4 min of measured steps; in CI the update's windows and the plan's arithmetic (test_ema.py)
@pytest.mark.slow
def test_the_predicted_peak_with_a_moving_average_of_bf16_weights_is_within_10_percent_of_the_measured(tmp_path):
    """bench/plan_check.py --ema (--ema-decay) with pure bf16 weights on DDP and FSDP2 (AdamW, checkpointed,
    ViT-B-32): the average's update made a float32 copy of every weight at once, beside the whole state."""
    rows = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "8", "--steps", "2", "--grad-checkpointing", "--ema", "--engines",
         "ddp", "fsdp", "--precisions", "pure_bf16", "--opts", "adamw", "--stepping", "kept"],
        timeout=1200,
    )  # fmt: skip
    facts = model_facts("ViT-B-32")
    for row in rows:
        parts = peak_parts(row["engine"], facts, 2, StateRecipe("pure_bf16", ema=True), 8, True, "cpu")
        assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)
    assert [row["engine"] for row in rows] == ["ddp", "fsdp"]


@pytest.mark.extended  # 4-7 min of measured steps; in CI the plan's lock arithmetic (above) against the engines'
@pytest.mark.slow  # own state of a locked model (test_engine_multiprocess.py)
def test_the_predicted_peak_of_a_locked_image_tower_is_within_10_percent_of_the_measured(tmp_path):
    """bench/plan_check.py --lock image (LiT) on DDP and FSDP2 (amp, AdamW, ViT-B-32): the plan without locks
    counted the image tower's gradients, optimizer state and activations."""
    from bigclip.memory import Locks

    rows = plan_check_rows(
        tmp_path,
        ["--model", "ViT-B-32", "--batch-size", "8", "--steps", "2", "--lock", "image", "--engines", "ddp", "fsdp",
         "--precisions", "amp", "--opts", "adamw", "--stepping", "kept"],
        timeout=1200,
    )  # fmt: skip
    facts = model_facts("ViT-B-32", None, Locks(image_unlocked_groups=0))
    for row in rows:
        parts = peak_parts(row["engine"], facts, 2, StateRecipe("amp"), 8, False, "cpu")
        assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)
    assert [row["engine"] for row in rows] == ["ddp", "fsdp"]


def test_traced_activations_of_bigclips_vit_agree_with_the_formula():
    """The trace (memory/traced.py) and Korthikanti's formula are two ways to the same ViT's activations: they
    agree within 5%, with and without checkpointing (the trace also counts the stem and head)."""
    from bigclip.memory.traced import trace_activations
    from bigclip.model import create_model

    model = create_model("ViT-B-16", device="meta")
    traced = trace_activations(model.visual, model.visual.image_size, model.visual.blocks)
    image = dataclasses.replace(model_facts("ViT-B-16"), towers=(model.visual.activation_shape(),))
    assert traced.kept_bytes(False, 2) == pytest.approx(activation_bytes(image, 1, False, 2), rel=0.05)
    ckpt = traced.kept_bytes(True, 2) + traced.largest_block_bytes(2)
    assert ckpt == pytest.approx(activation_bytes(image, 1, True, 2), rel=0.15)
    assert len(traced.blocks) == 12 and len(set(traced.blocks)) == 1  # identical blocks save the same
    # fp32 doubles what is saved in the tower's dtype
    assert 1.9 < traced.kept_bytes(False, 4) / traced.kept_bytes(False, 2) <= 2


def test_a_checkpointed_backward_peaks_where_a_block_is_recomputed_beside_what_was_kept_before_it():
    """The backward runs in reverse: block i is recomputed when only what the forward kept before it is alive
    (the inputs of blocks 0..i, the outside saved before block i began), or at its start, everything kept."""
    from bigclip.memory.traced import Saved, TracedActivations

    mib = float(1 << 20)
    # a ConvNeXt-like tower: large early blocks, a downsample before block 2, a head after the last block
    tower = TracedActivations(
        outside=Saved(fixed=7 * mib),
        blocks=(Saved(fixed=40 * mib), Saved(fixed=40 * mib), Saved(fixed=10 * mib)),
        inputs=(Saved(fixed=4 * mib), Saved(fixed=4 * mib), Saved(fixed=1 * mib)),
        outside_before=(Saved(fixed=2 * mib), Saved(), Saved(fixed=3 * mib), Saved(fixed=2 * mib)),
    )
    # block 1 recomputed: stem 2 + inputs 4 + 4 + its 40 (the downsample, block 2's input and the head are gone)
    assert tower.checkpointed_peak_bytes(2) == 50 * mib < tower.kept_bytes(True, 2) + tower.largest_block_bytes(2)
    # no order recorded (a trace from before it was kept): the conservative sum
    unordered = dataclasses.replace(tower, outside_before=())
    assert unordered.checkpointed_peak_bytes(2) == (7 + 9 + 40) * mib
    # a real trace records every outside byte at one position
    convnext = model_facts("convnext_base").traced[0]
    assert sum(b.bytes(2) for b in convnext.outside_before) == pytest.approx(convnext.outside.bytes(2))
    assert len(convnext.outside_before) == len(convnext.blocks) + 1


@pytest.mark.slow  # ~2-3 s: two giant towers built and traced; the fast tier's test_giant_dry_run traces EVA02-E-14
def test_timm_towers_are_planned_from_their_trace():
    """EVA02-E-14 (4.7B, timm's EVA) and convnext_base: every block traced on meta in seconds, a batch suggested."""
    for name, blocks in (("EVA02-E-14", 64), ("convnext_base", 3 + 3 + 27 + 3)):
        facts = model_facts(name)
        assert facts.uncounted is None and len(facts.traced) == 1 and len(facts.traced[0].blocks) == blocks
        full, kept = activation_bytes(facts, 1, False), activation_bytes(facts, 1, True)
        assert 0 < kept < full / 4, (name, kept, full)
        lean = StateRecipe("pure_bf16", "adamw8bit", True)
        assert max_batch(facts, "fsdp", 1, 80e9, True, lean) > max_batch(facts, "fsdp", 1, 80e9, False, lean) > 0


# Tiny timm towers (the smallest of each family timm has) with a byte-level text tower, as OpenCLIP local-dir: models
TINY_TIMM = {
    "eva": {"timm_model_name": "eva02_tiny_patch14_224", "timm_pool": "token", "timm_proj": None},
    "convnext": {"timm_model_name": "convnext_atto", "timm_pool": "", "timm_proj": "linear"},
}


def tiny_timm_model(folder, family: str) -> str:
    text = {"context_length": 16, "vocab_size": 259, "width": 64, "heads": 4, "layers": 2}
    vision = {**TINY_TIMM[family], "image_size": 224}
    folder.mkdir(parents=True, exist_ok=True)
    model_cfg = {"embed_dim": 64, "tokenizer": "byte", "vision_cfg": vision, "text_cfg": text}
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}))
    return f"local-dir:{folder}"


# 4-9 min each of measured steps on 2 busy cores; in CI the trace against a real forward's live storages (below)
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "grad-checkpointing"])
@pytest.mark.parametrize("family", sorted(TINY_TIMM))
def test_traced_activations_of_tiny_timm_towers_against_the_measured_peak(tmp_path, family, checkpointing):
    """bench/plan_check.py on a tiny EVA and a tiny ConvNeXt, batch 16 (activations most of the peak): the
    predicted peak, its image tower's activations traced on meta, within 10% of the rank's measured memory."""
    model = tiny_timm_model(tmp_path / family, family)
    (row,) = plan_check_rows(
        tmp_path,
        ["--model", model, "--batch-size", "16", "--steps", "2", "--engines", "fsdp", "--precisions", "pure_bf16",
         "--opts", "adamw8bit", "--stepping", "in-backward"] + (["--grad-checkpointing"] if checkpointing else []),
    )  # fmt: skip
    facts = model_facts(model)
    parts = peak_parts("fsdp", facts, 2, StateRecipe("pure_bf16", "adamw8bit", True), 16, checkpointing, "cpu")
    assert parts["activations"] > 0.5 * parts["peak"]  # the activations are what is checked
    assert row["measured"] == pytest.approx(parts["peak"] + row["runtime"], rel=0.10), (row, parts)


def _kept_by_a_real_forward(tower, checkpointing: bool, batch: int = 4) -> float:
    """Bytes per sample a real bf16 CPU forward leaves alive for its backward: every storage an operation of the
    forward created that is still referenced once it returned (weights, buffers, the images and the output left
    out). Found by watching allocations, not autograd's saved tensors: a reference the trace does not rely on."""
    import gc

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    created: dict[int, tuple[StorageWeakRef, int]] = {}

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ref = StorageWeakRef(t.untyped_storage())
                    created.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
            return out

    tower.to(torch.bfloat16).train()
    tower.set_grad_checkpointing(1 if checkpointing else 0)
    images = torch.randn(batch, 3, *tower.image_size, dtype=torch.bfloat16)
    with torch.enable_grad(), Allocations():
        out = tower(images)
    gc.collect()
    state = {StorageWeakRef(t.untyped_storage()).cdata for t in [*tower.parameters(), *tower.buffers(), images, out]}
    return sum(n for key, (ref, n) in created.items() if not ref.expired() and key not in state) / batch


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY_TIMM))
def test_the_trace_counts_what_a_real_forward_keeps_with_and_without_checkpointing(tmp_path, family):
    """The meta trace (memory/traced.py) against a real CPU forward's live storages: without checkpointing all
    that autograd saves, with it (timm's own checkpoint per block) only the outside and the blocks' inputs."""
    from bigclip.memory.traced import trace_activations
    from bigclip.model import create_model

    model = tiny_timm_model(tmp_path / family, family)
    meta = create_model(model, device="meta").visual
    traced = trace_activations(meta, meta.image_size, meta.blocks)
    for checkpointing in (False, True):
        kept = _kept_by_a_real_forward(create_model(model).visual, checkpointing)
        assert kept == pytest.approx(traced.kept_bytes(checkpointing, 2), rel=0.02), (family, checkpointing)
    assert traced.kept_bytes(True, 2) < traced.kept_bytes(False, 2) / 4
