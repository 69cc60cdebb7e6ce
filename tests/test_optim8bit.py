"""--opt adamw8bit (bigclip/optim/adamw8bit.py, torchao's AdamW8bit): exact checkpoint round trip of its quantized
state, its state bytes, agreement across one process, DDP and FSDP2 and with fp32 AdamW, resume and reshard, export,
and the DeepSpeed refusal."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import TINY_SYNTHETIC, python_train, step_losses, torchrun
from safetensors.torch import load_file
from test_engine_multiprocess import run_worker
from torchao.optim.subclass_8bit import OptimState8bit

from bigclip import cli
from bigclip.config import resolve
from bigclip.errors import UserError
from bigclip.model import create_model
from bigclip.optim.adamw8bit import quantize_exactly_


def _saved_state(signed: bool) -> tuple[OptimState8bit, torch.Tensor]:
    """A quantized moment as a step leaves it, and the float32 values a checkpoint holds for it."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 3
    values[:2] = 0  # whole blocks of zeros (parameters without gradients yet)
    if not signed:
        values = values.square()
    state = OptimState8bit.zeros(values.shape, signed, 256, "cpu")
    state.copy_(values)  # what the optimizer's step does
    return state, state.dequantize()


@pytest.mark.parametrize("signed", [True, False], ids=["first_moment", "second_moment"])
def test_a_saved_quantized_state_loads_back_to_the_same_codes_and_scales(signed):
    state, saved = _saved_state(signed)
    loaded = OptimState8bit.zeros(saved.shape, signed, 256, "cpu")
    quantize_exactly_(loaded, saved)
    assert torch.equal(loaded.codes, state.codes) and torch.equal(loaded.scale, state.scale)
    if signed:
        # Why the exact path exists: the signed map's most negative code is -0.99297, so plain requantization
        # (torchao's copy_) shrinks the scale of every block whose largest magnitude is negative.
        plain = OptimState8bit.zeros(saved.shape, signed, 256, "cpu")
        plain.copy_(saved)
        assert not torch.equal(plain.scale, state.scale)


def test_values_that_no_scale_reproduces_are_quantized_as_a_step_would():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(32, 256, generator=g)  # not dequantized from anything (an AdamW checkpoint's moments)
    ours, torchaos = (OptimState8bit.zeros(values.shape, True, 256, "cpu") for _ in range(2))
    quantize_exactly_(ours, values)
    torchaos.copy_(values)
    assert torch.equal(ours.codes, torchaos.codes) and torch.equal(ours.scale, torchaos.scale)


def test_deepspeed_refuses_it_in_one_line():
    with pytest.raises(UserError, match=r"^--opt adamw8bit: DeepSpeed cannot .* use --engine fsdp"):
        resolve({"opt": "adamw8bit", "engine": "deepspeed"})
    assert resolve({"opt": "adamw8bit"}).opt == "adamw8bit"


# Tolerances (test-tiny, fp32, 20 steps, lr 1e-3). Runs that see the same global batch differ only in the order
# of float32 sums (DDP's all-reduce, FSDP2's reduce-scatter, accumulation), about 1e-7 relative; with 8-bit
# moments such a difference can move a value across a code boundary, which changes that one moment entry by one
# code step (at most 1.4% of its block's scale) from then on. Measured over 20 steps: at most REL_SAME_BATCH/10.
# Against fp32 AdamW the moments themselves differ by up to half a code step everywhere: measured < 1e-3.
REL_SAME_BATCH, REL_VS_FP32 = 1e-4, 5e-3


