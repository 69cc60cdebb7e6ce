"""The packed AdamW update (bigclip/optim/packed_update.py) and its counter-based rounding bits (philox.py,
bf16_rounding.py): torchao's per-tensor arithmetic bit for bit, the rounding bits of the tensor-by-tensor
rounding whatever the packing, one compiled graph per kind of moments, and Philox's published answers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit

from bigclip.optim import bf16_rounding
from bigclip.optim.adamw8bit import AdamW8bit, AdamWStochasticBF16
from bigclip.optim.philox import philox4x32

# Random123's known-answer vectors for Philox4x32-10: (counter words, key words) -> output words
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip

# Shapes that exercise every path: quantized tensors (>= 4096 values in whole 256-blocks) large enough to be split
# across in-place windows, small ones packed together, float-moment tensors (under 4096 values or not whole
# blocks) padded in their windows.
SHAPES = [(64, 128), (100,), (3, 5), (256, 48), (40, 256), (7,), (300, 64), (20,), (33, 129)]


def test_philox_gives_the_published_answers():
    for counter, key, expected in KNOWN_ANSWERS:
        words = philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in counter), *key)
        assert [int(w) for w in words] == list(expected)


TRITON_PHILOX = textwrap.dedent("""
    import torch, triton, triton.language as tl
    from bigclip.optim.philox import philox4x32

    @triton.jit
    def draw(out, c1, c2, c3, seed, n: tl.constexpr):
        c0 = tl.arange(0, n).to(tl.uint32) * 2654435761
        a, b, c, d = tl.philox(seed, c0, tl.full([n], c1, tl.uint32), tl.full([n], c2, tl.uint32),
                               tl.full([n], c3, tl.uint32))
        offsets = tl.arange(0, n) * 4
        tl.store(out + offsets, a.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + offsets + 1, b.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + offsets + 2, c.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out + offsets + 3, d.to(tl.int64) & 0xFFFFFFFF)

    n, seed, (c1, c2, c3) = 64, 0x5EEDB16_00000007, (12345, 3, 0)
    out = torch.empty(n * 4, dtype=torch.int64)
    draw[(1,)](out, c1, c2, c3, seed, n)
    c0 = (torch.arange(n, dtype=torch.int64) * 2654435761) & 0xFFFFFFFF
    full = lambda v: torch.full_like(c0, v)
    ours = torch.stack(philox4x32(c0, full(c1), full(c2), full(c3), seed & 0xFFFFFFFF, seed >> 32), dim=-1)
    assert torch.equal(ours.reshape(-1), out), (ours.reshape(-1)[:8], out[:8])
    print("same words")
""")


@pytest.mark.slow  # a fresh process: TRITON_INTERPRET must be set before triton is imported
def test_philox_draws_the_words_of_tritons_philox():
    """A Triton kernel can draw the rounding bits this torch-op path draws (tl.philox, the generator of
    tl.randint): same counters, same key, same words."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_PHILOX], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "same words" in proc.stdout, proc.stderr[-3000:]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:5], "weight_decay": 0.1}, {"params": params[5:], "weight_decay": 0.0}]


