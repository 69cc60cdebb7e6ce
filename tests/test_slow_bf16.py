"""A run whose precision computes in a 16-bit dtype that the CPU emulates says so once at its start, with the
measured factor and the flag to use instead (bigclip/precision.py: slow_precision_warning).

A CPU without bf16 units is the real one, not a stand-in: ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 make
torch on any x86 CPU take the code paths of an AVX2-only one (capability "AVX2", bf16 matmuls emulated: 40-130x
slower than float32 here, as on the AVX2-only machines the factor was first measured on). Such a process gets its
own TORCHINDUCTOR_CACHE_DIR: torch.compile's cache keys leave ATEN_CPU_CAPABILITY out, so kernels compiled under it
and read back by an ordinary process on the same machine (or the other way round) computed wrong results and
corrupted the heap (measured on torchao's compiled 8-bit quantisation)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import TINY_SYNTHETIC, python_train

from bigclip.precision import (
    SLOW_FACTOR,
    cpu_matmul_slowdown,
    resolve_precision,
    slow_precision_warning,
)

CPU = torch.device("cpu")


def avx2_only(tmp_path) -> dict[str, str]:
    """The environment of a process that computes as an AVX2-only CPU does."""
    cache = str(tmp_path / "inductor-avx2")
    return {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": cache}


SAID = re.compile(r"--precision amp: this CPU \(torch capability (\w+)\) computes bfloat16 (\d+)x slower than float32")


def test_bf16_and_fp16_precisions_on_a_slow_cpu_say_so_with_the_factor_and_the_flag():
    measured = []
    emulated = lambda dtype: measured.append(dtype) or 95.0  # noqa: E731  (what an AVX2-only CPU measured)
    for name, dtype in (("amp", "bfloat16"), ("amp_bf16", "bfloat16"), ("pure_bf16", "bfloat16"), ("fp16", "float16")):
        line = slow_precision_warning(resolve_precision(name, CPU), CPU, emulated)
        assert line.startswith(f"--precision {name}: this CPU (torch capability ")
        assert f"computes {dtype} 95x slower than float32" in line and line.endswith(
            "use --precision fp32 to run faster here"
        )
    assert measured == [torch.bfloat16] * 3 + [torch.float16]  # each measured in the dtype it computes in
    # nothing to say: fp32 computes in float32; bf16 at native speed; a GPU is not this CPU
    assert slow_precision_warning(resolve_precision("fp32", CPU), CPU, emulated) is None
    assert slow_precision_warning(resolve_precision("amp_bf16", CPU), CPU, lambda dtype: SLOW_FACTOR * 0.9) is None
    cuda = torch.device("cuda")
    assert slow_precision_warning(resolve_precision("amp_bf16", cuda), cuda, emulated) is None


def said(tmp_path, name: str, **env: str) -> list[str]:
    """The lines a one-epoch tiny run under --precision amp (bf16 autocast on CPU) logged about its precision."""
    args = [*TINY_SYNTHETIC, "--precision", "amp", "--epochs", "1", "--train-num-samples", "16"]
    out = python_train([*args, "--logs", str(tmp_path), "--name", name], **env)
    assert out.returncode == 0, out.stderr[-2000:]
    return [line for line in open(tmp_path / name / "out.log") if "slower than float32" in line]


@pytest.mark.slow
def test_a_run_on_a_cpu_without_bf16_units_says_it_once_with_the_measured_factor(tmp_path):
    (line,) = said(tmp_path, "avx2", **avx2_only(tmp_path))
    capability, factor = SAID.search(line).groups()
    assert capability == "AVX2" and int(factor) >= SLOW_FACTOR
    assert line.rstrip().endswith("use --precision fp32 to run faster here")


@pytest.mark.slow
def test_the_same_run_says_it_where_this_cpu_measures_bf16_slow_and_only_there(tmp_path):
    """This machine's own CPU: the run says it exactly when bf16 measures slow here (an AVX512-BF16 or AMX CPU:
    0.4-0.5x, nothing said; an AVX2-only one: 40x and more, said once). Known CPUs measure far from the threshold
    on either side; one between 0.5x and 2x of it is only held to saying it at most once."""
    factor = cpu_matmul_slowdown(torch.bfloat16)
    lines = said(tmp_path, "native")
    if factor < SLOW_FACTOR / 2:
        assert lines == []
    elif factor > SLOW_FACTOR * 2:
        assert len(lines) == 1 and SAID.search(lines[0])
    else:
        assert len(lines) <= 1
