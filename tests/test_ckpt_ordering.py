"""Checkpoints rank by training position (step, then epoch), never by the order they were committed in.

Within one job saves are serialized (a save waits for, or is deferred behind, the one before), so a checkpoint
commits after a newer one in two ways, and both are held here at that point of their progress by the test proxy
in front of a real S3-protocol server (tests/tcp_proxy.py), never by the clock:
- a request the network delivers late: step_4's manifest PUT is held back, the save gives up on it (not
  committed), the job commits step_6 and step_8, and then the held PUT reaches the store: step_4 commits last;
- a straggling writer: an old process retries step_6's upload (the store refuses that checkpoint's requests)
  while the job's new process resumes and commits step_8 and step_10; then the store takes step_6.
Either way `--resume latest` (CheckpointCatalog.resume) restores the newest step, the catalogue lists newest
first, and `--keep-last-k` (the manager's keep_last_k) prunes only what is older than the k newest.
"""

import os
import re

import pytest
import torch
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)
from tcp_proxy import TcpProxy
from test_ckpt import bigclip_log, tiny_engine  # noqa: F401  (bigclip_log: a fixture)

from bigclip.ckpt import CheckpointManager
from bigclip.ckpt.manifest import MANIFEST
from bigclip.dist import World


@pytest.fixture
def proxy(s3):
    p = TcpProxy(("127.0.0.1", s3.port))
    yield p
    p.close()


def first_weight(engine) -> torch.Tensor:
    return next(engine.model.parameters())


def mark(engine, step: int) -> None:
    """Tell the states apart: the first weight holds the step it was saved at."""
    with torch.no_grad():
        first_weight(engine).fill_(float(step))


def save(manager, engine, step: int, epoch: int = 0, tag: str | None = None, aliases=()) -> None:
    mark(engine, step)
    manager.save(tag or f"step_{step}", step, epoch, aliases=aliases)
    manager.wait()


def options(proxy) -> dict:
    # Short client timeouts: a held request is given up on in seconds, not the client's default minutes.
    config = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}
    return {"client_kwargs": {"endpoint_url": proxy.endpoint}, "config_kwargs": config}


def committed(s3, prefix: str) -> list[str]:
    return sorted((p.split("/")[-2] for p in s3.fs().glob(f"{prefix}/*/{MANIFEST}")), key=lambda t: int(t[5:]))


def listed(manager) -> list[str]:
    """The catalogue, as --resume latest and --keep-last-k rank it: newest first."""
    return [os.path.basename(c.location) for c in manager.catalog.candidates()]


def assert_resumes(node, remote: str, step: int) -> None:
    """A node without local copies: --resume latest restores the state saved at `step`."""
    location, manifest = node.resume("latest")
    assert location == f"{remote}/step_{step}" and manifest.step == step
    assert torch.all(first_weight(node.engine) == step)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0, 2])
