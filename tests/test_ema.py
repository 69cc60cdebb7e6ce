"""--ema-decay through real runs: the moving average is saved in checkpoints, continues exactly on resume,
reshards from FSDP2 shards on two ranks to one process, starts from the resumed weights when a checkpoint holds
none, is evaluated with --eval-ema and exported with `bigclip export --ema`; under DeepSpeed ZeRO-3 the average of
each rank's fp32 master partition does the same (exact resume on two ranks, resharded to one process, --eval-ema
across ranks). (That the average is the float64 average of the weights step by step, under DDP, FSDP2,
--optimizer-in-backward and DeepSpeed ZeRO-1/2/3, is checked in test_engine_multiprocess.py.)"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import pytest
import torch
from helpers import REPO, TINY_SYNTHETIC, python_train, read_metrics, step_losses, torchrun
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from bigclip import cli
from bigclip.model import create_model

pytestmark = pytest.mark.slow

# a constant schedule: a run cut after epoch 1 has the learning rates of the longer run it is compared with
EMA = ["--ema-decay", "0.8", "--batch-size", "8", "--gather-with-grad", "--lr-scheduler", "const"]


def export(tmp_path, run: str, tag: str, *flags: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{run}-{tag}{'-'.join(flags)}.pt"
    assert cli.main(["export", str(tmp_path / run / "checkpoints" / tag), str(out), "--names", "bigclip", *flags]) == 0
    return torch.load(out)


def resumed_from_epoch_1(run, tmp_path, common: list[str], name: str = "whole", **env):
    """The run `name` (2 epochs, a checkpoint after each) resumed from its epoch-1 checkpoint as run "cut"."""
    resume = str(tmp_path / name / "checkpoints" / "epoch_1")
    rest = run([*common, "--name", "cut", "--epochs", "2", "--resume", resume], **env)
    assert rest.returncode == 0, rest.stderr[-3000:]


def two_ranks_resume_the_average_exactly(tmp_path, common: list[str], **env) -> dict[str, torch.Tensor]:
    """Two ranks train 2 epochs ("whole") and resume from its epoch-1 checkpoint ("cut"): the epoch-2 averages are
    equal bit for bit and are not the weights. Returns the average."""
    whole = torchrun(2, [*common, "--name", "whole", "--epochs", "2"], **env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed_from_epoch_1(lambda args, **e: torchrun(2, args, **e), tmp_path, common, **env)
    average, resumed = export(tmp_path, "whole", "epoch_2", "--ema"), export(tmp_path, "cut", "epoch_2", "--ema")
    assert average.keys() == resumed.keys() and all(torch.equal(average[k], resumed[k]) for k in average)
    weights = export(tmp_path, "whole", "epoch_2")
    assert weights.keys() == average.keys()
    assert max(float((weights[k] - average[k]).abs().max()) for k in weights) > 1e-4  # not the weights
    return average


def test_the_average_resumes_exactly_reshards_and_exports(tmp_path):
    base = [*TINY_SYNTHETIC, *EMA, "--logs", str(tmp_path), "--save-frequency", "1"]
    common = [*base, "--ema-warmup"]
    whole = python_train([*common, "--name", "whole", "--epochs", "2"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed_from_epoch_1(python_train, tmp_path, common)
    average = export(tmp_path, "whole", "epoch_2", "--ema")
    resumed = export(tmp_path, "cut", "epoch_2", "--ema")
    assert average.keys() == resumed.keys()
    assert all(torch.equal(average[k], resumed[k]) for k in average)  # the same average, bit for bit
    weights = export(tmp_path, "whole", "epoch_2")
    assert weights.keys() == average.keys()
    assert max(float((weights[k] - average[k]).abs().max()) for k in weights) > 1e-4  # not the weights

    # FSDP2 on two ranks keeps the average of its shards; one process resumes it (resharded). With a decay of
    # almost 1 from there on, the resumed run's average stays what the two ranks saved (not the weights)
    sharded = torchrun(2, [*common, "--name", "sharded", "--epochs", "1", "--engine", "fsdp", "--batch-size", "4"])
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    one = python_train([*base, "--name", "sharded", "--epochs", "2", "--resume", "latest", "--ema-decay", "0.9999999"])
    assert one.returncode == 0, one.stderr[-3000:]
    saved, continued = export(tmp_path, "sharded", "epoch_1", "--ema"), export(tmp_path, "sharded", "epoch_2", "--ema")
    weights = export(tmp_path, "sharded", "epoch_1")
    assert max(float((saved[k] - continued[k]).abs().max()) for k in saved) < 1e-6
    assert max(float((saved[k] - weights[k]).abs().max()) for k in saved) > 1e-4
    # and the two ranks' average is the one process's, up to the runs' own float differences
    reference = export(tmp_path, "whole", "epoch_1", "--ema")
    assert max(float((saved[k] - reference[k]).abs().max()) for k in saved) < 1e-3


@pytest.mark.extended  # in CI the EMA steps under every engine alike (test_engine_multiprocess.py)
def test_deepspeed_keeps_the_average_of_its_partitions_resumes_reshards_and_evaluates_it(tmp_path):
    zero3 = ["--ds_config", os.path.join(REPO, "ds_configs", "zero3.json")]
    base = [*TINY_SYNTHETIC, *EMA, "--logs", str(tmp_path), "--save-frequency", "1", *zero3]
    # --batch-size 4 per rank: the global batch of the one-process runs; --eval-ema swaps the average in on 2 ranks
    common = [*base, "--ema-warmup", "--batch-size", "4", "--eval-ema", "--val-num-samples", "16"]
    env = {"DS_ACCELERATOR": "cpu"}
    two_ranks_resume_the_average_exactly(tmp_path, common, **env)
    evaluated = [r for r in read_metrics(str(tmp_path / "whole")) if "eval/val_loss" in r]
    assert len(evaluated) == 2 and all(r["eval/ema_val_loss"] != r["eval/val_loss"] for r in evaluated)

    # one process resumes the two ranks' partitions (DeepSpeed's universal checkpoint for the weights, the
    # average's fragments reassembled); with a decay of almost 1 from there on it stays what was saved; and
    # --eval-ema evaluates it (the validation loss of other weights than the live ones)
    one = python_train(
        [*base, "--name", "one", "--epochs", "2", "--resume", str(tmp_path / "whole" / "checkpoints" / "epoch_1"),
         "--ema-decay", "0.9999999", "--eval-ema", "--val-num-samples", "16"], **env,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    saved, continued = export(tmp_path, "whole", "epoch_1", "--ema"), export(tmp_path, "one", "epoch_2", "--ema")
    assert max(float((saved[k] - continued[k]).abs().max()) for k in saved) < 1e-6
    final = [r for r in read_metrics(str(tmp_path / "one")) if "eval/val_loss" in r][-1]
    assert final["eval/ema_val_loss"] != final["eval/val_loss"]


def test_eval_ema_under_fsdp2_evaluates_the_average_and_trains_on_as_without_it(tmp_path):
    """FSDP2 keeps the root module gathered after a forward no backward follows (an evaluation's): the swap met
    the gathered parameters instead of the shards (two ranks: it failed on their shapes, after an epoch of
    training), and the next forward reuses what the last evaluation gathered. Two ranks, two epochs with
    validation after each: the average's metrics are DDP's (the same weights, other reductions), and every step's
    loss is the one of the same run without --eval-ema, bit for bit."""
    # no checkpoints: a save's state dict reshards FSDP2's units, which would hide a gathered root
    base = [*TINY_SYNTHETIC, *EMA, "--batch-size", "4", "--val-num-samples", "16", "--save-frequency", "0",
            "--logs", str(tmp_path)]  # fmt: skip
    runs = {"fsdp": ["--engine", "fsdp", "--eval-ema"], "fsdp_live": ["--engine", "fsdp"], "ddp": ["--eval-ema"]}
    for name, flags in runs.items():
        out = torchrun(2, [*base, *flags, "--name", name])
        assert out.returncode == 0, (name, out.stderr[-3000:])
    losses = {name: step_losses(str(tmp_path / name)) for name in runs}
    assert len(losses["fsdp"]) == 16 and losses["fsdp"] == losses["fsdp_live"]
    evals = {name: [r for r in read_metrics(str(tmp_path / name)) if "eval/val_loss" in r] for name in runs}
    assert len(evals["fsdp"]) == 2
    for fsdp, ddp in zip(evals["fsdp"], evals["ddp"]):
        assert fsdp["eval/ema_val_loss"] != fsdp["eval/val_loss"]
        assert fsdp["eval/ema_val_loss"] == pytest.approx(ddp["eval/ema_val_loss"], rel=1e-4)


ZERO2 = ["--ds_config", os.path.join(REPO, "ds_configs", "zero2.json")]


# Extended tier (40 s each): in CI the EMA steps under every engine alike (test_engine_multiprocess.py) and FSDP2's
# two ranks' average resumed on one process (test above)
@pytest.mark.extended
@pytest.mark.parametrize("engine", [["--engine", "fsdp"], ZERO2])
def test_fsdp2_and_zero2_averages_resume_exactly_on_two_ranks(tmp_path, engine):
    """FSDP2 (each rank's shard of the average) and ZeRO-2 (each rank's fragments of its fp32 partition): resumed
    from the epoch-1 checkpoint on the same two ranks, the epoch-2 average equals the uninterrupted run's bit for
    bit."""
    common = [*TINY_SYNTHETIC, *EMA, "--logs", str(tmp_path), "--save-frequency", "1", "--batch-size", "4", *engine]
    two_ranks_resume_the_average_exactly(tmp_path, common, DS_ACCELERATOR="cpu")


def test_an_average_added_on_resume_starts_from_the_resumed_weights(tmp_path):
    common = [*TINY_SYNTHETIC, "--logs", str(tmp_path), "--name", "late", "--save-frequency", "1"]
    assert python_train([*common, "--epochs", "1"]).returncode == 0
    out = python_train([*common, *EMA, "--ema-warmup", "--epochs", "2", "--resume", "latest"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "holds no ema: it starts afresh" in (tmp_path / "late" / "out.log").read_text()
    start = export(tmp_path, "late", "epoch_1")
    average = export(tmp_path, "late", "epoch_2", "--ema")
    # the warm-up's first decays are small: the average follows the weights, starting from the resumed ones
    moved = export(tmp_path, "late", "epoch_2")
    assert max(float((moved[k] - average[k]).abs().max()) for k in start) < max(
        float((moved[k] - start[k]).abs().max()) for k in start
    )


def test_eval_ema_reports_the_averages_metrics_beside_the_live_ones(tmp_path):
    out = python_train(["--epochs", "1", "--ema-decay", "0.5", "--eval-ema", "--logs", str(tmp_path), "--name", "d"])
    assert out.returncode == 0, out.stderr[-3000:]
    final = [r for r in read_metrics(str(tmp_path / "d")) if "eval/zeroshot_top1" in r][-1]
    assert 0 <= final["eval/ema_zeroshot_top1"] <= 1 and final["eval/ema_num_samples"] == final["eval/num_samples"]
    assert final["eval/ema_val_loss"] != final["eval/val_loss"]  # other weights


def test_swapped_in_puts_the_average_in_and_the_live_weights_back():
    from bigclip.engine.ema import WeightsEMA

    model = create_model("test-tiny")
    ema = WeightsEMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()  # average = start + 0.5
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in():
        assert all(torch.allclose(p, live[n] - 0.5) for n, p in model.named_parameters())
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_in_exchanges_float32_weights_in_place_and_both_come_back_bit_for_bit(dtype):
    """While evaluating: the weights hold the average (rounded to their dtype), the average is intact after.
    float32 weights and the average exchange values tensor by tensor, so nothing the size of the model is
    allocated (the largest tensor's scratch at a time); other dtypes are stashed (host memory on an accelerator;
    here, on CPU, a copy)."""
    from bigclip.engine.ema import WeightsEMA

    torch.manual_seed(0)
    model = create_model("test-tiny").to(dtype)
    ema = WeightsEMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update()
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = {n: a.clone() for n, a in ema.params.items()}
    storages = {n: p.data_ptr() for n, p in model.named_parameters()}
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    with AllocatedBytes() as allocated, ema.swapped_in():
        pass
    with ema.swapped_in():
        assert all(torch.equal(p, average[n].to(dtype)) for n, p in model.named_parameters())
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == storages  # in place
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if dtype == torch.float32:
        assert allocated.peak <= largest < weights / 10
    else:
        assert allocated.peak >= weights  # CPU: the stash is a copy
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())
    assert all(torch.equal(ema.params[n], a) for n, a in average.items())


def test_a_swap_that_fails_halfway_puts_back_what_it_swapped(monkeypatch):
    """Swapping the fourth tensor fails (out of memory, say): the three already exchanged come back, so neither
    the weights the run goes on with nor the average it saves hold the other's values."""
    import bigclip.engine.ema as ema_module

    torch.manual_seed(0)
    model = create_model("test-tiny")
    ema = ema_module.WeightsEMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = {n: a.clone() for n, a in ema.params.items()}
    calls, exchange = [], ema_module.exchange

    def failing_once(a, b):
        calls.append(len(calls))
        if len(calls) == 4:
            raise RuntimeError("out of memory")
        exchange(a, b)

    monkeypatch.setattr(ema_module, "exchange", failing_once)
    with pytest.raises(RuntimeError, match="out of memory"), ema.swapped_in():
        pass
    assert len(calls) == 4 + 3  # three swapped in, the fourth failed, the three swapped back
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())
    assert all(torch.equal(ema.params[n], a) for n, a in average.items())


