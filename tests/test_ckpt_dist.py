"""Checkpoints on 2 gloo ranks: SIGKILL of one rank then --resume latest, save/resume round trips for DDP,
FSDP2 and DeepSpeed ZeRO-2/3 (the save runs in the background while training goes on), and resuming those
checkpoints at world size 1 and 4 (resharding) with the losses of the uninterrupted 2-rank run."""

import glob
import json
import os
import signal
import subprocess
import textwrap

import pytest
import torch
from helpers import (
    REPO,
    TINY_SYNTHETIC,
    TRAIN_SCRIPT,
    child_pids,
    launch,
    read_metrics,
    sigkill_job,
    subprocess_env,
    torchrun_cmd,
    wait_for_step,
)

from bigclip.ckpt import CheckpointManager, verify
from bigclip.config import resolve
from bigclip.dist import World
from bigclip.engine import build_engine
from bigclip.model import create_model
from bigclip.model.convert import bigclip_to_openclip

pytestmark = pytest.mark.slow


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def _torchrun(args, cwd):
    # No --logs flag: torch 2.14's torchrun rejects any "--logs" after the script as an abbreviation of its
    # own --logs-specs, so the run writes to the default ./logs/ under cwd.
    cmd = torchrun_cmd(2, TRAIN_SCRIPT, *args)
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=subprocess_env(),
        start_new_session=True,
    )


def _losses_by_occurrence(run_dir):
    first, second = {}, {}
    for r in read_metrics(run_dir):
        if "loss" in r:
            (second if r["step"] in first else first)[r["step"]] = r["loss"]
    return first, second


# DeepSpeed's layout (its files are written by each rank, then committed); the DCP layout's resume after a
# SIGKILL is checked with the whole job killed (tests/test_data_resume.py, tests/test_ckpt_faults.py), and
# every engine's by the round trips below.
ENGINE_FLAGS = {"zero2": ["--ds_config", os.path.join(REPO, "ds_configs", "zero2.json")]}


# Extended tier: 5-10 min of DeepSpeed checkpoints; in CI a SIGKILL resume of the DCP layout (test_data_resume.py) and
# every engine's checkpoint round trip (test_contracts.py)
@pytest.mark.extended
@pytest.mark.parametrize("engine", list(ENGINE_FLAGS))
def test_sigkill_one_rank_then_resume_latest_gives_the_same_losses(tmp_path, engine):
    """Rank 1 is SIGKILLed mid-run (a checkpoint may be half written). The restarted run resumes from the
    last committed checkpoint and recomputes the steps after it with exactly the losses the killed run had."""
    # 320 samples / (8 x 2 ranks) = 20 steps per epoch, 40 in all; a checkpoint every 4 steps and at the epoch's end.
    flags = [
        *TINY_SYNTHETIC,
        "--train-num-samples",
        "320",
        "--save-every-n-steps",
        "4",
        "--name",
        "killed",
        *ENGINE_FLAGS[engine],
    ]
    run_dir = os.path.join(tmp_path, "logs", "killed")
    proc = _torchrun(flags, tmp_path)
    # Step 13 logged: step_12 may still be saving, so the last committed checkpoint is at most step 12 and the
    # kill lands after it (a quick machine or a loaded one alike); 27 steps are left, so it lands mid-run.
    wait_for_step(run_dir, 13, proc, timeout=900)
    victims = [pid for pid in child_pids(proc.pid) if _rank_of(pid) == 1]
    assert victims, "rank 1 not found"
    os.kill(victims[0], signal.SIGKILL)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        sigkill_job(proc)  # what is left of the job dies too
    killed_out = proc.stdout.read()
    assert proc.returncode != 0, killed_out[-2000:]
    killed_at = max(r["step"] for r in read_metrics(run_dir) if "loss" in r)
    assert killed_at < 40, "the kill should land mid-run"
    # What the killed job left committed, read once every process is gone (a save deferred behind a slow one takes
    # the step it reaches, so not always a multiple of 4): latest must be the newest of them.
    manifests = glob.glob(os.path.join(run_dir, "checkpoints", "*", "manifest.json"))
    newest = max(json.load(open(m))["step"] for m in manifests)

    resumed = _torchrun([*flags, "--resume", "latest"], tmp_path)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    line = next(x for x in out.splitlines() if "resumed from" in x)
    resumed_at = int(line.rsplit("step ", 1)[1])
    assert resumed_at == newest >= 4
    first, second = _losses_by_occurrence(run_dir)
    overlap = [s for s in range(resumed_at + 1, killed_at + 1)]
    assert overlap, (resumed_at, killed_at)
    for step in overlap:  # the killed run's losses, recomputed after the restart
        assert second[step] == pytest.approx(first[step], rel=1e-6, abs=1e-7), step
    assert max(first) == 40 or max(second) == 40