def _set_grads(step: int, *param_lists: list[torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, shape in enumerate(SHAPES):
        grad = torch.randn(shape, generator=g)
        for params in param_lists:
            # one tensor sits out step 1 (no gradient): its weights and moments must not move
            params[i].grad = None if (step == 1 and i == 3) else grad.to(params[i].dtype)


def _moments(state: dict) -> list[torch.Tensor]:
    if not state:
        return []
    if isinstance(state["exp_avg"], OptimState8bit):
        return [state[k].codes for k in ("exp_avg", "exp_avg_sq")] + [state[k].scale for k in ("exp_avg", "exp_avg_sq")]
    return [state["exp_avg"], state["exp_avg_sq"]]


HYPERPARAMETERS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6}


@pytest.mark.slow  # compiles torchao's update for every shape (~1 min cold) beside ours
def test_8bit_steps_equal_torchaos_per_tensor_steps_bit_for_bit():
    theirs, ours = _params(torch.float32), _params(torch.float32)
    reference = TorchaoAdamW8bit(_groups(theirs), **HYPERPARAMETERS)
    packed = AdamW8bit(_groups(ours), **HYPERPARAMETERS)
    packed.window_blocks = 40  # small windows: (256, 48) and (300, 64) are split, the small tensors packed
    for step in range(4):
        _set_grads(step, theirs, ours)
        reference.step()
        packed.step()
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert torch.equal(a, b), (step, SHAPES[i])
            for x, y in zip(_moments(reference.state.get(a, {})), _moments(packed.state.get(b, {})), strict=True):
                assert torch.equal(x, y), (step, SHAPES[i])
    kinds = {(w.in_place, len(w.pieces) > 1) for w in packed._windows}
    assert kinds == {(True, False), (False, True)}  # both in-place slices and packed runs were exercised


def _moment(p: torch.Tensor, signed: bool, quantized: bool) -> torch.Tensor:
    """A fresh moment as the optimizers make it: 8-bit (float32-looking) for >= 4096 values in whole blocks."""
    if quantized and p.numel() >= 4096 and p.numel() % 256 == 0:
        return OptimState8bit.zeros(p.shape, signed, 256, "cpu", dtype=torch.float32)
    return torch.zeros_like(p)


def _reference_bf16_step(params, states, step, first_index=0, quantized=True):
    """One step tensor by tensor, eagerly: torchao's single_param_adam without its rounding, then the
    tensor-by-tensor counter-based rounding (bf16_rounding.round_into_bf16_)."""
    index = first_index
    for group in _groups(params):
        for p in group["params"]:
            if p.grad is not None:
                state = states.setdefault(p, {})
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=_moment(p, True, quantized),
                                 exp_avg_sq=_moment(p, False, quantized))  # fmt: skip
                state["step"] += 1
                target = p.detach().float()
                lr = torch.tensor(HYPERPARAMETERS["lr"])
                single_param_adam(target, p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"], None, lr,
                                  *HYPERPARAMETERS["betas"], group["weight_decay"], HYPERPARAMETERS["eps"], True,
                                  False)  # fmt: skip
                bf16_rounding.round_into_bf16_(p.detach(), target, int(state["step"]), index, 0)
            index += 1


@pytest.mark.slow
@pytest.mark.parametrize("moments", ["8bit", "float"])
def test_stochastic_rounding_draws_the_tensor_by_tensor_bits_whatever_the_packing(moments):
    """bf16 weights: the packed update (small windows and one large one) rounds exactly as the tensor-by-tensor
    eager reference, so the bits depend on (step, parameter, element) only."""
    reference = _params(torch.bfloat16)
    runs = {blocks: _params(torch.bfloat16) for blocks in (6, 1 << 14)}
    cls = AdamW8bit if moments == "8bit" else AdamWStochasticBF16
    kwargs = {"bf16_stochastic_round": True} if moments == "8bit" else {}
    optimizers = {}
    for blocks, params in runs.items():
        optimizers[blocks] = cls(_groups(params), **HYPERPARAMETERS, **kwargs)
        optimizers[blocks].window_blocks = blocks
    states: dict = {}
    for step in range(3):
        _set_grads(step, reference, *runs.values())
        # float32 updates of bf16 weights: compute eagerly in float32 and round (the reference's moments are
        # float32 for float-moment tensors, as the weights' dtype is only their appearance there)
        _reference_bf16_step(reference, states, step, quantized=moments == "8bit")
        for optimizer in optimizers.values():
            optimizer.step()
        for blocks, params in runs.items():
            for i, (a, b) in enumerate(zip(reference, params)):
                assert torch.equal(a, b), (moments, blocks, step, SHAPES[i])
    assert any(not a.equal(b.float().bfloat16()) for a, b in zip(reference, _params(torch.bfloat16)))


def test_rounding_bits_name_the_shard_and_never_repeat_across_parameters_or_steps():
    groups = torch.arange(64, dtype=torch.int64)
    index, step = torch.tensor(5), torch.tensor(3)
    bits = bf16_rounding.random_bits16(groups, index, step, key=0)
    assert bits.shape == (64, 8) and int(bits.min()) >= 0 and int(bits.max()) < 1 << 16
    for other in [bf16_rounding.random_bits16(groups, index + 1, step, 0),
                  bf16_rounding.random_bits16(groups, index, step + 1, 0),
                  bf16_rounding.random_bits16(groups, index, step, 1)]:  # fmt: skip
        assert (other != bits).float().mean() > 0.99
    # 16-bit values, close to uniform: 512 of them have a mean near 2^15 (sd 2^16/sqrt(12 * 512) = 836)
    assert abs(float(bits.float().mean()) - 2**15) < 4 * 836


