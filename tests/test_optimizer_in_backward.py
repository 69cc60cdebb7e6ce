"""--optimizer-in-backward: each parameter stepped from the backward, its gradient freed at once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import REPO, TINY_SYNTHETIC, step_losses, subprocess_env
from test_engine_multiprocess import run_worker

from bigclip import cli
from bigclip.memory import StateRecipe
from bigclip.model import create_model


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--accum-freq", "2"], "cannot accumulate micro-batches (--accum-freq 2)"),
        (["--grad-clip-norm", "1.0"], "--grad-clip-norm needs the global gradient norm before any parameter"),
        (["--ds_config", "ds_configs/zero2.json"], "DeepSpeed steps its flattened partitions after the whole"),
        (["--opt", "timm/lamb"], "--opt timm/lamb is not known to update a tensor from its own gradient alone"),
    ],
    ids=["accum", "clip", "deepspeed", "timm"],
)
def test_what_cannot_be_exact_is_refused_in_one_line_and_nothing_is_written(flags, says, tmp_path, capfd):
    logs = tmp_path / "logs"
    code = cli.main([*TINY_SYNTHETIC, "--logs", str(logs), "--optimizer-in-backward", *flags])
    err = capfd.readouterr().err.strip()
    assert code == 2 and err.startswith("bigclip: error: --optimizer-in-backward: ") and "\n" not in err, err
    assert says in err
    assert not logs.exists()


@pytest.mark.slow
def test_steps_match_the_ordinary_step_and_at_most_one_block_of_gradients_is_alive(tmp_path):
    tiny = {"model": "test-tiny", "batch_size": 8}
    in_backward = {"optimizer_in_backward": True}
    bf16_8bit = {"precision": "pure_bf16", "opt": "adamw8bit", "engine": "fsdp"}
    runs = run_worker(tmp_path, [
        {"name": "ddp", "steps": 10, "live_grads": True, "config": tiny},
        {"name": "ddp_in_backward", "steps": 10, "live_grads": True, "config": {**tiny, **in_backward}},
        {"name": "fsdp", "steps": 10, "live_grads": True, "config": {**tiny, "engine": "fsdp"}},
        {"name": "fsdp_in_backward", "steps": 10, "live_grads": True,
         "config": {**tiny, **in_backward, "engine": "fsdp"}},
        {"name": "fsdp_bf16_8bit", "steps": 6, "config": {**tiny, **bf16_8bit}},
        {"name": "fsdp_bf16_8bit_in_backward", "steps": 6, "config": {**tiny, **bf16_8bit, **in_backward}},
        {"name": "ddp_bf16_8bit_in_backward", "steps": 3, "live_grads": True,
         "config": {**tiny, **bf16_8bit, **in_backward, "engine": "ddp"}},
        {"name": "ddp_stableadamw_amp", "steps": 6, "config": {**tiny, "opt": "stableadamw", "precision": "amp_bf16"}},
        {"name": "ddp_stableadamw_amp_in_backward", "steps": 6,
         "config": {**tiny, "opt": "stableadamw", "precision": "amp_bf16", **in_backward}},
    ])  # fmt: skip

    for ordinary in ("ddp", "fsdp", "fsdp_bf16_8bit", "ddp_stableadamw_amp"):
        stepped = runs[f"{ordinary}_in_backward"]
        # The same arithmetic on each tensor (float32 here: 1e-6 relative over the steps; measured: equal), also
        # with bf16 weights, 8-bit moments and stochastic rounding (each parameter seeds its rounding alike).
        assert stepped["losses"] == pytest.approx(runs[ordinary]["losses"], rel=1e-6), ordinary
        # The norm is summed in float32 here; the ordinary step's norm of bf16 gradients is a bf16 number.
        norm_rel = 1e-2 if "bf16" in ordinary else 1e-5
        assert stepped["norms"] == pytest.approx(runs[ordinary]["norms"], rel=norm_rel), ordinary
        assert stepped["state_bytes"]["optimizer"] == runs[ordinary]["state_bytes"]["optimizer"], ordinary
    assert runs["ddp"]["losses"][-1] < runs["ddp"]["losses"][0]

    # The planner's bytes per parameter (StateRecipe), against the tensors counted one by one (DDP: whole tensors)
    numels = [p.numel() for p in create_model("test-tiny").parameters()]
    psi, counters = sum(numels), 4 * len(numels)  # each parameter's step count, a float32 scalar
    for name, recipe in (("ddp", StateRecipe("fp32")), ("ddp_bf16_8bit_in_backward", StateRecipe("pure_bf16",
                         "adamw8bit", True))):  # fmt: skip
        run = runs[name]
        assert run["state_bytes"]["params"] == recipe.weight_bytes * psi, name
        assert run["grad_bytes"] == psi * (recipe.weight_bytes)  # what the backward produces, kept or not
        kept = run["live_grad_peak_bytes"] if recipe.grad_bytes else 0
        assert kept == recipe.grad_bytes * psi or recipe.in_backward, name
        # 8-bit moments: the plan counts 2 x (1 byte + a float32 scale per 256 values); tensors under 4096 values
        # (or not whole blocks) keep their moments in the weights' dtype and each quantized moment has a
        # 256-entry float32 code map, which the plan leaves out (under 0.1% of a ViT-B-32's state)
        small = sum(n for n in numels if n < 4096 or n % 256)
        quantized = sum(1 for n in numels if n >= 4096 and n % 256 == 0)
        slack = 0.0
        if recipe.opt == "adamw8bit":
            slack = (2 * recipe.weight_bytes - recipe.optimizer_bytes) * small + 2 * 256 * 4 * quantized
        expected = recipe.optimizer_bytes * psi + slack
        # plus each parameter's step count, a float32 scalar (not a storage of its own in every run)
        assert expected <= run["state_bytes"]["optimizer"] <= expected + counters, name

    # DDP's gradients are views of its all-reduce buckets (gradient_as_bucket_view): the reducer keeps no second
    # copy; test-tiny's gradients fit one 25 MB bucket
    assert runs["ddp"]["grad_storages"] == 1 < runs["ddp"]["params_with_grad"]
    for engine in ("ddp", "fsdp"):
        ordinary, stepped = runs[engine], runs[f"{engine}_in_backward"]
        # The ordinary step holds every gradient (this rank's shards under FSDP2) when the backward returns ...
        assert ordinary["live_grad_peak_bytes"] == ordinary["grad_bytes"]
        # ... the in-backward step at most the largest block's, counted from hooks on every parameter
        assert 0 < stepped["live_grad_peak_bytes"] <= stepped["largest_block_bytes"], engine
        assert stepped["largest_block_bytes"] < ordinary["grad_bytes"] / 4


@pytest.mark.slow
def test_a_run_resumes_exactly_with_or_without_the_flag_from_a_checkpoint_written_either_way(tmp_path):
    common = [*TINY_SYNTHETIC, "--epochs", "3", "--batch-size", "16", "--logs", str(tmp_path)]

    def run(name: str, *flags: str) -> dict[int, float]:
        assert cli.main([*common, "--name", name, *flags]) == 0
        return step_losses(os.path.join(tmp_path, name))

    stepped = run("stepped", "--optimizer-in-backward", "--save-frequency", "1")
    ordinary = run("ordinary", "--save-frequency", "1")
    assert stepped == ordinary  # one process, float32: bit for bit
    later = {s: loss for s, loss in ordinary.items() if s > 4}  # epoch 1 was steps 1-4
    for name, checkpoint, flags in [
        ("stepped_again", "stepped", ["--optimizer-in-backward"]),
        ("ordinary_from_stepped", "stepped", []),
        ("stepped_from_ordinary", "ordinary", ["--optimizer-in-backward"]),
    ]:
        resume = os.path.join(tmp_path, checkpoint, "checkpoints", "epoch_1")
        assert run(name, "--resume", resume, *flags) == later, name


@pytest.mark.extended  # the benchmark's every setup (2-4 min); in CI the in-backward step itself (above)
@pytest.mark.slow
def test_the_giant_on_small_benchmark_reports_its_rows(tmp_path):
    """bench/giant_on_small.py at toy size (its bigG run takes most of an hour): its JSON rows carry every figure."""
    rows_file = tmp_path / "rows.json"
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "giant_on_small.py"), "--models", "test-tiny", "--setups",
         "bf16_adamw8bit", "bf16_adamw8bit_in_backward", "--steps", "2", "--json", str(rows_file)],
        capture_output=True, text=True, timeout=900, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert [r["setup"] for r in rows] == ["bf16_adamw8bit", "bf16_adamw8bit_in_backward"]
    for row in rows:
        assert row.keys() >= {"model", "setup", "steps", "losses", "state_bytes_per_param", "peak_gb_per_rank",
                              "peak_gb_machine", "s_per_step"}  # fmt: skip
        assert row["steps"] == 2 and all(math.isfinite(x) for x in row["losses"]) and row["weights_changed"]
        assert 0 < row["peak_gb_per_rank"] and row["s_per_step"] > 0
    # gradients are not kept after the backward: 2 bytes per parameter less (bf16; measured 2.01)
    lean, leaner = (r["state_bytes_per_param"] for r in rows)
    assert lean - leaner == pytest.approx(2.0, rel=0.02), (lean, leaner)


def test_a_saves_optimizer_state_takes_one_pass_over_the_model_and_is_what_the_optimizers_give(monkeypatch):
    """DCP's get_state_dict walks every parameter of the model once per optimizer it is handed; the per-parameter
    optimizers are one optimizer to it (one walk, not one per parameter: O(P), where it was O(P^2) in the loop's
    thread at every save), and the state it returns is what the optimizers handed one by one give."""
    import torch
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    from bigclip.ckpt.dcp_layout import training_state
    from bigclip.config import resolve
    from bigclip.dist import World
    from bigclip.engine import build_engine

    torch.manual_seed(0)
    cfg = resolve({"model": "test-tiny", "dataset_type": "synthetic", "precision": "fp32", "batch_size": 8,
                   "optimizer_in_backward": True})  # fmt: skip
    engine = build_engine(cfg.sections.engine, create_model("test-tiny"), World())
    for p in engine.model.parameters():  # one update of every parameter, so each optimizer has its state
        p.grad = torch.randn_like(p)
        engine.optimizer.by_param[p].step()
        p.grad = None
    count = len(list(engine.model.parameters()))
    calls = []
    walk = dcp_state_dict._get_fqns
    monkeypatch.setattr(dcp_state_dict, "_get_fqns", lambda *a, **k: (calls.append(1), walk(*a, **k))[1])
    state = training_state(engine.model, engine.optimizer, None)["optimizer"]
    assert 0 < len(calls) <= 4 * count, (len(calls), count)  # a few walks (model, optimizer); one by one: count^2
    _, one_by_one = dcp_state_dict.get_state_dict(engine.model, tuple(engine.optimizer))
    grouped = engine.optimizer.saved_state_dict(one_by_one)
    assert state["param_groups"] == grouped["param_groups"] and state["state"].keys() == grouped["state"].keys()
    for name, values in grouped["state"].items():
        assert values.keys() == state["state"][name].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(state["state"][name][k])) for k, v in values.items())
