"""A run whose precision computes in bfloat16 on a CPU without bf16 units says so once at its start, with the
measured factor and the flag to use instead (bigclip/precision.py: slow_bf16_warning)."""

from __future__ import annotations

import math

import torch
from helpers import TINY_SYNTHETIC

from bigclip import cli
from bigclip.precision import SLOW_BF16_FACTOR, cpu_bf16_slowdown, resolve_precision, slow_bf16_warning

CPU = torch.device("cpu")


def test_the_factor_is_measured():
    factor = cpu_bf16_slowdown(size=64, repeats=2)
    assert math.isfinite(factor) and factor > 0


def test_bf16_precisions_on_a_slow_cpu_say_so_with_the_factor_and_the_flag():
    emulated = lambda: 95.0  # noqa: E731  (what an AVX2-only CPU measured)
    for name in ("amp", "amp_bf16", "pure_bf16"):
        line = slow_bf16_warning(resolve_precision(name, CPU), CPU, emulated)
        assert line.startswith(f"--precision {name}: this CPU") and "95x slower" in line and "--precision fp32" in line
    # nothing to say: fp32 computes in float32; bf16 at native speed; a GPU is not this CPU
    assert slow_bf16_warning(resolve_precision("fp32", CPU), CPU, emulated) is None
    assert slow_bf16_warning(resolve_precision("amp_bf16", CPU), CPU, lambda: SLOW_BF16_FACTOR / 2) is None
    cuda = torch.device("cuda")
    assert slow_bf16_warning(resolve_precision("amp_bf16", cuda), cuda, emulated) is None


def test_a_run_says_it_at_most_once_and_in_its_form(tmp_path):
    """Whether this machine is slow is its own measurement at the run's start (the decision itself is tested
    above with the factor given); the run says it at most once, and in the form above when it does."""
    assert cli.main([*TINY_SYNTHETIC, "--logs", str(tmp_path), "--name", "r", "--precision", "amp_bf16"]) == 0
    said = [line for line in open(tmp_path / "r" / "out.log") if "computes bfloat16" in line]
    assert len(said) <= 1
    assert all("--precision amp_bf16: this CPU" in line and "--precision fp32" in line for line in said)
