"""Evaluation on 2 gloo ranks whose validation shares differ in length (WebDataset shards split unevenly,
or fewer shards than ranks). Under FSDP every forward is a collective: the ranks must step in lockstep and
the metrics must be those of the whole validation set, as one process computes them."""

import json
import math
import textwrap

import pytest
import torch
from helpers import launch

from bigclip.config import resolve
from bigclip.dist import World
from bigclip.engine import build_engine
from bigclip.evaluation.retrieval import retrieval_metrics
from bigclip.evaluation.validate import validate
from bigclip.model import create_model

pytestmark = pytest.mark.slow

WORKER = r"""
import functools, json, sys
import torch
from bigclip.config import resolve
from bigclip.dist import init_distributed
from bigclip.engine import build_engine, build_model
from bigclip.evaluation.validate import validate
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
    proc = launch(str(tmp_path / "worker.py"), [str(out)], 900, nproc=2)
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


@pytest.mark.parametrize("n", [7, 36, 37])
@pytest.mark.parametrize("chunk", [0, 1, 5, 4096])
def test_retrieval_metrics_against_counting_and_openclip(n, chunk):
    """R@1/5/10, mean and median rank, both directions, at every --val-retrieval-chunk-size: against ranks
    counted one pair at a time in float64 (rank of pair i = how many candidates score above the true one, + 1)
    and against OpenCLIP's get_clip_metrics on the same features (its median is numpy's: at an even n the floor
    of the two middle ranks' mean)."""
    from open_clip_train.train import get_clip_metrics

    from bigclip.evaluation.retrieval import retrieval_metrics

    g = torch.Generator().manual_seed(n)
    image = torch.nn.functional.normalize(torch.randn(n, 16, generator=g), dim=-1)
    text = torch.nn.functional.normalize(image + 0.9 * torch.randn(n, 16, generator=g), dim=-1)  # some hits
    got = retrieval_metrics(image, text, 100.0, chunk)

    scores = (image.double() @ text.double().t()).tolist()
    for name, rows in (("image_to_text", scores), ("text_to_image", [list(c) for c in zip(*scores)])):
        ranks = sorted(1 + sum(s > row[i] for s in row) for i, row in enumerate(rows))
        assert got[f"{name}_mean_rank"] == pytest.approx(sum(ranks) / n)
        middle = (ranks[(n - 1) // 2] + ranks[n // 2]) / 2
        assert got[f"{name}_median_rank"] == math.floor(middle - 1) + 1
        for k in (1, 5, 10):
            assert got[f"{name}_R@{k}"] == pytest.approx(sum(r <= k for r in ranks) / n)
    assert 0 < got["image_to_text_R@1"] < 1 or n < 10  # neither trivial nor hopeless at n=37
    theirs = get_clip_metrics(image, text, torch.tensor(100.0))
    assert got == pytest.approx(theirs)


@pytest.mark.parametrize("chunk", [0, 2, 3])
def test_retrieval_ties_rank_by_index_at_every_chunk_size(chunk):
    """Exactly representable scores with ties: a tied candidate ranks above the true partner when its index is
    smaller (OpenCLIP main's rule), whatever the chunking."""
    image = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 2.0]])
    text = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    got = retrieval_metrics(image, text, 1.0, chunk)
    scores = (image @ text.t()).tolist()
    for name, rows in (("image_to_text", scores), ("text_to_image", [list(c) for c in zip(*scores)])):
        ranks = [sum(s > row[i] or (s == row[i] and j < i) for j, s in enumerate(row)) for i, row in enumerate(rows)]
        assert got[f"{name}_R@1"] == pytest.approx(sum(r < 1 for r in ranks) / 5)
        assert got[f"{name}_mean_rank"] == pytest.approx(sum(ranks) / 5 + 1)
    assert got["image_to_text_R@1"] < 1  # image 1 ties with text 0, which comes first


def test_chunked_retrieval_never_allocates_the_score_matrix():
    """--val-retrieval-chunk-size C: no single allocation larger than a C x C block of 64-bit values (the
    comparisons) or the O(N) rank vectors, where one block allocates the whole N x N matrix (torch's profiler
    records every CPU allocation)."""
    from torch.profiler import ProfilerActivity, profile

    n, chunk = 1000, 50
    g = torch.Generator().manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(n, 32, generator=g), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(n, 32, generator=g), dim=-1)
    largest = {}
    for size in (chunk, 0):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            retrieval_metrics(image, text, 100.0, size)
        largest[size] = max(e.cpu_memory_usage for e in prof.events())
    assert largest[chunk] <= max(8 * chunk * chunk, 8 * n)
    assert largest[0] >= 4 * n * n  # the whole matrix, as OpenCLIP 3.3 builds it
