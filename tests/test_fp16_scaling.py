"""The fp16 loss-scaling paths, run on CPU where torch supports them.

`--precision amp` means fp16 autocast + dynamic loss scaling on GPU (bf16 on CPU, which needs no scaling), so
on this machine the engines' scaling code is reached by giving them the GPU meaning of `amp`: CPU autocast
runs float16, torch's GradScaler and FSDP's ShardedGradScaler accept the CPU device. Checked: normal steps
update the weights; a step whose gradients overflow leaves every weight (and the optimizer state) untouched
and halves the scale, as OpenCLIP's GradScaler does; training then goes on. DeepSpeed's fp16 optimizer is not
here: DeepSpeed's CPU accelerator does not support fp16 (is_fp16_supported() is falsy), so it stays GPU-only.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from helpers import free_port
from torch.distributed.tensor import DTensor

import bigclip.engine.base as engine_base
from bigclip.build import build_loss_fn
from bigclip.config import resolve
from bigclip.dist import World, init_distributed, shutdown
from bigclip.engine import build_engine, build_model
from bigclip.loop import forward_backward, optimizer_step
from bigclip.model import create_model
from bigclip.precision import Precision


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    texts = torch.randint(1, 250, (4, 16), generator=g)
    texts[:, -1] = 258
    return torch.randn(4, 3, 16, 16, generator=g), texts


@pytest.fixture
def fp16_amp(monkeypatch):
    """--precision amp with its GPU meaning: float16 autocast and dynamic loss scaling."""
    real = engine_base.resolve_precision

    def gpu_meaning(name, device):
        return Precision(name, torch.float16, torch.float32, True) if name == "amp" else real(name, device)

    monkeypatch.setattr(engine_base, "resolve_precision", gpu_meaning)


@pytest.fixture
def one_rank_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    world = init_distributed("cpu", "gloo")
    if not dist.is_initialized():  # one process: bigclip runs without a group; FSDP needs one
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield world
    shutdown()


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("engine_name", ["ddp", "fsdp"])
def test_fp16_loss_scaling_skips_overflowing_steps_on_cpu(fp16_amp, one_rank_group, engine_name):
    world = one_rank_group
    assert isinstance(world, World)
    cfg = resolve(dict(model="test-tiny", dataset_type="synthetic", precision="amp", engine=engine_name))
    torch.manual_seed(0)
    engine = build_engine(
        cfg.sections.engine,
        build_model(cfg.sections.engine, world, functools.partial(create_model, "test-tiny")),
        world,
    )
    expected = "ShardedGradScaler" if engine_name == "fsdp" else "GradScaler"
    assert type(engine.scaler).__name__ == expected
    loss_fn = build_loss_fn(cfg.sections.loss, world)
    engine.set_lr(1e-3)

    # The scale starts at 2^16: the first steps may overflow in fp16 and are skipped with the scale halved,
    # until one updates the weights.
    moved = False
    for step in range(20):
        before, scale = weights(engine), engine.scaler.get_scale()
        loss, _ = forward_backward(engine, loss_fn, [batch(step)], world)
        optimizer_step(engine)
        assert torch.isfinite(torch.tensor(loss))
        moved = any(not torch.equal(before[n], p) for n, p in weights(engine).items())
        assert engine.scaler.get_scale() == (scale if moved else scale / 2)
        if moved:
            break
    assert moved and step < 19
    scale = engine.scaler.get_scale()
    optimizer_state = {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)}
                       for k, s in engine.optimizer.state.items()}  # fmt: skip

    before = weights(engine)
    forward_backward(engine, loss_fn, [batch(2)], world)
    grad = next(p for p in engine.model.parameters() if p.grad is not None).grad
    # The inf goes into the local shard: on torch 2.9 an in-place write through a DTensor's view (FSDP2's
    # gradients) lands in a copy and the shard keeps its finite values; 2.11 and later write through.
    (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
    optimizer_step(engine)  # the scaler finds the inf and skips the update
    assert all(torch.equal(before[n], p) for n, p in weights(engine).items())
    for k, s in engine.optimizer.state.items():
        for n, v in optimizer_state[k].items():
            assert torch.equal(s[n], v), n
    assert engine.scaler.get_scale() == scale / 2

    loss, _ = forward_backward(engine, loss_fn, [batch(30)], world)  # and training goes on
    optimizer_step(engine)
    assert any(not torch.equal(before[n], p) for n, p in weights(engine).items())