def test_sigterm_to_torchrun_stops_both_ranks_with_one_final_checkpoint(tmp_path):
    """SIGTERM to the torchrun agent (what a scheduler sends): it forwards the notice to both ranks, which agree
    on the step, save one final checkpoint together and stop; --resume latest continues from it to the end.
    (That a resumed run reproduces the uninterrupted losses is checked by the SIGKILL tests above.)"""
    flags = [*TINY_SYNTHETIC, "--train-num-samples", "640", "--epochs", "1", "--lr-scheduler", "const",
             "--name", "sig"]  # fmt: skip
    run_dir = os.path.join(tmp_path, "logs", "sig")
    proc = _torchrun(flags, tmp_path)
    assert wait_for_step(run_dir, 5, proc, timeout=900)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=900)
    stopped = max(r["step"] for r in read_metrics(run_dir) if "loss" in r)
    assert 5 <= stopped < 40, stopped
    said = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(said) == 1 and f"at step {stopped}: checkpoint step_{stopped} committed" in said[0], out[-3000:]
    manifest = json.loads(open(os.path.join(run_dir, "checkpoints", f"step_{stopped}", "manifest.json")).read())
    assert manifest["world_size"] == 2 and manifest["step"] == stopped
    assert "Traceback" not in out.split("stopped by SIGTERM")[0]  # bigclip's ranks stopped cleanly

    resumed = _torchrun([*flags, "--resume", "latest"], tmp_path)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, 41)), steps  # the resumed run took up exactly after the final checkpoint


