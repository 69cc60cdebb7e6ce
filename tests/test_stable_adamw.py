"""StableAdamW (--opt stableadamw): the update against an independent float64 re-implementation, the whole-tensor
clipping of sharded parameters, the flag's rules, and a short training run."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from helpers import fork_ranks, free_port, python_train, read_metrics
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from bigclip.config import resolve
from bigclip.errors import UserError
from bigclip.optim import StableAdamW

LR, BETAS, EPS = 0.05, (0.9, 0.98), 1e-6
SHAPES = [(4, 5), (3, 7), (5,)]
WEIGHT_DECAYS = [0.1, 0.1, 0.0]  # two decayed tensors, one in a group without decay (a gain or bias)


def reference(params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]]):
    """Textbook Adam moments with explicit bias correction, in float64, one tensor at a time: the paper's update
    rule written out independently of the optimizer's debiased-beta form. Returns the final parameters and
    each step's RMS_t per tensor."""
    beta1, beta2 = BETAS
    theta = [p.double().clone() for p in params]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    rms_log = []
    for t, grads in enumerate(grads_per_step, start=1):
        rms_step = []
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t)
            v_hat = v[i] / (1 - beta2**t)
            rms = math.sqrt((g * g / torch.clamp(v_hat, min=EPS**2)).mean().item())
            eta = LR / max(1.0, rms)
            theta[i] = theta[i] - eta * WEIGHT_DECAYS[i] * theta[i] - eta * m_hat / (v_hat.sqrt() + EPS)
            rms_step.append(rms)
        rms_log.append(rms_step)
    return theta, rms_log


def run_optimizer(optimizer_cls, params0, grads_per_step, **kwargs):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    groups = [
        {"params": [params[0], params[1]], "weight_decay": WEIGHT_DECAYS[0]},
        {"params": [params[2]], "weight_decay": WEIGHT_DECAYS[2]},
    ]
    optimizer = optimizer_cls(groups, lr=LR, betas=BETAS, eps=EPS, **kwargs)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


def random_problem(scales: list[float], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params0 = [torch.randn(shape, generator=gen) for shape in SHAPES]
    grads = [[scale * torch.randn(shape, generator=gen) for shape in SHAPES] for scale in scales]
    return params0, grads


def assert_matches(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_matches_float64_reference_with_clipping_active():
    params0, grads = random_problem([0.01] * 6)
    grads[4][0] = grads[4][0] * 1000.0  # a gradient spike in one tensor at step 5
    expected, rms_log = reference(params0, grads)
    # RMS_t cannot exceed 1 / sqrt(1 - beta2_hat) (about 2.2 at step 5): the spike's step is cut by over a third.
    assert rms_log[4][0] > 1.5
    assert_matches(run_optimizer(StableAdamW, params0, grads), expected)


def test_matches_float64_reference_and_adamw_without_clipping():
    # Shrinking gradients keep g^2 below the remembered second moment: RMS_t <= 1 at every step.
    params0, grads = random_problem([0.5**t for t in range(6)])
    expected, rms_log = reference(params0, grads)
    assert max(max(step) for step in rms_log) <= 1.0 + 1e-12
    ours = run_optimizer(StableAdamW, params0, grads)
    assert_matches(ours, expected)
    # No clipping: exactly torch's AdamW (same bias correction, eps placement and decoupled weight decay).
    adamw = run_optimizer(torch.optim.AdamW, params0, grads)
    for a, b in zip(ours, adamw):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_skips_parameters_without_gradients_and_counts_steps_per_tensor():
    params0, grads = random_problem([0.1, 0.1])
    grads[0][2] = None  # the third tensor gets no gradient in the first step
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    optimizer = StableAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        optimizer.step()
    assert optimizer.state[params[0]]["step"].item() == 2 and optimizer.state[params[2]]["step"].item() == 1


def test_rejects_non_positive_eps():
    with pytest.raises(ValueError, match="eps"):
        StableAdamW([torch.nn.Parameter(torch.ones(2))], eps=0.0)


def _sharded_worker(rank: int, world_size: int, port: int, params0, grads_per_step, expected) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        params = [torch.nn.Parameter(distribute_tensor(p.clone(), mesh, [Shard(0)])) for p in params0]
        groups = [
            {"params": params[:2], "weight_decay": WEIGHT_DECAYS[0]},
            {"params": params[2:], "weight_decay": WEIGHT_DECAYS[2]},
        ]
        optimizer = StableAdamW(groups, lr=LR, betas=BETAS, eps=EPS)
        for grads in grads_per_step:
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            optimizer.step()
        assert_matches([p.full_tensor() for p in params], expected)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_parameters_clip_by_the_whole_tensor():
    """Two ranks, each holding rows of every tensor (the (5,) and (3, 7) tensors split unevenly). Shrinking
    gradients, then a spike in rank 0's rows only: the whole tensors are clipped, while rank 1's rows alone would
    not be (and rank 0's alone would be clipped harder). The result must be the single-process one."""
    params0, grads = random_problem([1.0, 0.5, 0.25, 0.125])
    grads[3][0][:2] *= 1000.0  # rank 0 holds rows 0-1 of the (4, 5) tensor
    grads[3][2][:3] *= 1000.0  # and rows 0-2 of the (5,) tensor
    expected, rms_log = reference(params0, grads)
    _, rank1_alone = reference([params0[0][2:]], [[g[0][2:]] for g in grads])
    _, rank0_alone = reference([params0[0][:2]], [[g[0][:2]] for g in grads])
    assert rank1_alone[3][0] < 1 < rms_log[3][0] < rank0_alone[3][0]
    assert rms_log[3][2] > 1
    fork_ranks(_sharded_worker, (2, free_port(), params0, grads, expected), 2)


def test_flag_rules():
    assert resolve({"opt": "stableadamw"}).opt == "stableadamw"
    with pytest.raises(UserError, match="--opt 'sgd'"):
        resolve({"opt": "sgd"})
    with pytest.raises(UserError, match="--eps"):
        resolve({"opt": "stableadamw", "eps": 0.0})
    with pytest.raises(UserError, match="ZeRO stage 2"):
        resolve({"opt": "stableadamw", "engine": "deepspeed"})


@pytest.mark.slow
def test_trains_end_to_end(tmp_path):
    args = ["--model", "test-tiny", "--dataset-type", "synthetic", "--train-num-samples", "64", "--batch-size", "8",
            "--epochs", "1", "--precision", "fp32", "--workers", "0", "--opt", "stableadamw", "--lr", "1e-3",
            "--warmup", "2", "--log-every-n-steps", "1", "--logs", str(tmp_path), "--name", "x"]  # fmt: skip
    out = python_train(args)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(os.path.join(tmp_path, "x")) if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    assert min(losses[-3:]) < losses[0]