def test_a_manifest_delivered_late_never_outranks_newer_checkpoints(s3, s3_bucket, proxy, tmp_path, keep):
    prefix = f"{s3_bucket}/runs/r/checkpoints"
    remote = f"s3://{prefix}"
    proxy.hold_matching(re.escape(f"PUT /{prefix}/step_4/{MANIFEST}".encode()))
    engine = tiny_engine()
    job = CheckpointManager(
        str(tmp_path / "job"), engine, World(), remote=remote, storage_options=options(proxy), keep_last_k=keep,
        upload_timeout=3,
    )  # fmt: skip
    save(job, engine, 2)
    save(job, engine, 4)
    assert proxy.held.is_set()
    failed = job.results[-1]
    assert failed.tag == "step_4" and failed.error and not failed.permanent, failed  # given up, training goes on
    save(job, engine, 6)
    save(job, engine, 8)
    assert [r.tag for r in job.results if r.error is None] == ["step_2", "step_6", "step_8"]
    assert committed(s3, prefix) == (["step_6", "step_8"] if keep else ["step_2", "step_6", "step_8"])

    proxy.release()  # the held PUTs reach the store: step_4 is committed after step_8, whose manifest is older
    assert committed(s3, prefix) == (
        ["step_4", "step_6", "step_8"] if keep else ["step_2", "step_4", "step_6", "step_8"]
    )
    node = CheckpointManager(str(tmp_path / "node"), tiny_engine(seed=1), World(), remote=remote,
                             storage_options=options(proxy))  # fmt: skip
    ranked = listed(node)
    assert ranked == (["step_8", "step_6", "step_4"] if keep else ["step_8", "step_6", "step_4", "step_2"])
    assert node.latest() == f"{remote}/step_8"
    assert_resumes(node, remote, 8)

    # The job's next commit prunes by position: step_4, the last to commit, goes; step_8 stays.
    save(job, engine, 10)
    assert committed(s3, prefix) == (
        ["step_8", "step_10"] if keep else ["step_2", "step_4", "step_6", "step_8", "step_10"]
    )
    assert node.latest() == f"{remote}/step_10"
    job.close()
    node.close()


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0, 2])
def test_a_straggler_retrying_an_older_checkpoint_commits_after_newer_ones(
    s3, s3_bucket, proxy, tmp_path, keep, bigclip_log
):
    prefix = f"{s3_bucket}/runs/r/checkpoints"
    remote = f"s3://{prefix}"
    proxy.refuse_matching(re.escape(f"/{prefix}/step_6/".encode()))
    old_engine = tiny_engine()
    old = CheckpointManager(str(tmp_path / "old"), old_engine, World(), remote=remote,
                            storage_options=options(proxy), keep_last_k=keep)  # fmt: skip
    save(old, old_engine, 2)
    save(old, old_engine, 4)
    mark(old_engine, 6)
    old.save("step_6", 6, 0)  # in the background: its requests are refused, and retried
    assert proxy.refused.wait(60), "step_6's save never reached the store"

    # The job's new process, on another node, while the old one still retries step_6.
    new_engine = tiny_engine(seed=1)
    new = CheckpointManager(str(tmp_path / "new"), new_engine, World(), remote=remote,
                            storage_options=options(proxy), keep_last_k=keep)  # fmt: skip
    assert_resumes(new, remote, 4)
    save(new, new_engine, 8)
    save(new, new_engine, 10)
    assert old.busy(), "step_6 should still be retrying"
    assert committed(s3, prefix) == (["step_8", "step_10"] if keep else ["step_2", "step_4", "step_8", "step_10"])

    proxy.allow()
    old.wait()
    assert old.results[-1].tag == "step_6" and old.results[-1].error is None, old.results[-1]
    # Its own retention kept it (it never deletes what it just committed) and pruned nothing newer.
    assert committed(s3, prefix) == (["step_6", "step_8", "step_10"] if keep else ["step_2", "step_4", "step_6",
                                                                                     "step_8", "step_10"])  # fmt: skip
    if keep:
        assert any("checkpoint step_6 committed after 2 newer ones (step_10, step_8)" in line for line in bigclip_log)
    node = CheckpointManager(str(tmp_path / "node"), tiny_engine(seed=2), World(), remote=remote,
                             storage_options=options(proxy))  # fmt: skip
    assert listed(node)[:3] == ["step_10", "step_8", "step_6"]
    assert_resumes(node, remote, 10)

    save(new, new_engine, 12)  # the next commit prunes step_6 and step_8 (older), never step_10
    assert committed(s3, prefix) == (["step_10", "step_12"] if keep else ["step_2", "step_4", "step_6", "step_8",
                                                                          "step_10", "step_12"])  # fmt: skip
    for manager in (old, new, node):
        manager.close()


def test_step_then_epoch_ranks_every_listing_whatever_the_commit_order(tmp_path, bigclip_log):
    """No store: the epoch's checkpoint and a step save at the same step (the epoch's is the later state), an
    alias of the epoch's, and an older step committed last; latest, the listing and --keep-last-k 2 agree."""
    ckpts = tmp_path / "checkpoints"
    engine = tiny_engine()
    manager = CheckpointManager(str(ckpts), engine, World(), keep_last_k=2, async_mode="off")
    save(manager, engine, 12, epoch=1, tag="epoch_1", aliases=["epoch_latest"])
    save(manager, engine, 12, epoch=0)  # step_12: same step, the epoch before
    save(manager, engine, 11, epoch=0)  # step_11: committed last, oldest
    ranked = listed(manager)
    assert ranked == ["epoch_1", "epoch_latest", "step_12", "step_11"]
    assert manager.latest() == str(ckpts / "epoch_1")
    assert any("checkpoint step_11 committed after 2 newer ones (epoch_1, step_12)" in line for line in bigclip_log)

    save(manager, engine, 13, epoch=1, aliases=["epoch_latest"])
    assert listed(manager) == ["step_13", "epoch_latest", "epoch_1"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch_1", "epoch_latest", "step_13"]
    node = CheckpointManager(str(ckpts), tiny_engine(seed=1), World())
    location, manifest = node.resume("latest")
    assert location == str(ckpts / "step_13") and torch.all(first_weight(node.engine) == 13)
    manager.close()
    node.close()


def test_a_late_commit_behind_more_than_k_newer_ones_prunes_nothing_newer_than_itself(tmp_path, bigclip_log):
    """No store: step_8, step_10 and step_12 are committed by a writer keeping all; another writer with
    --keep-last-k 2 then commits step_6. Pruning the third newest (step_8) while keeping the older step_6 would
    prune something newer for something older: nothing is deleted until a newer checkpoint commits, and then only
    what is older than the 2 newest."""
    ckpts = tmp_path / "checkpoints"
    engine = tiny_engine()
    keeps_all = CheckpointManager(str(ckpts), engine, World(), async_mode="off")
    for step in (8, 10, 12):
        save(keeps_all, engine, step)
    keeps_2 = CheckpointManager(str(ckpts), engine, World(), keep_last_k=2, async_mode="off")
    save(keeps_2, engine, 6)
    assert listed(keeps_2) == ["step_12", "step_10", "step_8", "step_6"]
    assert any(
        "checkpoint step_6 committed after 3 newer ones (step_12, step_10, step_8)" in line for line in bigclip_log
    )
    save(keeps_2, engine, 14)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_12", "step_14"]
    assert keeps_2.latest() == str(ckpts / "step_14")
    keeps_all.close()
    keeps_2.close()
