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

from bigclip.memory import StateRecipe, activation_bytes, model_facts, peak_parts, state_bytes


def test_the_peak_is_the_backward_or_the_step_whichever_is_larger():
    facts = model_facts("ViT-L-14")
    psi, batch = facts.params, 32
    fp32, amp = StateRecipe("fp32"), StateRecipe("amp")
    # DDP keeps its gradient buckets between steps: the backward starts with the whole state beside the activations
    ddp = peak_parts("ddp", facts, 8, fp32, batch, False, "cpu")
    assert ddp["backward"] == (
        state_bytes("ddp", psi, 8, fp32, facts) + activation_bytes(facts, batch, False, 4) + ddp["loss"]
    )
    # fp32 activations are twice the 16-bit ones; amp keeps a bf16 copy of every weight through the backward
    assert activation_bytes(facts, batch, False, 4) == 2 * activation_bytes(facts, batch, False, 2)
    amp_ddp = peak_parts("ddp", facts, 8, amp, batch, False, "cpu")
    assert amp_ddp["backward"] == (
        state_bytes("ddp", psi, 8, amp, facts) + amp_ddp["activations"] + 2 * psi + amp_ddp["loss"]
    )
    # FSDP2 frees the gradients after each step: its backward starts with one block's gradient shards
    fsdp = peak_parts("fsdp", facts, 8, fp32, batch, False, "cpu")
    one_block = state_bytes("fsdp", psi, 8, dataclasses.replace(fp32, in_backward=True), facts)
    assert fsdp["backward"] == one_block + fsdp["activations"] + fsdp["loss"]
    # torch's AdamW on CUDA (multi-tensor) builds a float32 temporary per parameter in the step: with few
    # activations (checkpointing) the step is the peak; on CPU (tensor by tensor) two of the largest tensor
    cuda = peak_parts("fsdp", facts, 1, amp, 1, True, "cuda")
    assert cuda["step"] == state_bytes("fsdp", psi, 1, amp, facts) + 4 * psi and cuda["peak"] == cuda["step"]
    cpu = peak_parts("fsdp", facts, 1, amp, 1, True, "cpu")
    assert cpu["step"] == state_bytes("fsdp", psi, 1, amp, facts) + 2 * 4 * facts.largest_tensor
    # torchao's fused 8-bit update allocates only the stochastic rounding's random integers (4 bytes per value of one
    # tensor); stepped in the backward there is no step of its own: the token embedding is updated at the end of
    # the text tower, its unsharded gradient and its shard in flight, the image tower's activations alive
    lean_recipe = StateRecipe("pure_bf16", "adamw8bit", True)
    lean = peak_parts("fsdp", facts, 1, lean_recipe, 1, True, "cuda")
    assert lean["working"] == 4 * facts.largest_tensor and lean["step"] == 0
    assert lean["peak"] == max(lean["backward"], lean["text_end"])
    image_tower = dataclasses.replace(facts, towers=facts.towers[:1])
    assert (
        lean["text_end"]
        == state_bytes("fsdp", psi, 1, lean_recipe, facts)
        + activation_bytes(image_tower, 1, True, 2)
        + (2 * 2 + 4) * facts.largest_tensor
    )
    # DeepSpeed cannot run 8-bit moments: no prediction rather than a wrong one
    assert peak_parts("zero3", facts, 8, StateRecipe("amp", "adamw8bit"), batch, False) is None


@pytest.mark.extended  # 2-5 min of measured steps; in CI the planner's peak rule on its own (above)
@pytest.mark.slow
def test_the_predicted_peak_of_the_leanest_setup_is_within_10_percent_of_the_measured(tmp_path):
    """bench/plan_check.py on one setup: 2 FSDP2 ranks, bf16 weights, 8-bit AdamW stepped in the backward, ViT-B-32;
    the rank's resident memory above its baseline against the plan's peak plus the runtime measured on test-tiny."""
    rows_file = tmp_path / "rows.json"
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "plan_check.py"), "--model", "ViT-B-32", "--batch-size", "4",
         "--steps", "2", "--engines", "fsdp", "--precisions", "pure_bf16", "--opts", "adamw8bit", "--stepping",
         "in-backward", "--json", str(rows_file)],
        capture_output=True, text=True, timeout=900, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads(rows_file.read_text())["rows"]
    facts = model_facts("ViT-B-32")
    parts = peak_parts("fsdp", facts, 2, StateRecipe("pure_bf16", "adamw8bit", True), 4, False, "cpu")
    predicted = parts["peak"] + row["runtime"]
    assert row["measured"] == pytest.approx(predicted, rel=0.10), (row, parts)
    assert row["runtime"] < 0.3 * row["measured"]  # the model, not the runtime, is what was measured
