"""Stochastic rounding into bf16 weights (bigclip/optim/bf16_rounding.py; --precision pure_bf16): unbiased, and what
keeps small updates alive in AdamW, StableAdamW and the 8-bit AdamW, while --bf16-round-to-nearest loses them."""

from __future__ import annotations

import math

import pytest
import torch

from bigclip.config import resolve
from bigclip.optim import bf16_rounding, create_optimizer


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each float32 value (toward and away from zero, positive x)."""
    down = x.bfloat16().float()
    down = torch.where(down > x, torch.nextafter(down.bfloat16(), torch.zeros_like(down.bfloat16())).float(), down)
    up = torch.nextafter(down.bfloat16(), torch.full_like(down.bfloat16(), math.inf)).float()
    return down, up


def test_rounding_is_unbiased_and_lands_on_a_neighbour():
    g = torch.Generator().manual_seed(0)
    x = 1.0 + torch.rand(1000, generator=g)  # [1, 2): one bf16 step is 2^-7
    down, up = bf16_neighbours(x)
    rounds = 2000
    total = torch.zeros_like(x, dtype=torch.float64)
    param = torch.empty_like(x, dtype=torch.bfloat16)
    for step in range(rounds):
        bf16_rounding.round_into_bf16_(param, x, step, 0, 0)
        value = param.float()
        assert bool(((value == down) | (value == up)).all())
        total += value.double()
    mean = total / rounds
    # Each rounding errs by a Bernoulli multiple of the step: variance <= step^2 / 4, so the mean of `rounds`
    # of them has a standard deviation <= step / (2 sqrt(rounds)); 6 of those over 1000 values.
    bound = 6 * 2**-7 / (2 * math.sqrt(rounds))
    assert float((mean - x.double()).abs().max()) < bound
    # round-to-nearest errs by up to half a step
    assert float((x.bfloat16().double() - x.double()).abs().max()) > 5 * bound


def test_the_bits_are_the_same_on_replicas_and_the_training_stream_is_untouched():
    x = 1.0 + torch.rand(4096, generator=torch.Generator().manual_seed(1))
    a, b = (torch.empty_like(x, dtype=torch.bfloat16) for _ in range(2))
    assert bf16_rounding.shard_key(a) == bf16_rounding.shard_key(b) == 0  # whole tensors: every replica alike
    bf16_rounding.round_into_bf16_(a, x, 3, 5, 0)
    bf16_rounding.round_into_bf16_(b, x, 3, 5, 0)
    assert torch.equal(a, b)
    for other in ((4, 5, 0), (3, 6, 0), (3, 5, 1)):  # another step, parameter or shard draws other bits
        bf16_rounding.round_into_bf16_(b, x, *other)
        assert not torch.equal(a, b), other
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    bf16_rounding.round_into_bf16_(a, x, 1, 0, 0)  # no generator is drawn from
    assert torch.equal(torch.rand(3), expected)


STEPS, LR, N = 50, 1e-4, 4096


def drift_after_small_updates(opt: str, **flags) -> tuple[float, float]:
    """bf16 weights at 1.0 under a constant gradient of 1 (an Adam step is then lr), lr far below the bf16 step
    at 1.0 (2^-8 below it): (mean change, standard deviation bound of that mean) after STEPS steps."""
    weight = torch.nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
    cfg = resolve({"opt": opt, "lr": LR, "wd": 0.0, "precision": "pure_bf16", **flags}).sections.optimizer
    optimizer = create_optimizer(cfg, [{"params": [weight], "weight_decay": 0.0}])
    for _ in range(STEPS):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    change = float((weight.detach().double() - 1.0).mean())
    # every rounding errs by at most one step (2^-7 above 1.0, 2^-8 below): sd of the mean of N sums of STEPS
    sd = math.sqrt(STEPS) * 2**-7 / (2 * math.sqrt(N))
    return change, sd


@pytest.mark.slow  # torchao compiles its update (adamw, adamw8bit) on the first step
@pytest.mark.parametrize("opt", ["adamw", "stableadamw", "adamw8bit"])
def test_small_updates_survive_in_expectation_and_round_to_nearest_loses_them(opt):
    change, sd = drift_after_small_updates(opt)
    assert change == pytest.approx(-STEPS * LR, abs=6 * sd), (change, sd)
    nearest, _ = drift_after_small_updates(opt, bf16_round_to_nearest=True)
    assert nearest == 0.0  # every update is under half a step: the weights never move