WORKER = r'''
"""torchrun worker: for each engine, train 2 steps, save asynchronously, train 2 more while the save runs,
then build a fresh engine (other seed), resume 'latest' and train the same 2 steps: losses must match."""
import copy, json, os, sys, functools
import torch
from bigclip.config import resolve
from bigclip.dist import init_distributed
from bigclip.engine import build_engine, build_model
from bigclip.model import create_model
from bigclip.loop import forward_backward, optimizer_step
from bigclip.build import build_loss_fn
from bigclip.ckpt import CheckpointManager
from bigclip.ckpt.rng import RankRNG
from bigclip.model.convert import bigclip_to_openclip

def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    texts = torch.randint(1, 250, (4, 16), generator=g)
    texts[:, -1] = 258
    return torch.randn(4, 3, 16, 16, generator=g), texts

def train(engine, loss_fn, world, steps, before_update=lambda: None):
    losses = []
    for step in steps:
        engine.set_lr(1e-3)
        loss, _ = forward_backward(engine, loss_fn, [batch(step, world.rank)], world)
        before_update()  # what the loop does: an asynchronous save finishes copying before the update
        optimizer_step(engine)
        losses.append(mean_over_ranks(loss))
    return losses

def mean_over_ranks(loss):
    # With --local-loss each rank's loss covers its own rows; their mean is the loss of the global batch.
    t = torch.tensor([loss], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()

def full_model(engine):  # collective: every rank calls it
    if engine.name == "deepspeed":
        import deepspeed
        params = dict(engine.ds.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):  # whole ZeRO-3 parameters
            return {n: p.detach().clone() for n, p in params.items()}
    out = {}
    for name, p in engine.model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out

def main():  # the process writer's daemon re-imports __main__: nothing may run at import
    spec, out_path, root = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
    world = init_distributed("cpu", "gloo")
    results = {}
    for name, config in spec.items():
        # --local-loss --gather-with-grad: the gradient is that of the global batch's loss at any world size,
        # so a resharded resume (test below) can be compared step by step with this run.
        cfg = resolve({"dataset_type": "synthetic", "precision": "fp32", "model": "test-tiny", "batch_size": 4,
                       "lr": 1e-3, "wd": 0.1, "seed": 0, "workers": 0, "local_loss": True,
                       "gather_with_grad": True, **config})
        directory = os.path.join(root, name)
        torch.manual_seed(0)
        engine_cfg = cfg.sections.engine
        a = build_engine(engine_cfg, build_model(engine_cfg, world, functools.partial(create_model, cfg.model)), world)
        loss_fn = build_loss_fn(cfg.sections.loss, world)
        train(a, loss_fn, world, range(2))
        full = cfg.fsdp_checkpoint == "full"  # the consolidated OpenCLIP weights in each checkpoint too
        manager = CheckpointManager(directory, a, world, async_mode=cfg.checkpoint_async,
                                    consolidated_names=bigclip_to_openclip if full else None,
                                    participants={"rng": RankRNG()})
        manager.save("step_2", step=2, epoch=0)
        manager.wait_staged()
        snapshot = full_model(a)
        after_a = train(a, loss_fn, world, range(2, 4), manager.wait_staged)  # while the save runs
        writer = manager.mode
        manager.close()
        torch.manual_seed(1)
        engine_cfg = cfg.sections.engine
        b = build_engine(engine_cfg, build_model(engine_cfg, world, functools.partial(create_model, cfg.model)), world)
        manager = CheckpointManager(directory, b, world)
        location, manifest = manager.resume("latest")
        after_b = train(b, loss_fn, world, range(2, 4))
        results[name] = {"a": after_a, "b": after_b, "location": location, "step": manifest.step,
                         "writer": writer}
        if name == "zero2":  # DeepSpeed's files are written after staging, from copies training cannot touch
            import glob
            from concurrent.futures import ThreadPoolExecutor
            from bigclip.ckpt.upload import FileSink
            layout, target = manager.layout, os.path.join(root, "staged", "step_x")
            os.makedirs(target, exist_ok=True)
            masters = [t.clone() for t in b.ds.optimizer.single_partition_of_fp32_groups]
            staged = layout.stage(target)
            written_early = glob.glob(os.path.join(target, "engine_state", "*optim_states.pt"))
            train(b, loss_fn, world, range(4, 5), staged.result)  # the copy lands, then the update moves masters
            layout.write(staged, target, FileSink(target, None, ThreadPoolExecutor(1)))
            path, = glob.glob(os.path.join(target, "engine_state", f"zero_pp_rank_{world.rank}_*optim_states.pt"))
            saved = torch.load(path, weights_only=False)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
            results[name]["staging"] = {"written_early": written_early,
                                        "saved_equals_staged": all(torch.equal(x, y) for x, y in zip(saved, masters)),
                                        "masters_moved": not all(
                                            torch.equal(x, y)
                                            for x, y in zip(b.ds.optimizer.single_partition_of_fp32_groups, masters))}
        if world.rank == 0:
            torch.save(snapshot, os.path.join(root, name + "_step2_model.pt"))
        manager.close()
    if world.rank == 0:
        json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main()
'''


