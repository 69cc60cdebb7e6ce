"""Runs several engines one after another inside one torchrun launch and records what each did.

    torchrun --nproc_per_node 2 tests/engine_worker.py SPEC.json OUT.json

SPEC is a list of runs: {"name", "steps", "config": {TrainConfig values}, "arch": optional architecture dict
registered under config["model"], "clamp_check": bool, "seed_per_rank": bool (each rank's own random stream after
the build, as train.py), "ranks_emulated": N (one process whose batch_size is the global batch of N ranks: rank r's
samples in rank order, as gathered features see them), "live_grads": bool (the most gradient bytes alive at once,
the largest block's, and how many storages hold the gradients), "step_sizes": bool (each parameter's largest
change in the first step, over the lr set: with AdamW's first step, wd 0 and a tiny eps, its lr scale),
"ema_check": bool (the moving average of --ema-decay against a float64 one of the whole weights after each step),
"teacher": bool (--distill-model/--distill-pretrained in config: the run's frozen teacher, placed by the engine,
feeds the loss; records whether its weights stayed as loaded, its mode, and how many of its elements this rank
holds), "mean_loss": bool (record the mean of the ranks' losses, not this rank's: where each rank's loss is its share
of the global one, as SigLIP's), "micro_grads": bool (after each micro-batch's backward: how many parameters have a
gradient, its local bytes, and the memory blocks holding them, so accumulation is seen between micro-batches; and
how many gradients each step left allocated)}.
Every run sees the same synthetic batches (seeded by step and rank) and goes through bigclip's own pieces:
engine.build_model, build_engine, the loop's forward_backward (OpenCLIP accumulation), engine.step, and an eval
forward through engine.module. One launch for many engines keeps the cost of process start-up and DeepSpeed
initialisation to once per test file."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from bigclip.build import build_loss_fn, build_model, build_teacher
from bigclip.config import resolve
from bigclip.dist import init_distributed, shutdown
from bigclip.engine import build_engine
from bigclip.engine.memory import peak_rss_bytes
from bigclip.loop import forward_backward, optimizer_step
from bigclip.model import get_model_config
from bigclip.model.switchback import INT8_MATMULS, reset_int8_matmuls
from bigclip.schedule import build_schedule


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs), so the next peak is this run's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def batch(step: int, rank: int, micro: int, n: int, image_size: int, context: int, vocab: int = 250):
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    images = torch.randn(n, 3, image_size, image_size, generator=g)
    texts = torch.randint(1, vocab, (n, context), generator=g)
    return images, texts


def run_one(spec: dict, world) -> dict:
    if "arch" in spec:  # a test-only architecture (e.g. ViT-bigG-14 widths, 2 blocks per tower)
        from bigclip.model.factory import _load_configs

        _load_configs()[spec["config"]["model"]] = spec["arch"]
    values = {
        "dataset_type": "synthetic",
        "precision": "fp32",
        "lr": 1e-3,
        "warmup": 2,
        "wd": 0.1,
        "gather_with_grad": True,
        "seed": 0,
        "workers": 0,
        **spec["config"],
    }
    cfg = resolve(values)
    arch = get_model_config(cfg.model)
    image_size = arch["vision_cfg"]["image_size"]
    context = arch["text_cfg"].get("context_length", 77)  # (a Hugging Face tower's tokenizer: OpenCLIP's 77)
    vocab = spec.get("text_vocab", 250)  # token ids drawn below this

    torch.manual_seed(cfg.seed)
    reset_peak_rss()
    rss0 = current_rss()
    t0 = time.perf_counter()
    model = build_model(
        cfg.sections.model, cfg.sections.engine, world
    )  # the run's own: the engine picks whole or meta; --pretrained applied
    engine = build_engine(cfg.sections.engine, model, world)
    build_s = time.perf_counter() - t0
    build_rss = peak_rss_bytes() - rss0  # the high-water mark while building, above what was there before
    build_state = engine.state_bytes()["total"]  # what the engine keeps: the rest of build_rss was transient
    if spec.get("compare_with_pretrained"):
        out_weights = compare_with_file(engine, cfg.pretrained)
    teacher = build_teacher(cfg.sections.model, cfg.sections.engine, world, engine) if spec.get("teacher") else None
    teacher_before = _local_weights(teacher) if teacher is not None else None
    loss_fn = build_loss_fn(cfg.sections.loss, world)
    # one schedule for every run, however many steps it takes, so shorter runs follow the longer ones
    schedule = build_schedule(cfg.sections.schedule, spec.get("schedule_steps", 20))

    out = {
        "losses": [],
        "norms": [],
        "build_s": build_s,
        "build_rss_bytes": build_rss,
        "build_state_bytes": build_state,
        "num_params": sum(p.numel() for p in engine.model.parameters()) if engine.name == "ddp" else None,
        # the optimizer that updates the weights (DeepSpeed's own where the JSON names one)
        "optimizer": type(getattr(getattr(engine, "ds", None), "basic_optimizer", None) or engine.optimizer).__name__,
    }
    if spec.get("compare_with_pretrained"):
        out["pretrained_check"] = out_weights
    if spec.get("clamp_check"):
        out["logit_scale_after"] = []
    frozen_before = _frozen(engine) if spec.get("frozen_check") else None
    before_first_step = _all_whole(engine) if spec.get("step_sizes") else None
    ema_reference = _EMAReference(engine) if spec.get("ema_check") else None
    live_grads = _LiveGradients(engine) if spec.get("live_grads") else None
    micro_grads = _MicroBatchGradients(engine) if spec.get("micro_grads") else None
    if spec.get("seed_per_rank"):
        torch.manual_seed(cfg.seed + world.rank)  # as train.py: each rank's own random stream from here on
    engine.train()
    reset_int8_matmuls()
    t0 = time.perf_counter()
    for step in range(spec["steps"]):
        engine.set_lr(schedule(step))
        micro = [batch(step, world.rank, j, cfg.batch_size, image_size, context, vocab) for j in range(cfg.accum_freq)]
        if spec.get("ranks_emulated"):  # one process on the global batch that N ranks of batch_size would see
            per_rank = [
                [batch(step, r, j, cfg.batch_size // spec["ranks_emulated"], image_size, context) for r in ranks]
                for j in range(cfg.accum_freq)
                for ranks in [range(spec["ranks_emulated"])]
            ]
            micro = [tuple(torch.cat(parts) for parts in zip(*shards)) for shards in per_rank]
        if spec.get("pad_texts"):  # padding after the first half of every other text (CoCa's masks and labels)
            for _, texts in micro:
                texts[::2, context // 2 :] = 0
        micro = [(images.to(engine.precision.param_dtype), texts) for images, texts in micro]  # as the loop does
        if spec.get("clamp_check") and step == 0:
            _set_logit_scale_master(engine, 10.0)
        loss, _ = forward_backward(engine, loss_fn, micro, world, teacher=teacher)
        if live_grads is not None:
            live_grads.measure()  # what is still alive when the backward has returned
            live_grads.count_storages()
        out["norms"].append(optimizer_step(engine))
        if spec.get("mean_loss") and world.world_size > 1:  # each rank's loss is its share (SigLIP's): their mean
            loss = _mean_over_ranks(loss)
        out["losses"].append(loss)
        if ema_reference is not None:
            ema_reference.update()
        if before_first_step is not None and step == 0:
            lr = engine.get_lr()
            after = _all_whole(engine)
            out["step_sizes"] = {n: float((after[n] - w).abs().max()) / lr for n, w in before_first_step.items()}
        if spec.get("clamp_check"):
            with torch.no_grad(), engine.autocast():
                seen = float(engine.module(texts=micro[0][1][:1])["logit_scale"].float().log().mean())
            out["logit_scale_after"].append([seen, _logit_scale_master(engine)])
    out["step_s"] = (time.perf_counter() - t0) / max(1, spec["steps"])
    if ema_reference is not None:
        out["ema_max_error"], out["ema_max_change"] = ema_reference.compare()
        out["ema_swap_error"], out["ema_restore_exact"] = ema_reference.swap_check()
    if frozen_before is not None:  # --lock-image/--lock-text: frozen weights must come out bit-identical
        after = _frozen(engine)
        changed = [n for n in after if not torch.equal(frozen_before[n], after[n])]
        out["frozen"] = {"count": len(after), "changed": changed}
    if teacher is not None:
        after = _local_weights(teacher)
        out["teacher"] = {
            "unchanged": all(torch.equal(teacher_before[n], t) for n, t in after.items()),
            "training": teacher.training,
            "requires_grad": any(p.requires_grad for p in teacher.parameters()),
            "local_elements": sum(t.numel() for t in after.values()),
            "in_model": any(n.startswith("teacher") for n in engine.model.state_dict()),
        }
    out["param_dtypes"] = sorted({str(p.dtype) for p in engine.model.parameters()})
    out["int8_matmuls"] = sum(INT8_MATMULS.values())  # SwitchBack layers (--use-bnb-linear) in training
    engine.eval()
    images, texts = batch(9999, 0, 0, 4, image_size, context, vocab)
    images = images.to(engine.precision.param_dtype)
    with torch.no_grad(), engine.autocast():
        text_only = engine.module(texts=texts)["text_features"].float()
        image_only = engine.module(images=images)["image_features"].float()
    out["eval_checksum"] = [float(text_only.abs().sum()), float(image_only.abs().sum())]
    out["state_bytes"] = engine.state_bytes()
    if spec.get("seed_per_rank"):  # do replicas that draw their own random streams still hold the same weights?
        out["weight_sums_per_rank"] = _weight_sums_per_rank(engine, world)
    out["peak_rss_bytes"] = peak_rss_bytes()
    if micro_grads is not None:
        out["micro_grads"] = [micro for micro in micro_grads.steps if micro]
        out["sharded_grad_bytes"] = micro_grads.all_grads
        out["grads_kept_after_step"] = micro_grads.kept_after_step
    if live_grads is not None:
        out["live_grad_peak_bytes"] = live_grads.peak
        out["largest_block_bytes"] = live_grads.largest_block
        out["grad_bytes"] = live_grads.all_grads
        out["grad_storages"], out["params_with_grad"] = live_grads.storages, live_grads.with_grad
    return out


def _mean_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _local_weights(module) -> dict[str, torch.Tensor]:
    """Copies of what this rank holds of each parameter (its shard under FSDP2)."""
    return {n: getattr(p, "_local_tensor", p).detach().clone() for n, p in module.named_parameters()}


class _LiveGradients:
    """The most gradient bytes (.grad of this rank's parameters, local shards) alive at once: measured from a
    post-accumulate-grad hook on every parameter that runs before the engine's own hooks and one that runs after
    them, and when the backward has returned."""

    def __init__(self, engine):
        self.params = [p for p in engine.model.parameters() if p.requires_grad]
        self.peak = 0
        self.largest_block = max(
            sum(self._bytes(p) for p in block.parameters() if p.requires_grad)
            for block in engine.model.transformer_blocks()
        )
        self.all_grads = sum(self._bytes(p) for p in self.params)
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda _p: self.measure())
            # and once before the engine's hooks, when the new gradient exists and nothing has freed it yet
            first = p.register_post_accumulate_grad_hook(lambda _p: self.measure())
            p._post_accumulate_grad_hooks.move_to_end(first.id, last=False)

    @staticmethod
    def _bytes(t: torch.Tensor) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    def count_storages(self) -> None:
        """How many distinct memory blocks hold the gradients (DDP's bucket views: one per bucket)."""
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in self.params if p.grad is not None]
        self.storages = len({g.untyped_storage().data_ptr() for g in grads})
        self.with_grad = len(grads)

    def measure(self) -> None:
        self.peak = max(self.peak, sum(self._bytes(p.grad) for p in self.params if p.grad is not None))


class _MicroBatchGradients:
    """After each micro-batch's backward (engine.backward, which the loop calls once per micro-batch): the
    parameters with a gradient, their local bytes, and the memory blocks (storages) holding them; one list of
    micro-batches per step, a step starting at the first micro-batch after the optimizer step cleared them."""

    def __init__(self, engine):
        self.params = [p for p in engine.model.parameters() if p.requires_grad]
        self.all_grads = sum(_LiveGradients._bytes(p) for p in self.params)
        self.steps: list[list[dict]] = []
        self.kept_after_step: list[int] = []  # how many gradients the step left allocated
        backward, step = engine.backward, engine.step

        def recorded_backward(loss):
            backward(loss)
            if not self.steps or self.steps[-1] is None:
                self.steps[-1:] = [[]]
            grads = [getattr(p.grad, "_local_tensor", p.grad) for p in self.params if p.grad is not None]
            self.steps[-1].append(
                {
                    "with_grad": len(grads),
                    "bytes": sum(g.numel() * g.element_size() for g in grads),
                    "storages": sorted({g.untyped_storage().data_ptr() for g in grads}),
                }
            )

        def recorded_step():
            self.steps.append(None)  # the next backward starts a new step
            norm = step()
            self.kept_after_step.append(sum(p.grad is not None for p in self.params))
            return norm

        engine.backward, engine.step = recorded_backward, recorded_step


@torch.no_grad()
def _weight_sums_per_rank(engine, world) -> list[float]:
    """Each rank's sum of the weights it holds (DDP replicas: equal; FSDP2 shards: their parts); a collective."""
    local = sum(float(getattr(p, "_local_tensor", p).double().sum()) for p in engine.model.parameters())
    if world.world_size == 1:
        return [local]
    import torch.distributed as dist

    sums = [None] * world.world_size
    dist.all_gather_object(sums, local)
    return sums


@torch.no_grad()
def compare_with_file(engine, path: str) -> dict:
    """Compare what each rank holds of every parameter (its FSDP2 shard or ZeRO-3 partition, or the whole tensor)
    with the same elements of the OpenCLIP-layout safetensors file it was loaded from, converted eagerly (the
    streaming loader converts entry by entry). No gathering: the ranks' element counts are summed, so together they
    must cover every element of the model."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from bigclip.model import openclip_to_bigclip

    expected = openclip_to_bigclip(load_file(path))
    rank, world = dist.get_rank(), dist.get_world_size()
    worst, compared = 0.0, 0
    totals = torch.zeros(2, dtype=torch.float64)  # elements compared, elements in the model
    for name, p in engine.model.named_parameters():
        held, wanted, sharded = _held_and_expected(p, expected[name], rank, world)
        assert held.shape == wanted.shape, (name, held.shape, wanted.shape)
        if held.numel():
            worst = max(worst, (held.float() - wanted.float()).abs().max().item())
        counted = held.numel() if sharded or rank == 0 else 0  # a whole tensor counts once
        totals += torch.tensor([counted, expected[name].numel() if rank == 0 else 0])
        compared += 1
    dist.all_reduce(totals)
    worst_t = torch.tensor([worst])
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": worst_t.item(), "compared": compared, "in_file": len(expected),
            "elements_compared": int(totals[0]), "elements_expected": int(totals[1])}  # fmt: skip


def _held_and_expected(p: torch.Tensor, whole: torch.Tensor, rank: int, world: int):
    """(the elements of p this rank holds, the same elements of the whole tensor, whether p is sharded), without a
    collective."""
    if hasattr(p, "full_tensor"):  # FSDP2: a DTensor sharded on dim 0, torch.chunk's split
        (placement,) = p.placements
        chunks = torch.chunk(whole, world, dim=placement.dim)
        mine = chunks[rank] if rank < len(chunks) else whole.narrow(placement.dim, 0, 0)
        return p.to_local(), mine, True
    if hasattr(p, "ds_id"):  # ZeRO-3: a flat partition of the flattened tensor (the last one padded)
        partition = p.ds_tensor.ds_numel
        start = rank * partition
        numel = max(0, min(partition, p.ds_numel - start))
        return p.ds_tensor.flatten()[:numel], whole.flatten()[start : start + numel], True
    return p.detach(), whole, False  # whole on every rank


@torch.no_grad()
def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole, whatever the engine did to it (a collective for sharded ones)."""
    if hasattr(p, "full_tensor"):  # FSDP2: a DTensor shard
        return p.full_tensor()
    if hasattr(p, "ds_id"):  # ZeRO-3: a partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.data.clone()
    return p.detach().clone()


class _EMAReference:
    """The moving average computed another way: in float64, from the whole weights gathered after every step, with
    the decays of engine/ema.py's formula (timm's warm-up when asked)."""

    def __init__(self, engine):
        self.engine = engine
        self.average = {n: w.double() for n, w in _all_whole(engine, masters=True).items()}
        self.start = {n: w.clone() for n, w in self.average.items()}
        self.updates = 0

    def update(self) -> None:
        self.updates += 1
        cfg = self.engine.cfg
        decay = cfg.ema_decay
        if cfg.ema_warmup:
            decay = min(decay, 1 - (1 + self.updates) ** (-2 / 3))
        for name, weights in _all_whole(self.engine, masters=True).items():
            self.average[name] = decay * self.average[name] + (1 - decay) * weights.double()

    def swap_check(self) -> tuple[float, bool]:
        """(largest |weights the forward reads while the average is swapped in - the reference average|, whether
        the live weights and the average came back bit for bit: float32 weights exchange values with it)."""
        live, average = _all_whole(self.engine), self.engine_average()
        with self.engine.ema.swapped_in():
            swapped = _all_whole(self.engine)
        error = max(float((swapped[n].double() - ref).abs().max()) for n, ref in self.average.items())
        back, average_back = _all_whole(self.engine), self.engine_average()
        return error, all(torch.equal(live[n], back[n]) for n in live) and all(
            torch.equal(average[n], average_back[n]) for n in average
        )

    def engine_average(self) -> dict[str, torch.Tensor]:
        """The engine's float32 average of each parameter, whole (collective under DeepSpeed: fragments)."""
        ema = self.engine.ema
        if hasattr(ema, "whole_average"):  # DeepSpeed: fragments of the fp32 master partitions
            return {n: ema.whole_average(n).view(ref.shape) for n, ref in self.average.items()}
        return {n: _whole(ema.params[n]) for n in self.average}

    def compare(self) -> tuple[float, float]:
        """(largest |engine's average - reference|, largest |reference - start|: that the average moved)."""
        mine = self.engine_average()
        error = change = 0.0
        for name, reference in self.average.items():
            error = max(error, float((mine[name].double() - reference).abs().max()))
            change = max(change, float((reference - self.start[name]).abs().max()))
        return error, change


def _all_whole(engine, masters: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter whole; with `masters`, DeepSpeed's fp32 master copy (what its optimizer updates)."""
    if masters and engine.name == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.model.named_parameters()}
    return {n: _whole(p) for n, p in engine.model.named_parameters()}


def _frozen(engine) -> dict[str, torch.Tensor]:
    return {n: _whole(p) for n, p in engine.model.named_parameters() if not p.requires_grad}


@torch.no_grad()
def _set_logit_scale_master(engine, value: float) -> None:
    """Put the temperature out of range in the copy the optimizer updates (DeepSpeed: its fp32 master)."""
    p = engine.model.logit_scale
    if engine.name != "deepspeed":
        p.data.fill_(value)  # DDP: the parameter; FSDP: this rank's shard of it
        return
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    if hasattr(p, "ds_id"):
        local = safe_get_local_fp32_param(p)
        if local is not None and local.numel():
            safe_set_local_fp32_param(p, torch.full_like(local, value))
        p.ds_tensor.fill_(value)
    elif getattr(p, "_hp_mapping", None) is not None:
        p._hp_mapping.get_hp_fragment().fill_(value)
    if p.data.numel():
        p.data.fill_(value)


def _logit_scale_master(engine) -> float:
    p = engine.model.logit_scale
    if hasattr(p, "full_tensor"):  # FSDP between steps: a sharded DTensor (after a forward: the gathered one)
        return float(p.full_tensor())
    if engine.name == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(p)  # collective: every rank asks
        if full is not None:
            return float(full.flatten()[0])
    return float(p.detach().flatten()[0])


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        runs = json.load(f)
    world = init_distributed("cpu")
    results = {}
    for spec in runs:
        try:
            started = time.perf_counter()
            results[spec["name"]] = run_one(spec, world)
            results[spec["name"]]["run_s"] = time.perf_counter() - started  # the whole run: what the launch pays
        except Exception as e:  # record and go on: one broken engine should not hide the others' results
            import traceback

            traceback.print_exc()
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}"}
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    shutdown()  # frees the runs' DDP wrappers before the process group goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