def eight_bit_state_bytes(numels: list[int]) -> int:
    return sum(2 * (n + 4 * n // 256 + 4 * 256) if n >= 4096 and n % 256 == 0 else 8 * n for n in numels)


@pytest.mark.slow
def test_one_process_ddp_and_fsdp2_take_the_same_steps_and_the_state_is_2_bytes_per_parameter(tmp_path):
    tiny = {"model": "test-tiny", "batch_size": 8, "opt": "adamw8bit", "grad_clip_norm": 1.0}
    accum = {"accum_freq": 2, "batch_size": 4}  # other batches than without: compared with each other
    two_ranks = run_worker(tmp_path, [
        {"name": "ddp_adamw", "steps": 20, "config": {**tiny, "opt": "adamw"}},
        {"name": "ddp", "steps": 20, "config": tiny},
        {"name": "fsdp", "steps": 20, "config": {**tiny, "engine": "fsdp"}},
        {"name": "ddp_accum", "steps": 10, "config": {**tiny, **accum}},
        {"name": "fsdp_accum_ckpt", "steps": 10,
         "config": {**tiny, **accum, "engine": "fsdp", "grad_checkpointing": True}},
        {"name": "ddp_pure_bf16", "steps": 10, "seed_per_rank": True, "config": {**tiny, "precision": "pure_bf16"}},
        {"name": "fsdp_pure_bf16", "steps": 10, "config": {**tiny, "precision": "pure_bf16", "engine": "fsdp"}},
    ], name="two")  # fmt: skip
    one = run_worker(tmp_path, [
        {"name": "single", "steps": 20, "ranks_emulated": 2, "config": {**tiny, "batch_size": 16}},
    ], name="one", nproc=1)["single"]  # fmt: skip

    ddp = two_ranks["ddp"]
    pairs = [("single", one, ddp), ("fsdp", two_ranks["fsdp"], ddp),
             ("fsdp_accum_ckpt", two_ranks["fsdp_accum_ckpt"], two_ranks["ddp_accum"])]  # fmt: skip
    for name, run, reference in pairs:
        for step, (loss, expected) in enumerate(zip(run["losses"], reference["losses"], strict=True)):
            assert loss == pytest.approx(expected, rel=REL_SAME_BATCH), (name, step)
    # bf16 weights with stochastic rounding: the replicas, whose own random streams differ, draw the same random
    # bits for the rounding and stay equal
    pure_bf16 = two_ranks["ddp_pure_bf16"]
    assert pure_bf16["param_dtypes"] == ["torch.bfloat16"]
    assert pure_bf16["weight_sums_per_rank"][0] == pure_bf16["weight_sums_per_rank"][1]
    assert pure_bf16["losses"][-1] < pure_bf16["losses"][0]
    sharded = two_ranks["fsdp_pure_bf16"]  # its shards round with their own random bits: bf16 noise apart
    assert sharded["losses"] == pytest.approx(pure_bf16["losses"], rel=3e-2)
    fp32 = two_ranks["ddp_adamw"]["losses"]
    assert ddp["losses"] == pytest.approx(fp32, rel=REL_VS_FP32)
    assert ddp["losses"] != fp32  # the moments really were 8-bit
    assert ddp["losses"][-1] < ddp["losses"][0]

    # State bytes, counted tensor by tensor after the steps (engine.state_bytes) against the arithmetic: fp32
    # AdamW keeps 8 bytes per parameter; the 8-bit moments 1 byte per value each, plus per moment a float32
    # scale per block of 256 values and the 256-entry float32 code map, except tensors under 4096 values (or
    # not a whole number of blocks), whose moments stay float32 (as bitsandbytes).
    shapes = [p.shape for p in create_model("test-tiny").parameters()]
    numels = [math.prod(shape) for shape in shapes]
    params = sum(numels)
    expected = eight_bit_state_bytes(numels)
    adamw_state = two_ranks["ddp_adamw"]["state_bytes"]["optimizer"]
    state = ddp["state_bytes"]["optimizer"]
    step_counters = 4 * len(numels)  # each parameter's step count, a float32 scalar, in both optimizers
    assert adamw_state == 8 * params + step_counters
    assert state == expected + step_counters, (state, expected)
    assert state < 0.4 * adamw_state  # test-tiny has many small tensors; ViT-B-32's is 0.255x, bigG's 0.254x
    # FSDP2: each rank quantizes its own shard (rank 0's: the first ceil(rows / 2) rows of every tensor)
    rank0 = [math.prod(shape[1:]) * -(-shape[0] // 2) if shape else 1 for shape in shapes]
    assert two_ranks["fsdp"]["state_bytes"]["optimizer"] == eight_bit_state_bytes(rank0) + step_counters


@pytest.mark.slow
def test_resume_continues_exactly_reshards_to_two_ranks_and_exports(tmp_path):
    """Under --precision pure_bf16, so the 8-bit moments of bf16 weights and the stochastic rounding resume too."""
    common = [*TINY_SYNTHETIC, "--opt", "adamw8bit", "--precision", "pure_bf16", "--epochs", "3", "--batch-size", "16",
              "--logs", str(tmp_path)]  # fmt: skip
    full = python_train([*common, "--name", "full", "--save-frequency", "1"], timeout=900)
    assert full.returncode == 0, full.stderr[-3000:]
    checkpoint = os.path.join(tmp_path, "full", "checkpoints", "epoch_1")
    resumed = python_train([*common, "--name", "resumed", "--resume", checkpoint], timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = step_losses(os.path.join(tmp_path, "full"))
    got = step_losses(os.path.join(tmp_path, "resumed"))
    assert sorted(got) == [s for s in sorted(expected) if s > 4] and got  # epoch 1 was steps 1-4
    assert {s: expected[s] for s in got} == got  # bit for bit: the 8-bit state came back as it was saved

    # Another world size: FSDP2 on 2 ranks (batch 8 each: the same global batch) loads the one-process state.
    resharded = torchrun(2, [*common, "--name", "fsdp", "--engine", "fsdp", "--batch-size", "8", "--gather-with-grad",
                             "--resume", checkpoint], timeout=900)  # fmt: skip
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    # Its shards round with other random bits than the one process did: bf16 noise, not a lost state.
    for step, loss in step_losses(os.path.join(tmp_path, "fsdp")).items():
        assert loss == pytest.approx(expected[step], rel=3e-2), step

    out = tmp_path / "exported.safetensors"
    assert cli.main(["export", checkpoint, str(out)]) == 0
    weights = load_file(out)
    assert weights and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert not any("exp_avg" in k for k in weights)


def test_a_save_makes_the_float32_moments_one_tensor_at_a_time_as_it_copies_them():
    """A checkpoint holds the 8-bit moments dequantized to float32. Taken with the state dict, in the loop's thread,
    they were all made at once on the device (8 bytes per parameter, twice the leanest setup's whole state); now the
    save's stager makes each as it copies it to host memory (bigclip/staged_values.py). The loop's thread allocates
    no float32 moment while the save starts; what is staged equals the moments dequantized at once, bit for bit;
    the host buffers are the same from one save to the next; the process writer's are in shared memory."""
    from test_ema import AllocatedBytes

    from bigclip.ckpt.dcp_layout import DCPLayout, training_state
    from bigclip.dist import World
    from bigclip.engine import build_engine
    from bigclip.optim.adamw8bit import is_quantized

    torch.manual_seed(0)
    cfg = resolve({"model": "test-tiny", "dataset_type": "synthetic", "precision": "fp32", "batch_size": 8,
                   "opt": "adamw8bit"})  # fmt: skip
    engine = build_engine(cfg.sections.engine, create_model("test-tiny"), World())
    for _ in range(2):
        for p in engine.model.parameters():
            p.grad = torch.randn_like(p)
        engine.optimizer.step()
    quantized = [s[k] for s in engine.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if is_quantized(s[k])]
    float32_moment_bytes = sum(4 * m.numel() for m in quantized)
    assert len(quantized) > 10 and float32_moment_bytes > 2**20

    immediate = training_state(engine.model, engine.optimizer, None)["optimizer"]["state"]  # no save: made at once
    layout = DCPLayout(engine.model, engine.optimizer, None, World(), None)
    staged_each_save = []
    for _ in range(2):
        with AllocatedBytes() as loop_thread:  # a dispatch mode sees the thread it is entered in: the loop's
            staging = layout.stage("unused")
        # before: every float32 moment at once (1.6 MB here; 20 GB for ViT-bigG-14); now none (0 measured)
        assert loop_thread.peak < max(4 * m.numel() for m in quantized), (loop_thread.peak, float32_moment_bytes)
        staged_each_save.append(staging.result()["optimizer"]["state"])
    for name, values in immediate.items():
        for key, value in values.items():
            for staged in staged_each_save:
                assert torch.equal(staged[name][key], value), (name, key)
    first, second = staged_each_save
    made = {(name, key) for name, p in engine.model.named_parameters() for key in ("exp_avg", "exp_avg_sq")
            if is_quantized(engine.optimizer.state[p][key])}  # fmt: skip
    assert len(made) == len(quantized)
    for name, key in made:  # the pool's host buffers, the same at every save (DCP's own: per torch release)
        assert first[name][key].data_ptr() == second[name][key].data_ptr(), (name, key)
    layout.close()

    from bigclip.staged_values import HostPool

    shared = HostPool(shared=True).buffer(quantized[0], torch.zeros(3, 4))
    assert shared.is_shared() and shared.shape == (3, 4)
