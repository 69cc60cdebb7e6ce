"""Exact mid-epoch resume of WebDataset training: a run SIGKILLed mid-epoch and resumed with --resume latest
trains on exactly the samples, step by step and rank by rank, that the uninterrupted run trained on.

2 ranks x 2 workers under torchrun, shards written with webdataset's TarWriter, captions equal to the
samples' keys; tests/data_keys_worker.py records each step's captions per rank.
"""

import io
import json
import os

import pytest
import webdataset as wds
from helpers import read_metrics, sigkill_job, start_job, wait_for_step
from PIL import Image
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "data_keys_worker.py")
SHARDS, PER_SHARD = 8, 24


def write_shards(directory) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, format="PNG")
    for s in range(SHARDS):
        with wds.TarWriter(str(directory / f"train-{s:03d}.tar")) as sink:
            for i in range(PER_SHARD):
                key = f"s{s}i{i:02d}"
                sink.write({"__key__": key, "png": buf.getvalue(), "txt": key})
    return str(directory / "train-{000..007}.tar")


def flags(shards: str, name: str, *extra: str) -> list[str]:
    # 192 samples; 176 per epoch = 11 global batches of 2 x 8 -> 6 per worker, 12 per rank (fewer if shards
    # run out first, without resampling: every rank stops with the first that runs out).
    return ["--model", "test-tiny", "--train-data", shards, "--train-num-samples", "176", "--batch-size", "8",
            "--workers", "2", "--epochs", "2", "--precision", "fp32", "--lr", "1e-3", "--warmup", "1",
            "--save-every-n-steps", "3", "--name", name, "--seed", "5", *extra]  # fmt: skip


def launch(tmp_path, out_dir, args):
    os.makedirs(out_dir, exist_ok=True)
    return start_job(WORKER, [out_dir, "--", *args], nproc=2, cwd=str(tmp_path), merge_stderr=True)


def keys_by_step(out_dir) -> dict[tuple[int, int], list]:
    """(rank, step) -> the step's captions; a step recorded twice (replayed after a resume) keeps the last."""
    out = {}
    for rank in (0, 1):
        with open(os.path.join(out_dir, f"keys-rank{rank}.jsonl")) as f:
            for line in f:
                record = json.loads(line)
                out[(rank, record["step"])] = record["keys"]
    return out


# In CI the S3 case (resampled); the local one, the same resume from another source, in the extended tier.
@pytest.mark.parametrize("where, resampled", [pytest.param("local", False, marks=pytest.mark.extended), ("s3", True)])
def test_sigkill_mid_epoch_then_resume_trains_on_the_same_samples(tmp_path, where, resampled, request):
    shards = write_shards(tmp_path)
    if where == "s3":  # the same shards streamed from the S3 server on loopback
        s3, bucket = request.getfixturevalue("s3"), request.getfixturevalue("s3_bucket")
        s3.fs().put(str(tmp_path / "train-*.tar"), f"s3://{bucket}/shards/")
        shards = f"s3://{bucket}/shards/train-{{000..007}}.tar"
    extra = ["--dataset-resampled"] if resampled else []

    whole = launch(tmp_path, str(tmp_path / "whole"), flags(shards, "whole", *extra))
    out, _ = whole.communicate(timeout=400)
    assert whole.returncode == 0, out[-3000:]
    reference = keys_by_step(tmp_path / "whole")

    killed_dir = str(tmp_path / "killed")
    run_dir = os.path.join(tmp_path, "logs", "killed")
    proc = launch(tmp_path, killed_dir, flags(shards, "killed", *extra))
    assert wait_for_step(run_dir, 8, proc, timeout=900), proc.communicate()[0][-3000:] if proc.poll() else ""
    sigkill_job(proc)
    killed_at = max(r["step"] for r in read_metrics(run_dir) if "loss" in r)

    resumed = launch(tmp_path, killed_dir, flags(shards, "killed", *extra, "--resume", "latest"))
    out, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, out[-3000:]
    line = next(x for x in out.splitlines() if "resumed from" in x)
    resumed_at = int(line.rsplit("step ", 1)[1])
    assert 0 < resumed_at < killed_at or resumed_at % 3 == 0, (resumed_at, killed_at)

    got = keys_by_step(killed_dir)
    assert got.keys() == reference.keys()
    for key in sorted(reference):
        assert got[key] == reference[key], key
    # each epoch's samples: no key twice within an epoch without resampling
    if not resampled:
        steps_per_epoch = max(step for _rank, step in reference) // 2
        for epoch in range(2):
            seen = [k for (rank, step), groups in reference.items()
                    if epoch * steps_per_epoch < step <= (epoch + 1) * steps_per_epoch
                    for group in groups for k in group]  # fmt: skip
            assert len(seen) == len(set(seen))