RESHARD_WORKER = r'''
"""torchrun worker at another world size: load the step_2 checkpoints the 2-rank WORKER wrote and train its
steps 2 and 3 on the same global batches (split over this world size). The losses must be the 2-rank run's."""
import functools, json, os, sys
import torch
from bigclip.config import resolve
from bigclip.dist import init_distributed
from bigclip.engine import build_engine, build_model
from bigclip.model import create_model
from bigclip.loop import forward_backward, optimizer_step
from bigclip.build import build_loss_fn
from bigclip.ckpt import CheckpointManager
from bigclip.ckpt.rng import RankRNG
from bigclip.errors import UserError
from bigclip.run.console import setup_console_logging

def batch(step, rank):  # the 2-rank run's batches
    g = torch.Generator().manual_seed(1000 * step + rank)
    texts = torch.randint(1, 250, (4, 16), generator=g)
    texts[:, -1] = 258
    return torch.randn(4, 3, 16, 16, generator=g), texts

def my_share(step, world):
    images, texts = (torch.cat(x) for x in zip(batch(step, 0), batch(step, 1)))
    n = 8 // world.world_size
    return images[world.rank * n:(world.rank + 1) * n], texts[world.rank * n:(world.rank + 1) * n]

def mean_over_ranks(loss, world):
    if world.world_size == 1:
        return loss
    t = torch.tensor([loss], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / world.world_size

spec, out_path, root = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
world = init_distributed("cpu", "gloo")
setup_console_logging(None, world.rank == 0, False)  # rank 0's info lines on stdout, as in a run
results = {}
for name, config in spec.items():
    config = dict(config)
    source = config.pop("checkpoint", name)  # whose step_2 to load (default: this entry's own)
    cfg = resolve({"dataset_type": "synthetic", "precision": "fp32", "model": "test-tiny",
                   "batch_size": 8 // world.world_size, "lr": 1e-3, "wd": 0.1, "seed": 0, "workers": 0,
                   "local_loss": True, "gather_with_grad": True, **config})
    torch.manual_seed(7)
    engine_cfg = cfg.sections.engine
    engine = build_engine(engine_cfg, build_model(engine_cfg, world, functools.partial(create_model, cfg.model)), world)
    loss_fn = build_loss_fn(cfg.sections.loss, world)
    manager = CheckpointManager(os.path.join(root, f"ws{world.world_size}", name), engine, world,
                                participants={"rng": RankRNG()})
    try:
        manifest = manager.load(os.path.join(root, source, "step_2"))
    except UserError as e:
        results[name] = {"error": str(e)}
        continue
    losses = []
    for step in (2, 3):
        engine.set_lr(1e-3)
        loss, _ = forward_backward(engine, loss_fn, [my_share(step, world)], world)
        optimizer_step(engine)
        losses.append(mean_over_ranks(loss, world))
    manager.close()
    results[name] = {"step": manifest.step, "losses": losses}
if world.rank == 0:
    json.dump(results, open(out_path, "w"))
'''


