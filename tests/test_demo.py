"""The README's first command: `python launch/train.py` with no flags trains the embedded demo."""

import json
import os
import time

import pytest
from helpers import python_train

pytestmark = pytest.mark.slow


def test_demo_learns_digits_zero_shot(tmp_path):
    start = time.monotonic()
    out = python_train([], cwd=str(tmp_path), timeout=600)
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "zero-shot top-1 accuracy on 360 held-out images" in text and "(chance 0.100)" in text
    for what in ("logs:", "metrics:", "checkpoints:", "config:"):
        assert what in text
    (run_dir,) = os.listdir(tmp_path / "logs")
    records = [json.loads(line) for line in open(tmp_path / "logs" / run_dir / "metrics.jsonl")]
    final = [r for r in records if "eval/zeroshot_top1" in r][-1]
    assert final["eval/zeroshot_top1"] >= 0.8, final
    assert final["epoch"] == 24
    print(f"demo: zero-shot top-1 {final['eval/zeroshot_top1']:.3f} in {elapsed:.0f} s")
