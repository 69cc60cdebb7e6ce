"""Issue 40 item 4: the giant architectures of OpenCLIP's zoo plan and build by name. `bigclip --model NAME --dry-run`,
as a user would start a run of one, prints the plan (world, engine layout, memory per GPU) with OpenCLIP's own
parameter count of that name (open_clip's model built on the meta device, the oracle), and the model builds on meta in
seconds (nothing allocated: EVA02-E-14's 4.7B parameters would be 19 GB in float32)."""

from __future__ import annotations

import time

import open_clip
import pytest
import torch

from bigclip import cli
from bigclip.model import create_model

# The SigLIP text towers (their vocabulary, no causal mask, last-token pooling, the projection's bias) are the
# other half of issue 40's model-zoo work: until they land, these two are refused in one line ("text vocab_size
# 32000 is smaller than the tokenizer's 49408"; "TextTransformer.__init__() got an unexpected keyword argument
# 'hf_tokenizer_name'"). strict: the test fails once they build, so the mark goes with them.
SIGLIP_TEXT = pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="SigLIP text towers not built yet (issue 40)"
)
GIANTS = [
    "EVA02-E-14",
    "ViT-e-14",
    "convnext_xxlarge",
    "PE-Core-bigG-14-448",
    pytest.param("ViT-gopt-16-SigLIP2-384", marks=SIGLIP_TEXT),  # the ViT-gopt-16-SigLIP2: OpenCLIP's largest
    pytest.param("ViT-SO400M-14-SigLIP", marks=SIGLIP_TEXT),
]
META_BUILD_S = 30  # measured 0.3-1.5 s each on a 2-core machine; a tower that allocated would take minutes or fail


def _openclip_params(name: str) -> int:
    with torch.device("meta"):
        model = open_clip.create_model(name, pretrained=None, device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", GIANTS)
def test_a_giant_prints_its_dry_run_plan_and_builds_on_meta_in_seconds(name, capsys, tmp_path):
    logs = tmp_path / "logs"
    code = cli.main(["--model", name, "--dataset-type", "synthetic", "--engine", "fsdp", "--grad-checkpointing",
                     "--precision", "amp_bf16", "--batch-size", "32", "--dry-run", "--logs", str(logs)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.splitlines()
    assert f"model {name}: {_openclip_params(name) / 1e6:.1f}M parameters" in lines, lines
    assert any(line.startswith("engine fsdp2: fully_shard per transformer block") for line in lines), lines
    assert any(line.startswith("memory per GPU (fsdp, amp_bf16, adamw, 1 rank(s), micro-batch 32") for line in lines)
    assert not logs.exists()  # a plan, not a run
    start = time.perf_counter()
    model = create_model(name, device="meta")
    seconds = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    assert seconds < META_BUILD_S, f"{name}: {seconds:.1f} s on meta"
