"""DCP's save-plan cache as bigclip's DCP layout uses it (bigclip/ckpt/dcp_layout.py, _CachedPlanner): on two gloo
ranks, consecutive saves reuse the plans (a rank whose plan is unchanged sends an empty one), and every checkpoint
still reads back exactly what was saved: after new values, after one rank's tensor changed dtype (which DCP's own
plan comparison does not see), after a tensor was added, and beside another layout's saves in the same processes."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import fork_ranks, free_port
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from bigclip.ckpt import dcp_layout


class _RecordingPlanner(dcp_layout._CachedPlanner):
    """The layout's planner, recording whether each local plan went to the coordinator (usable) or was reused."""

    sent: list[bool] = []

    def create_local_plan(self):
        plan = super().create_local_plan()
        _RecordingPlanner.sent.append(plan.usable)
        return plan


def _state(rank: int, save: int) -> dict[str, torch.Tensor]:
    """Rank r's share (as DDP's split gives each rank its own leaves) and one replicated tensor (DCP keeps one)."""
    g = torch.Generator().manual_seed(100 * save + rank)
    state = {f"rank{rank}.weight": torch.randn(6, 5, generator=g), "shared.step": torch.tensor(float(save))}
    if save >= 3 and rank == 0:
        state["rank0.weight"] = state["rank0.weight"].to(torch.bfloat16)  # same shape, another dtype
    if save >= 4 and rank == 1:
        state["rank1.extra"] = torch.arange(7, dtype=torch.int64) * save  # a tensor the cached plan lacks
    return state


def _saves_worker(rank: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    try:
        for save in (1, 2, 3, 4):
            for key in ("layout-a", "layout-b"):  # two layouts' caches side by side in the same processes
                planner = _RecordingPlanner(key)
                writer = FileSystemWriter(f"{root}/{key}/{save}", single_file_per_rank=True)
                dcp.save(_state(rank, save), storage_writer=writer, planner=planner, process_group=group)
        torch.save(_RecordingPlanner.sent, f"{root}/sent{rank}.pt")
    finally:
        for key in ("layout-a", "layout-b"):
            dcp_layout.forget_plans(key)
        dist.destroy_process_group()


def _read(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in one process, shaped and typed as its metadata says."""
    metadata = FileSystemReader(directory).read_metadata()
    out = {k: torch.zeros(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    dcp.load(out, storage_reader=FileSystemReader(directory), no_dist=True)
    return out


def test_cached_plans_are_reused_and_every_checkpoint_reads_back_what_was_saved(tmp_path):
    fork_ranks(_saves_worker, (free_port(), str(tmp_path)), 2)
    for key in ("layout-a", "layout-b"):
        for save in (1, 2, 3, 4):
            want = {**_state(0, save), **_state(1, save)}
            got = _read(str(tmp_path / key / str(save)))
            assert set(got) == set(want), (key, save)
            for name, value in want.items():
                assert got[name].dtype == value.dtype, (key, save, name)
                assert torch.equal(got[name], value), (key, save, name)
    # Per rank, in order: (save 1: a, b), (save 2: a, b), ...: sent on the first save of each layout; reused on
    # the second; rank 0 sends again at save 3 (its dtype changed), rank 1 at save 4 (its new tensor), and each
    # layout's plans are its own (b reuses after a saved a different directory with the same planner class).
    sent = [torch.load(tmp_path / f"sent{rank}.pt") for rank in (0, 1)]
    assert sent[0] == [True, True, False, False, True, True, False, False]
    assert sent[1] == [True, True, False, False, False, False, True, True]


def test_a_closed_layout_leaves_nothing_in_dcps_class_level_cache():
    from torch.distributed.checkpoint.planner import SavePlanner

    from bigclip.ckpt.dcp_layout import _PLAN_CACHES, _PLAN_DTYPES, forget_plans

    key = "layout-closed"
    for name in _PLAN_CACHES:
        getattr(SavePlanner, name)[key] = object()
    _PLAN_DTYPES[key] = {}
    forget_plans(key)
    assert all(key not in getattr(SavePlanner, name) for name in _PLAN_CACHES) and key not in _PLAN_DTYPES