# Extended tier: 3 min; in CI every engine's round trip (test_contracts.py) and resharding to two ranks
# (test_optim8bit.py, test_ema.py)
@pytest.mark.extended
def test_round_trips_on_two_ranks_and_resharded_load(tmp_path):
    ds = os.path.join(REPO, "ds_configs")
    spec = {
        "ddp": {"engine": "ddp"},
        "fsdp": {"engine": "fsdp", "fsdp_checkpoint": "full"},
        "ddp_process_writer": {"engine": "ddp", "checkpoint_async": "process"},
        "fsdp_process_writer": {"engine": "fsdp", "checkpoint_async": "process", "fsdp_checkpoint": "full"},
        "ddp_async_off": {"engine": "ddp", "checkpoint_async": "off"},
        "zero1": {"ds_config": os.path.join(ds, "zero1.json")},
        "zero2": {"ds_config": os.path.join(ds, "zero2.json"), "fsdp_checkpoint": "full"},
        "zero3": {"ds_config": os.path.join(ds, "zero3.json"), "fsdp_checkpoint": "full"},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    args = [str(tmp_path / "spec.json"), str(tmp_path / "out.json"), str(tmp_path)]
    proc = launch(str(tmp_path / "worker.py"), args, 420, nproc=2, DS_ACCELERATOR="cpu")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for name, r in results.items():
        assert r["step"] == 2 and r["location"].endswith("step_2"), name
        assert r["b"] == pytest.approx(r["a"], rel=1e-6, abs=1e-7), name  # resumed == uninterrupted
        manifest = json.loads((tmp_path / name / "step_2" / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and manifest["engine"] == (
            "deepspeed" if "zero" in name else spec[name]["engine"]
        )
        assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(manifest["files"])
    assert results["ddp_process_writer"]["writer"] == results["fsdp_process_writer"]["writer"] == "process"
    assert results["ddp"]["writer"] == results["fsdp"]["writer"] == "thread"
    assert results["ddp_async_off"]["writer"] == "off"
    assert results["zero2"]["staging"] == {"written_early": [], "saved_equals_staged": True, "masters_moved": True}
    ddp_files = json.loads((tmp_path / "ddp" / "step_2" / "manifest.json").read_text())["files"]
    assert any(f.startswith("__0_") for f in ddp_files) and any(f.startswith("__1_") for f in ddp_files)

    # Resharding: every engine's 2-rank checkpoint resumes at world size 1 and 4 (DCP reshards on load;
    # DeepSpeed's ZeRO files go through its universal checkpoint) and continues exactly like the 2-rank run.
    # A checkpoint of another ZeRO stage is refused with one line before DeepSpeed touches it.
    (tmp_path / "reshard.py").write_text(textwrap.dedent(RESHARD_WORKER))
    mismatch = {"ds_config": os.path.join(ds, "zero3.json"), "checkpoint": "zero2"}
    (tmp_path / "reshard_spec.json").write_text(json.dumps({**spec, "zero2_into_zero3": mismatch}))
    for nproc in (1, 4):
        out = tmp_path / f"reshard{nproc}.json"
        args = [str(tmp_path / "reshard_spec.json"), str(out), str(tmp_path)]
        proc = launch(str(tmp_path / "reshard.py"), args, 900, nproc=nproc, DS_ACCELERATOR="cpu")
        assert proc.returncode == 0, (nproc, (proc.stdout + proc.stderr)[-4000:])
        said = [line for line in proc.stdout.splitlines() if "saved by 2 ranks, resumed on" in line]
        assert len(said) == len(spec) and all(f"resumed on {nproc}; rng from the same rank's file" in x for x in said)
        assert all(("(ranks 2+ start afresh)" in x) == (nproc == 4) for x in said), said
        resharded = json.loads(out.read_text())
        assert "saved with DeepSpeed ZeRO stage 2, this run uses stage 3" in resharded.pop("zero2_into_zero3")["error"]
        for name, r in resharded.items():
            assert r["step"] == 2, (nproc, name)
            assert r["losses"] == pytest.approx(results[name]["a"], rel=1e-5), (nproc, name)

    # The DDP and FSDP checkpoints of 2 ranks also load in this very process (DDP engine, no process group).
    cfg = resolve(dict(model="test-tiny", dataset_type="synthetic", precision="fp32", batch_size=4))
    for name in ("ddp", "fsdp"):
        torch.manual_seed(5)
        engine = build_engine(cfg.sections.engine, create_model("test-tiny"), World())
        manifest = CheckpointManager(str(tmp_path / "ws1"), engine, World()).load(str(tmp_path / name / "step_2"))
        assert manifest.step == 2
        want = torch.load(tmp_path / f"{name}_step2_model.pt", weights_only=True)
        for pname, p in engine.model.named_parameters():
            assert torch.equal(p.detach(), want[pname]), (name, pname)
        assert all(s["step"].item() == 2 for s in engine.optimizer.state.values()), name

    # `bigclip export` consolidates any engine's checkpoint in one process, without its world size: FSDP's
    # shards and DeepSpeed's ZeRO-2/3 partitions give exactly the weights the run had at that step.
    from bigclip import cli

    for name in ("fsdp", "zero1", "zero2", "zero3"):
        want = torch.load(tmp_path / f"{name}_step2_model.pt", weights_only=True)
        out = tmp_path / f"{name}_export.pt"
        assert cli.main(["export", str(tmp_path / name / "step_2"), str(out), "--names", "bigclip"]) == 0
        got = torch.load(out, weights_only=True)
        assert set(got) == set(want), name
        for pname, value in want.items():
            assert torch.equal(got[pname].reshape(value.shape), value), (name, pname)

    # --fsdp-checkpoint full: the checkpoint itself holds the consolidated weights in OpenCLIP's names (listed in
    # its manifest, so verified and uploaded with it), exactly the run's weights at that step.
    for name, config in spec.items():
        files = json.loads((tmp_path / name / "step_2" / "manifest.json").read_text())["files"]
        assert ("openclip_state_dict.pt" in files) == (config.get("fsdp_checkpoint") == "full"), name
        if "openclip_state_dict.pt" not in files:
            continue
        verify(str(tmp_path / name / "step_2"))
        saved = torch.load(tmp_path / name / "step_2" / "openclip_state_dict.pt", weights_only=True)
        assert saved["step"] == 2 and saved["epoch"] == 0, name
        want = bigclip_to_openclip(torch.load(tmp_path / f"{name}_step2_model.pt", weights_only=True))
        assert "visual.conv1.weight" in want and set(want) <= set(saved["state_dict"]), name
        for key, value in want.items():
            assert torch.equal(saved["state_dict"][key].reshape(value.shape), value), (name, key)
