"""Evaluation on 2 gloo ranks whose validation shares differ in length (WebDataset shards split unevenly,
or fewer shards than ranks). Under FSDP every forward is a collective: the ranks must step in lockstep and
the metrics must be those of the whole validation set, as one process computes them."""

import json
import subprocess
import textwrap

import pytest
import torch
from helpers import subprocess_env, torchrun_cmd

from bigclip.config import resolve
from bigclip.dist import World
from bigclip.engine import build_engine
from bigclip.eval import validate
from bigclip.model import create_model

pytestmark = pytest.mark.slow

WORKER = r"""
import functools, json, sys
import torch
from bigclip.config import resolve
from bigclip.dist import init_distributed
from bigclip.engine import build_engine, build_model
from bigclip.eval import validate
from bigclip.model import create_model

def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    texts = torch.randint(1, 250, (4, 16), generator=g)
    texts[:, -1] = 258
    return torch.randn(4, 3, 16, 16, generator=g), texts

world = init_distributed("cpu", "gloo")
cfg = resolve({"dataset_type": "synthetic", "precision": "fp32", "model": "test-tiny", "batch_size": 4,
               "engine": "fsdp", "sharded_init": "never"})
torch.manual_seed(0)
engine_cfg = cfg.sections.engine
engine = build_engine(engine_cfg, build_model(engine_cfg, world, functools.partial(create_model, cfg.model)), world)
engine.eval()
shares = {"uneven": {0: [0, 1, 2], 1: [3, 4]}, "one_rank_empty": {0: [0, 1, 2, 3, 4], 1: []}}
results = {name: validate(engine, [batch(i) for i in share[world.rank]], world) for name, share in shares.items()}
if world.rank == 0:
    json.dump(results, open(sys.argv[1], "w"))
"""


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    texts = torch.randint(1, 250, (4, 16), generator=g)
    texts[:, -1] = 258
    return torch.randn(4, 3, 16, 16, generator=g), texts


def test_fsdp_validation_with_unequal_shares_runs_in_lockstep(tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    out = tmp_path / "out.json"
    cmd = torchrun_cmd(2, str(tmp_path / "worker.py"), str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads(out.read_text())

    # The whole validation set in one process, same initial weights.
    cfg = resolve(dict(model="test-tiny", dataset_type="synthetic", precision="fp32", batch_size=4))
    torch.manual_seed(0)
    engine = build_engine(cfg.sections.engine, create_model("test-tiny"), World())
    engine.eval()
    want = validate(engine, [_batch(i) for i in range(5)], World())
    assert want["num_samples"] == 20
    for name, got in results.items():
        assert got.keys() == want.keys(), name
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.parametrize("n", [7, 37])
def test_retrieval_metrics_against_counting_and_openclip(n):
    """R@1/5/10, mean and median rank, both directions: against ranks counted one pair at a time in float64
    (rank of pair i = how many candidates score above the true one, + 1) and against OpenCLIP's
    get_clip_metrics on the same features."""
    from open_clip_train.train import get_clip_metrics

    from bigclip.eval import retrieval_metrics

    g = torch.Generator().manual_seed(n)
    image = torch.nn.functional.normalize(torch.randn(n, 16, generator=g), dim=-1)
    text = torch.nn.functional.normalize(image + 0.9 * torch.randn(n, 16, generator=g), dim=-1)  # some hits
    got = retrieval_metrics(image, text, 100.0)

    scores = (image.double() @ text.double().t()).tolist()
    for name, rows in (("image_to_text", scores), ("text_to_image", [list(c) for c in zip(*scores)])):
        ranks = sorted(1 + sum(s > row[i] for s in row) for i, row in enumerate(rows))
        assert got[f"{name}_mean_rank"] == pytest.approx(sum(ranks) / n)
        assert got[f"{name}_median_rank"] == ranks[(n - 1) // 2]  # the lower median, as torch's
        for k in (1, 5, 10):
            assert got[f"{name}_R@{k}"] == pytest.approx(sum(r <= k for r in ranks) / n)
    assert 0 < got["image_to_text_R@1"] < 1 or n < 10  # neither trivial nor hopeless at n=37
    theirs = get_clip_metrics(image, text, torch.tensor(100.0))
    assert got == pytest.approx(theirs)