class AllocatedBytes(TorchDispatchMode):
    """The high-water mark of the bytes held by tensors that operations made inside the block (on any device):
    each output that owns new storage counts until it is freed."""

    def __enter__(self):
        self.live, self.peak = 0, 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                size = t.untyped_storage().nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, size)
        return out

    def _freed(self, size: int) -> None:
        self.live -= size


def test_eval_ema_waits_for_a_save_in_flight_before_swapping_the_average_in(tmp_path, monkeypatch):
    """A save at the epoch's last step copies the state in the background while the loop goes on to evaluate;
    --eval-ema writes the average into the weights (and the weights into the average's tensors). The copy is held
    until either the loop waits for it or the average is swapped in (then it runs to the end while swapped), so
    a loop that did not wait saves the average as the weights. The checkpoint must be the run's without
    --eval-ema."""
    from concurrent.futures import ThreadPoolExecutor

    from bigclip.ckpt.dcp_layout import DCPLayout
    from bigclip.ckpt.manager import CheckpointManager
    from bigclip.engine.ema import WeightsEMA

    flags = [*TINY_SYNTHETIC, *EMA, "--epochs", "1", "--save-every-n-steps", "8", "--save-frequency", "0",
             "--val-num-samples", "16", "--logs", str(tmp_path)]  # fmt: skip
    assert cli.main([*flags, "--name", "plain"]) == 0
    released, copied, pool = threading.Event(), threading.Event(), ThreadPoolExecutor(1)
    stage, wait_staged, swapped_in = DCPLayout.stage, CheckpointManager.wait_staged, WeightsEMA.swapped_in

    def held_stage(self, directory):
        def later():
            released.wait()
            staged = stage(self, directory).result()
            copied.set()
            return staged

        return pool.submit(later)

    def waiting(self):
        if self._staging is not None:
            released.set()
        wait_staged(self)

    @contextlib.contextmanager
    def swapping(self):
        with swapped_in(self):
            released.set()
            copied.wait()
            yield

    monkeypatch.setattr(DCPLayout, "stage", held_stage)
    monkeypatch.setattr(CheckpointManager, "wait_staged", waiting)
    monkeypatch.setattr(WeightsEMA, "swapped_in", swapping)
    assert cli.main([*flags, "--name", "swapping", "--eval-ema"]) == 0
    pool.shutdown()
    assert copied.is_set()
    for flag in ((), ("--ema",)):
        want, got = export(tmp_path, "plain", "step_8", *flag), export(tmp_path, "swapping", "step_8", *flag)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), flag