@pytest.mark.slow
def test_the_update_compiles_once_per_kind_of_moments():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    params = _params(torch.bfloat16, seed=3)
    optimizer = AdamW8bit(_groups(params), **HYPERPARAMETERS, bf16_stochastic_round=True)
    optimizer.window_blocks = 12  # windows of many sizes
    for step in range(2):
        _set_grads(step, params)
        optimizer.step()
    sizes = {w.blocks for w in optimizer._windows}
    assert len(sizes) >= 3, sizes
    # one graph for 8-bit moments, one for float moments, whatever the windows' sizes (torchao: one per shape)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_hyperparameters_are_read_from_the_groups_load_state_dict_leaves():
    """DCP initialises the optimizer's state with a step before loading a checkpoint, and load_state_dict replaces
    the group dicts: the windows planned at that first step must read the new ones (the scheduler sets those)."""
    params = _params(torch.float32, seed=5)
    optimizer = AdamW8bit(_groups(params), **HYPERPARAMETERS)
    _set_grads(0, params)
    optimizer.step()
    optimizer.load_state_dict(optimizer.state_dict())
    frozen = optimizer.param_groups[0]
    frozen["lr"], frozen["weight_decay"] = 0.0, 0.0
    before = [p.detach().clone() for p in params]
    _set_grads(2, params)
    optimizer.step()
    moved = [not torch.equal(a, b) for a, b in zip(before, params)]
    assert moved == [False] * len(frozen["params"]) + [True] * (len(params) - len(frozen["params"]))


class _TwoBlocks(torch.nn.Module):
    """Two 'transformer blocks' and a head, in bf16: the units the in-backward step packs together."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        make = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g).bfloat16())  # noqa: E731
        self.blocks = torch.nn.ModuleList()
        for _ in range(2):
            block = torch.nn.Module()
            block.weight, block.bias, block.norm = make(64, 64), make(64), make(64)
            self.blocks.append(block)
        self.head = make(64, 128)

    def transformer_blocks(self):
        return list(self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(x @ block.weight + block.bias) * block.norm
        return (x @ self.head).float().square().mean()


@pytest.mark.slow
def test_the_in_backward_step_packs_each_block_and_equals_the_ordinary_step(monkeypatch):
    """--optimizer-in-backward on one process: each block's per-parameter optimizers are stepped as one packed call
    when the block's last gradient arrives, with the ordinary step's weights bit for bit (bf16 weights, 8-bit
    moments, stochastic rounding)."""
    from bigclip.config import resolve
    from bigclip.engine.in_backward import PerParameterOptimizers, StepInBackward
    from bigclip.optim import create_optimizer, param_groups

    cfg = resolve({"opt": "adamw8bit", "precision": "pure_bf16", "lr": 1e-2}).sections.optimizer
    ordinary_model, stepped_model = _TwoBlocks(), _TwoBlocks()
    ordinary = create_optimizer(cfg, param_groups(ordinary_model, cfg))
    per_parameter = PerParameterOptimizers(cfg, param_groups(stepped_model, cfg))
    batches = []
    original = AdamW8bit.step_together
    monkeypatch.setattr(AdamW8bit, "step_together", staticmethod(
        lambda optimizers, plans: (batches.append(len(optimizers)), original(optimizers, plans))))  # fmt: skip
    units = [list(block.parameters()) for block in stepped_model.blocks]
    hooks = StepInBackward(per_parameter, torch.device("cpu"), units=units)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    for _ in range(3):
        ordinary_model(x).backward()
        ordinary.step()
        ordinary.zero_grad()
        stepped_model(x).backward()
        hooks.finish_backward()
    assert batches == [3, 3] * 3  # each block's three tensors in one call, every step (the head on its own)
    for a, b in zip(ordinary_model.parameters(), stepped_model.parameters()):
        assert torch.equal(a, b)
    hooks.remove()
