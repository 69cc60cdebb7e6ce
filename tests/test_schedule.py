"""LR schedules: OpenCLIP's shapes, checked at the points that define them."""

import math
from types import SimpleNamespace

import pytest

from bigclip.schedule import ScheduleConfig, build_schedule, constant, constant_cooldown, cosine


def test_cosine_warmup_peak_and_end():
    lr = cosine(1.0, warmup=10, total_steps=110)
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.5)
    assert lr(110) == pytest.approx(0.0, abs=1e-12)


def test_constant():
    lr = constant(0.5, warmup=4)
    assert [lr(s) for s in range(6)] == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])


def test_const_cooldown_power_and_end():
    lr = constant_cooldown(1.0, warmup=0, total_steps=100, cooldown_steps=20, power=2.0, end_lr=0.1)
    assert lr(79) == 1.0
    assert lr(80) == pytest.approx(1.0)
    assert lr(90) == pytest.approx(0.25 * 0.9 + 0.1)
    assert lr(100) == pytest.approx(0.1)


def test_build_schedule_counts_optimizer_steps():
    cfg = SimpleNamespace(
        epochs=4,
        lr=None,
        lr_scheduler="const-cooldown",
        warmup=0,
        epochs_cooldown=1,
        lr_cooldown_power=1.0,
        lr_cooldown_end=0.0,
        skip_scheduler=False,
    )
    lr = build_schedule(cfg, steps_per_epoch=10)
    assert lr(29) == pytest.approx(5e-4)  # default lr, cooldown starts at epoch 3
    assert lr(35) == pytest.approx(5e-4 * 0.5)
    assert math.isclose(lr(40), 0.0, abs_tol=1e-12)


def test_skip_scheduler_is_the_base_lr_from_the_first_step():
    cfg = ScheduleConfig(lr=0.01, warmup=100, skip_scheduler=True, epochs=3)
    lr = build_schedule(cfg, steps_per_epoch=10)
    assert [lr(s) for s in (0, 1, 29)] == [0.01, 0.01, 0.01]