def test_the_plan_counts_the_average_where_the_engine_keeps_it():
    """4 bytes per parameter: whole under DDP, a shard under FSDP2 and DeepSpeed ZeRO (a fragment of each rank's
    fp32 master partition)."""
    from bigclip.memory import StateRecipe, state_bytes

    psi, n = 1_000_000, 8
    for setup, per_rank in (
        ("ddp", psi),
        ("fsdp", psi / n),
        ("zero1", psi / n),
        ("zero2", psi / n),
        ("zero3", psi / n),
    ):
        plain = state_bytes(setup, psi, n, StateRecipe("amp"))
        averaged = state_bytes(setup, psi, n, StateRecipe("amp", ema=True))
        assert averaged - plain == pytest.approx(4 * per_rank)


def test_the_update_converts_bf16_weights_a_window_at_a_time_with_the_same_result():
    """Pure bf16 weights: the float32 copies the update reads are made a window of tensors at a time and freed
    before the next window's (a float32 copy of every weight at once was 4 bytes per parameter beside the state);
    the average is bit for bit the one update over all tensors at once. float32 weights are read as they are."""
    import weakref

    from bigclip.engine.ema import float32_windows

    torch.manual_seed(0)
    shapes = [(40, 10), (300,), (7, 9), (500, 2), (3,), (250,)]
    weights = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    averages = [torch.randn(s) for s in shapes]
    pairs = list(zip(averages, weights))
    windows, alive, seen = [], [], []
    for window_averages, window_weights in float32_windows(pairs, limit=450):
        assert all(ref() is None for ref in alive), "the previous window's copies are still alive"
        assert all(w.dtype == torch.float32 for w in window_weights)
        windows.append([int(w.numel()) for w in window_weights])
        alive = [weakref.ref(w) for w in window_weights]
        seen += window_averages
    assert [a is b for a, b in zip(seen, averages)] == [True] * len(averages)
    # consecutive, in order, at most 450 values each but a larger tensor on its own
    assert windows == [[400], [300, 63], [1000], [3, 250]]
    expected = [a.clone() for a in averages]
    torch._foreach_lerp_(expected, [w.float() for w in weights], 0.25)
    for window_averages, window_weights in float32_windows(pairs, limit=450):
        torch._foreach_lerp_(window_averages, window_weights, 0.25)
    assert all(torch.equal(a, e) for a, e in zip(averages, expected))
    # float32 weights cost nothing to read: one window, the weights themselves
    fp32 = [w.float() for w in weights]
    ((_, read),) = list(float32_windows(list(zip(averages, fp32)), limit=450))
    assert all(r is w for r, w in zip(read, fp32))


def test_the_plan_counts_the_updates_float32_window_beside_the_state():
    """--ema-decay with pure bf16 weights: after the optimizer step, beside the whole state and the inputs, one
    window of float32 copies (or the largest tensor's); none with float32 weights (amp) or under DeepSpeed (its
    fp32 masters)."""
    from bigclip.engine.ema import UPDATE_WINDOW_VALUES
    from bigclip.memory import StateRecipe, model_facts, peak_parts

    facts = model_facts("ViT-L-14")
    lean = StateRecipe("pure_bf16", "adamw8bit", ema=True)
    ddp = peak_parts("ddp", facts, 8, lean, 4, True)
    window = max(UPDATE_WINDOW_VALUES, facts.largest_tensor)
    assert ddp["ema_update"] == ddp["state"] + ddp["inputs"] + 4 * window
    fsdp = peak_parts("fsdp", facts, 8, lean, 4, True)
    assert fsdp["ema_update"] == fsdp["state"] + fsdp["inputs"] + 4 * max(
        UPDATE_WINDOW_VALUES, facts.largest_tensor / 8
    )
    assert peak_parts("ddp", facts, 8, StateRecipe("amp", ema=True), 4, True)["ema_update"] == 0
    assert peak_parts("zero2", facts, 8, StateRecipe("pure_bf16", ema=True), 4, True)["ema_update"] == 0
    assert ddp["peak"] == ddp["ema_update"]  # DDP's leanest state, checkpointed: the average's window is the peak
