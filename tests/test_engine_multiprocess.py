"""FSDP2 and DeepSpeed ZeRO-1/2/3 on 2 real gloo processes, against DDP on the same data.

Most engine comparisons share one torchrun launch (tests/engine_worker.py runs the engines one after
another), so process start-up and DeepSpeed's initialisation are paid once. Tolerances:
  fp32: every step's loss within relative 1e-4 of DDP's (measured: identical to the printed digits), and the
        pre-clipping gradient norm within 1e-3;
  bf16 (amp_bf16): within relative 3e-2 over 10 steps. The engines round differently on purpose: DDP keeps
        fp32 weights under autocast, FSDP2 all-gathers bf16 copies of fp32 shards, DeepSpeed stores bf16
        weights with fp32 masters; measured: at most 4.4e-3 (1.4e-2 with --accum-freq 2).
"""

import json
import os
import subprocess
import sys

import open_clip
import pytest
import torch
from helpers import (
    REPO,
    free_port,
    launch,
    read_metrics,
    step_losses,
    subprocess_env,
    tiny_hf_clip,
    torchrun,
)
from safetensors.torch import save_file

from bigclip import optim
from bigclip.model import create_model

pytestmark = pytest.mark.slow

WORKER = os.path.join(REPO, "tests", "engine_worker.py")
DS = {stage: os.path.join(REPO, "ds_configs", f"zero{stage}.json") for stage in (1, 2, 3)}
FP32_RTOL, BF16_RTOL, INT8_RTOL = 1e-4, 3e-2, 1e-4


def run_worker(tmp_path, runs, name="runs", timeout=900, nproc=2, **env):
    spec, out = tmp_path / f"{name}.json", tmp_path / f"{name}_out.json"
    spec.write_text(json.dumps(runs))
    proc = launch(WORKER, [str(spec), str(out)], timeout, nproc=nproc, DS_ACCELERATOR="cpu", **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors, (errors, proc.stderr[-4000:])
    return results


def engines(**flags):
    return {
        "ddp": {},
        "fsdp": {"engine": "fsdp"},
        "zero1": {"ds_config": DS[1]},
        "zero2": {"ds_config": DS[2]},
        "zero3": {"ds_config": DS[3]},
        **flags,
    }


def layer_decay_scales(model_name: str, **flags) -> dict[str, float]:
    """Each parameter's lr scale as bigclip's optimizer groups give it."""
    model = create_model(model_name)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = optim.param_groups(model, optim.OptimizerConfig(**flags))
    return {names[id(p)]: g.get("lr_scale", 1.0) for g in groups for p in g["params"]}


def assert_same_run(run, reference, rtol, steps=None, norms=True):
    steps = steps or len(reference["losses"])
    assert len(run["losses"]) >= steps
    for i in range(steps):
        assert run["losses"][i] == pytest.approx(reference["losses"][i], rel=rtol), f"step {i}"
        if norms:
            assert run["norms"][i] == pytest.approx(reference["norms"][i], rel=max(rtol, 1e-3)), f"norm {i}"


def assert_accumulation_adds_no_gradient_memory(r: dict) -> None:
    """--accum-freq 2, after each micro-batch's backward. DDP: every gradient accumulates in the all-reduce buckets
    it is a view of, the same memory blocks before and after the synchronised backward (a gradient of its own
    between them would be a second gradient's bytes). FSDP2: after the first micro-batch every gradient is
    already its reduce-scattered shard, as after the last (no block's unsharded gradient waits on the rank), but
    the logit scale's: detached in all but the last micro-batch (loop.forward_backward)."""
    params = r["ddp_accum"]["num_params"]
    for step in r["ddp_accum"]["micro_grads"]:
        first, last = step
        assert first["storages"] == last["storages"] and len(first["storages"]) < 5, step  # a few buckets
        assert first["bytes"] == last["bytes"] == 4 * params, step
    run = r["fsdp_accum"]
    assert len(run["micro_grads"]) == len(run["losses"])
    for first, last in run["micro_grads"]:
        assert first["with_grad"] == last["with_grad"] - 1 > 50, (first, last)
        assert last["bytes"] == run["sharded_grad_bytes"] and 0 <= last["bytes"] - first["bytes"] <= 4


def assert_ddp_rebuckets_once_at_the_second_step(r: dict) -> None:
    """What the plan's `rebucket` moment counts (engine/ddp.py _working): DistributedDataParallel holds every
    gradient in the buckets it starts with through the first step, then in buckets built anew at the second step's
    start (the order the first backward produced them in), and keeps those for the rest of the run. Measured on
    ViT-B-32 (docs/benchmarks.md): accumulating, the new buckets are allocated while the old one still holds every
    gradient."""
    steps = [step[-1]["storages"] for step in r["ddp_accum"]["micro_grads"]]
    assert steps[0] != steps[1] and not set(steps[0]) & set(steps[1]), steps[:2]
    assert all(later == steps[1] for later in steps[2:]), steps
    # Accumulating, the gradients stay the buckets' views between steps (zeroed in place), so the old bucket is
    # alive at the rebuild and the plan counts it; without accumulation the step frees them, and DDP frees the old
    # bucket before it allocates the new ones (engine/ddp.py)
    assert r["ddp_accum"]["grads_kept_after_step"] == [step[-1]["with_grad"] for step in r["ddp_accum"]["micro_grads"]]
    assert r["ddp"]["grads_kept_after_step"] == [0] * len(r["ddp"]["losses"])
    ddp_steps = [step[-1]["storages"] for step in r["ddp"]["micro_grads"]]
    assert ddp_steps[0] != ddp_steps[1] and all(later == ddp_steps[1] for later in ddp_steps[2:]), ddp_steps


def assert_locked_state_as_planned(r: dict) -> None:
    """The plan's state of the locked runs' model (--lock-image with one group unlocked, --lock-text: the frozen
    parameters as weights only, each engine's placement and dtype) against what each engine holds (its
    state_bytes(): parameters, gradients and optimizer state, rank 0), without the plan's gathered blocks. Measured
    1.00 (DDP), 0.99 (FSDP2: the trainable gradients are freed after the step), 1.03 (ZeRO-3)."""
    import bigclip.engine  # noqa: F401  (the engines list their memory setups)
    from bigclip.memory import Locks, StateRecipe, locked_weight_bytes, model_facts, state_bytes

    facts = model_facts("test-tiny", None, Locks(image_unlocked_groups=1, text_unlocked_layers=0))
    assert facts.frozen_params > facts.trainable_params / 2
    fp32 = StateRecipe("fp32")  # the matrix's precision (engine_worker.py)
    for name, setup in (("ddp_locked", "ddp"), ("fsdp_locked", "fsdp"), ("zero3_locked", "zero3")):
        planned = state_bytes(setup, facts.trainable_params, 2, fp32)
        planned += locked_weight_bytes(setup, facts.frozen_params, 2, fp32)
        assert r[name]["state_bytes"]["total"] == pytest.approx(planned, rel=0.05), (name, r[name]["state_bytes"])


def test_every_engine_matches_ddp_step_by_step(tmp_path):
    """test-tiny, same seed and data, 20 steps, global loss (--gather-with-grad): ddp == fsdp == zero1/2/3,
    also with --accum-freq 2, with --grad-checkpointing (every block, and every 2nd), with per-block
    compile + checkpointing, CPU offload (FSDP and ZeRO-3), in bf16, and the logit-scale clamp
    reaching DeepSpeed's fp32 masters; the same for CoCa (test-tiny-coca), distillation, EMA, int8 MLPs and
    layer-wise lr decay."""
    tiny = {"model": "test-tiny", "batch_size": 8}
    runs = []

    def add(name, steps, **config):
        runs.append({"name": name, "steps": steps, "config": {**tiny, **config}})

    for name, flags in engines().items():
        add(name, 20, **flags)
        runs[-1]["micro_grads"] = name == "ddp"  # DDP's buckets and its gradients between steps
        add(f"{name}_accum", 10, **flags, accum_freq=2, batch_size=4)
        runs[-1]["micro_grads"] = True
    # HSDP on 2 ranks: 2 replicas of 1 shard each, so the replicas' all-reduce is what accumulation defers (FSDP2
    # keeps the reduce-scattered sums until the last micro-batch's, not in .grad: only the losses are compared)
    add("hsdp_accum", 10, engine="fsdp", fsdp_replicate_degree=2, accum_freq=2, batch_size=4)
    add("fsdp_ckpt", 10, engine="fsdp", grad_checkpointing=True)
    add("zero3_ckpt", 10, ds_config=DS[3], grad_checkpointing=True)
    add("zero2_ckpt_every2", 10, ds_config=DS[2], grad_checkpointing=True, grad_checkpointing_every=2)
    for name, flags in (("fsdp", {"engine": "fsdp"}), ("zero3", {"ds_config": DS[3]})):
        runs.append(
            {
                "name": f"{name}_compile",
                "steps": 4,
                # aot_eager (--torchcompile-backend): dynamo's tracing through the engines' hooks without minutes of
                # inductor C++ builds on a CPU
                "config": {
                    **tiny,
                    **flags,
                    "torchcompile": True,
                    "torchcompile_backend": "aot_eager",
                    "grad_checkpointing": True,
                },  # fmt: skip
            }
        )
    # ds_configs/zero3_offload.json's offload of parameters and optimizer state, with bigclip's torch AdamW (the
    # file as shipped, with DeepSpeed's own CPU Adam, whose JIT build costs ~100 s of CPU: test_zero_infinity.py,
    # extended tier)
    offload = json.loads(open(os.path.join(REPO, "ds_configs", "zero3_offload.json")).read())
    del offload["optimizer"]
    (tmp_path / "zero3_offload_torch_adamw.json").write_text(json.dumps(offload))
    add("zero3_offload_torch_adamw", 5, ds_config=str(tmp_path / "zero3_offload_torch_adamw.json"))
    # locked towers: frozen blocks, and text blocks frozen except their LayerNorms (OpenCLIP's --lock-text)
    for name, flags in (("ddp", {}), ("fsdp", {"engine": "fsdp"}), ("zero3", {"ds_config": DS[3]})):
        runs.append({"name": f"{name}_locked", "steps": 5, "frozen_check": True,
                     "config": {**tiny, **flags, "lock_image": True, "lock_image_unlocked_groups": 1,
                                "lock_text": True}})  # fmt: skip
    for name, flags in (("ddp", {}), ("fsdp", {"engine": "fsdp"})):  # pure bf16: the weights are bf16
        add(f"{name}_pure_bf16", 3, **flags, precision="bf16")
    add("fsdp_offload_noreshard", 5, engine="fsdp", fsdp_offload_cpu=True, fsdp_no_reshard_after_forward=True)
    for name, flags in (
        ("ddp", {}),
        ("fsdp", {"engine": "fsdp"}),
        ("zero2", {"ds_config": DS[2]}),
        ("zero3", {"ds_config": DS[3]}),
    ):
        add(f"{name}_bf16", 10, **flags, precision="amp_bf16")
    for name, flags in (("ddp", {}), ("fsdp", {"engine": "fsdp"}), ("zero3", {"ds_config": DS[3]})):
        add(f"{name}_bf16_accum", 10, **flags, precision="amp_bf16", accum_freq=2, batch_size=4)
    for name, flags in (
        ("ddp", {}),
        ("fsdp", {"engine": "fsdp"}),
        ("zero1", {"ds_config": DS[1]}),
        ("zero3", {"ds_config": DS[3]}),
        ("zero2_bf16", {"ds_config": DS[2], "precision": "amp_bf16"}),
    ):
        runs.append({"name": f"clamp_{name}", "steps": 2, "clamp_check": True, "config": {**tiny, **flags}})
    # int8 SwitchBack MLPs (--use-bnb-linear) under every engine, also with checkpointing + accumulation, in bf16
    int8 = {"use_bnb_linear": "SwitchBackLinearGlobal"}
    for name, flags in (("ddp", {}), ("fsdp", {"engine": "fsdp"}), ("zero1", {"ds_config": DS[1]}),
                        ("zero2", {"ds_config": DS[2]}), ("zero3", {"ds_config": DS[3]})):  # fmt: skip
        add(f"{name}_int8", 10, **flags, **int8)
        # 3 steps: one int8 rounding that flips on a last-bit difference of the weights (FSDP's reduce-scatter vs
        # DDP's all-reduce) moves the loss by ~1e-4 from about the 5th step on with accumulation
        add(f"{name}_int8_ckpt_accum", 3, **flags, **int8, grad_checkpointing=True, accum_freq=2, batch_size=4)
    for name, flags in (("ddp", {}), ("fsdp", {"engine": "fsdp"})):
        add(f"{name}_int8_bf16", 5, **flags, **int8, precision="amp_bf16")
    # layer-wise lr decay (--image-layer-decay / --text-layer-decay): every engine steps each group at its scale
    decay = {"image_layer_decay": 0.5, "text_layer_decay": 0.7, "wd": 0.0, "eps": 1e-12}
    for name, flags in [*engines().items(), ("ddp_in_backward", {"optimizer_in_backward": True})]:
        runs.append({"name": f"{name}_layer_decay", "steps": 1, "step_sizes": True,
                     "config": {**tiny, **flags, **decay}})  # fmt: skip
    # --ema-decay: the average of each rank's weights (FSDP2: of its shards) against a float64 reference
    in_backward = {"optimizer_in_backward": True}
    ema_engines = {"ddp": {}, "fsdp": {"engine": "fsdp"}, "ddp_in_backward": in_backward, "zero1": {"ds_config": DS[1]},
                   "zero2": {"ds_config": DS[2]}, "zero3": {"ds_config": DS[3]},
                   "zero2_bf16": {"ds_config": DS[2], "precision": "amp_bf16"}}  # fmt: skip
    for name, flags in ema_engines.items():
        config = {**tiny, **flags, "ema_decay": 0.7}
        runs.append({"name": f"{name}_ema", "steps": 6, "ema_check": True, "config": config})
    runs.append({"name": "fsdp_ema_warmup", "steps": 6, "ema_check": True,
                 "config": {**tiny, "engine": "fsdp", "ema_decay": 0.99, "ema_warmup": True}})  # fmt: skip
    # --distill-model: a frozen teacher (its own weights) placed by each engine feeds OpenCLIP's distillation loss;
    # also built on meta and streamed into its shards (--sharded-init always), and with accumulation
    teacher = tmp_path / "teacher.pt"
    torch.manual_seed(3)
    torch.save(create_model("test-tiny").state_dict(), teacher)
    distill = {"distill_model": "test-tiny", "distill_pretrained": str(teacher)}
    # (the meta runs' students start from a file too: a sharded random init differs from DDP's)
    meta = {"sharded_init": "always", "pretrained": str(teacher)}
    more = {"ddp_pretrained": {"pretrained": str(teacher)}, "fsdp_meta": {"engine": "fsdp", **meta},
            "zero3_meta": {"ds_config": DS[3], **meta},
            "fsdp_offload": {"engine": "fsdp", "fsdp_offload_cpu": True}}  # fmt: skip
    for name, flags in {**engines(), **more}.items():
        runs.append({"name": f"{name}_distill", "steps": 8, "teacher": True, "config": {**tiny, **flags, **distill}})
    for name, flags in (("ddp", {}), ("zero3", {"ds_config": DS[3]})):
        runs.append({"name": f"{name}_distill_accum", "steps": 5, "teacher": True,
                     "config": {**tiny, **flags, **distill, "accum_freq": 2, "batch_size": 4}})  # fmt: skip
    # CoCa (the caption decoder's blocks sharded and checkpointed like the towers'; padded texts): every engine
    coca = {"model": "test-tiny-coca", "batch_size": 8}
    for name, flags in {**engines(), "fsdp_ckpt": {"engine": "fsdp", "grad_checkpointing": True}}.items():
        runs.append({"name": f"coca_{name}", "steps": 8, "pad_texts": True, "config": {**coca, **flags}})
    for name, flags in (("ddp", {}), ("zero3_ckpt", {"ds_config": DS[3], "grad_checkpointing": True})):
        runs.append({"name": f"coca_{name}_accum", "steps": 4, "pad_texts": True,
                     "config": {**coca, **flags, "accum_freq": 2, "batch_size": 4}})  # fmt: skip
    r = run_worker(tmp_path, runs)

    # CoCa: every engine gives DDP's losses (contrastive + caption), also checkpointed and accumulated
    assert r["coca_ddp"]["losses"][-1] < r["coca_ddp"]["losses"][0]
    for name in ("fsdp", "zero1", "zero2", "zero3", "fsdp_ckpt"):
        assert_same_run(r[f"coca_{name}"], r["coca_ddp"], FP32_RTOL)
        assert r[f"coca_{name}"]["eval_checksum"] == pytest.approx(r["coca_ddp"]["eval_checksum"], rel=1e-4)
    assert_same_run(r["coca_zero3_ckpt_accum"], r["coca_ddp_accum"], FP32_RTOL)

    ddp, ddp_accum = r["ddp"], r["ddp_accum"]
    assert all(x == x for x in ddp["losses"]) and ddp["losses"][-1] < ddp["losses"][0]
    for name in ("fsdp", "zero1", "zero2", "zero3"):
        assert_same_run(r[name], ddp, FP32_RTOL)
        assert_same_run(r[f"{name}_accum"], ddp_accum, FP32_RTOL)
    assert_same_run(r["hsdp_accum"], ddp_accum, FP32_RTOL)
    # accumulation is a different computation (4 x 2 micro-batches) of the same global batch size
    assert ddp_accum["losses"] != ddp["losses"]
    assert_accumulation_adds_no_gradient_memory(r)
    assert_ddp_rebuckets_once_at_the_second_step(r)
    # AdamW's first step moves every element with a gradient by lr * lr_scale (wd 0, eps 1e-12): the largest
    # change of each parameter is its group's scale, the one bigclip's groups give it in this process
    expected = layer_decay_scales("test-tiny", image_layer_decay=0.5, text_layer_decay=0.7)
    assert min(expected.values()) < 0.2 and max(expected.values()) == 1.0
    # --ema-decay: the average (DeepSpeed: of its fp32 masters) equals the float64 one; swapped in for --eval-ema it
    # is what the forward reads (in the weights' dtype: bf16 under DeepSpeed's bf16), and the live weights and the
    # average come back bit for bit
    for name in [*(f"{e}_ema" for e in ema_engines), "fsdp_ema_warmup"]:
        assert r[name]["ema_max_error"] < 1e-6 and r[name]["ema_max_change"] > 1e-3, (name, r[name])
        swap_tolerance = 1e-2 if name == "zero2_bf16_ema" else 1e-6
        assert r[name]["ema_swap_error"] < swap_tolerance and r[name]["ema_restore_exact"], (name, r[name])
    for name in [*engines(), "ddp_in_backward"]:
        sizes = r[f"{name}_layer_decay"]["step_sizes"]
        assert sizes.keys() == expected.keys(), name
        for param, scale in expected.items():
            assert sizes[param] == pytest.approx(scale, rel=1e-3), (name, param)
    for name in (
        "fsdp_ckpt",
        "zero3_ckpt",
        "zero2_ckpt_every2",
        "fsdp_compile",
        "zero3_compile",
        "fsdp_offload_noreshard",
        "zero3_offload_torch_adamw",
    ):
        assert_same_run(r[name], ddp, FP32_RTOL, steps=len(r[name]["losses"]))
    assert r["zero3_offload_torch_adamw"]["optimizer"] == r["ddp"]["optimizer"] == "AdamW"
    for name in ("fsdp_locked", "zero3_locked"):
        assert_same_run(r[name], r["ddp_locked"], FP32_RTOL)
    assert_locked_state_as_planned(r)
    for name in ("ddp_locked", "fsdp_locked", "zero3_locked"):  # frozen weights untouched, bit for bit
        assert r[name]["frozen"]["count"] >= 40 and r[name]["frozen"]["changed"] == [], (name, r[name]["frozen"])
    for name in ("ddp_pure_bf16", "fsdp_pure_bf16"):
        assert r[name]["param_dtypes"] == ["torch.bfloat16"] and all(x == x for x in r[name]["losses"]), name
    assert r["ddp"]["param_dtypes"] == ["torch.float32"] and r["ddp_bf16"]["param_dtypes"] == ["torch.float32"]
    for name in ("fsdp_bf16", "zero2_bf16", "zero3_bf16"):
        assert_same_run(r[name], r["ddp_bf16"], BF16_RTOL, norms=False)
    for name in ("fsdp_bf16_accum", "zero3_bf16_accum"):  # bf16 gathers + fp32 reductions + accumulation
        assert_same_run(r[name], r["ddp_bf16_accum"], BF16_RTOL, norms=False)

    # SwitchBack: the sharding engines give the DDP SwitchBack run's losses; the MLPs really run int8: per
    # step 2 int8 matmuls (forward, input gradient) per MLP linear, 2 linears per block, 4 blocks in test-tiny;
    # checkpointing recomputes each forward once more; OpenCLIP's accumulation runs each micro-batch's forward
    # twice (once without grad for the cached features, once with)
    assert r["ddp_int8"]["losses"] != ddp["losses"]
    for name in ("fsdp", "zero1", "zero2", "zero3"):
        assert_same_run(r[f"{name}_int8"], r["ddp_int8"], INT8_RTOL, norms=False)
        # an int8 rounding that flips on a last-bit difference moves the loss by ~1.3e-4 (measured at the 3rd step)
        assert_same_run(r[f"{name}_int8_ckpt_accum"], r["ddp_int8_ckpt_accum"], 1e-3, norms=False)
        assert r[f"{name}_int8"]["int8_matmuls"] == 10 * 2 * 2 * 4, name
        assert r[f"{name}_int8_ckpt_accum"]["int8_matmuls"] == 3 * 2 * (2 + 1 + 1) * 2 * 4, name
    assert_same_run(r["fsdp_int8_bf16"], r["ddp_int8_bf16"], BF16_RTOL, norms=False)
    assert r["ddp"]["int8_matmuls"] == 0

    # distillation: every engine gives DDP's losses (the distillation term on top of the CLIP loss); the teacher
    # stays as loaded, in eval mode, without gradients, outside the model the engine trains and saves; FSDP2 and
    # ZeRO-3 hold half of it per rank (also when it is built on meta and its file streamed into the shards)
    assert r["ddp_distill"]["losses"][0] > ddp["losses"][0]
    whole = r["ddp_distill"]["teacher"]["local_elements"]
    for name in ("fsdp", "zero1", "zero2", "zero3", "fsdp_offload"):
        assert_same_run(r[f"{name}_distill"], r["ddp_distill"], FP32_RTOL)
    for name in ("fsdp_meta", "zero3_meta"):
        assert_same_run(r[f"{name}_distill"], r["ddp_pretrained_distill"], FP32_RTOL)
    assert_same_run(r["zero3_distill_accum"], r["ddp_distill_accum"], FP32_RTOL)
    taught = ("ddp", "fsdp", "zero1", "zero2", "zero3", "fsdp_meta", "zero3_meta", "fsdp_offload", "ddp_accum",
              "zero3_accum")  # fmt: skip
    for name in taught:
        t = r[name.replace("_accum", "") + "_distill" + ("_accum" if "accum" in name else "")]["teacher"]
        assert t["unchanged"] and not t["training"] and not t["requires_grad"] and not t["in_model"], (name, t)
        sharded = name.startswith(("fsdp", "zero3"))
        assert (t["local_elements"] < 0.6 * whole) if sharded else (t["local_elements"] == whole), (name, t)

    # eval goes through every engine's forward on all ranks (text-only and image-only calls included)
    for name in ("fsdp", "zero1", "zero2", "zero3"):
        assert r[name]["eval_checksum"] == pytest.approx(ddp["eval_checksum"], rel=1e-4)

    # sharded engines hold about half of DDP's parameter bytes per rank at world size 2
    assert r["fsdp"]["state_bytes"]["params"] < 0.6 * ddp["state_bytes"]["params"]
    assert r["zero3"]["state_bytes"]["params"] < 0.6 * ddp["state_bytes"]["params"]

    # the logit scale was set to 10 in the copy the optimizer updates; after a step every engine has clamped
    # it to log(100), in the weights the forward sees and in the (fp32 master) copy the next step starts from
    for name in ("ddp", "fsdp", "zero1", "zero3", "zero2_bf16"):
        for seen, master in r[f"clamp_{name}"]["logit_scale_after"]:
            assert seen <= 4.6052 and master <= 4.6052, name


# Extended tier: 2-5 min; in CI the Hugging Face towers against OpenCLIP's (test_hf_text.py) and every engine on
# bigclip's towers (above)
@pytest.mark.extended
def test_a_hugging_face_text_tower_trains_alike_under_every_engine(tmp_path):
    """OpenCLIP's HFTextEncoder layout (a tiny RoBERTa made here, its weights loaded as hf_model_pretrained): DDP,
    FSDP2, ZeRO-1/2/3 give the same losses, also with Hugging Face's activation checkpointing; built on meta and
    initialised shard by shard, from a whole-model file (equal to DDP's run from it) and from the Hugging Face
    weights (FSDP2 and ZeRO-3 alike). A CoCa on that tower (OpenCLIP's coca_roberta layout) likewise under FSDP2
    and ZeRO-3, built on meta and its file streamed into the shards (the caption decoder's blocks included)."""
    name = tiny_hf_clip(tmp_path / "hf")
    coca = tiny_hf_clip(tmp_path / "hf_coca", coca=True)
    weights, coca_weights = str(tmp_path / "clip.pt"), str(tmp_path / "coca.pt")
    torch.manual_seed(5)
    torch.save(create_model(name).state_dict(), weights)
    torch.save(create_model(coca).state_dict(), coca_weights)
    base = {"model": name, "batch_size": 8}
    setups = {**engines(), "fsdp_ckpt": {"engine": "fsdp", "grad_checkpointing": True},
              "zero3_ckpt": {"ds_config": DS[3], "grad_checkpointing": True},
              "ddp_file": {"pretrained": weights},
              "fsdp_meta_file": {"engine": "fsdp", "sharded_init": "always", "pretrained": weights},
              "zero3_meta_file": {"ds_config": DS[3], "sharded_init": "always", "pretrained": weights},
              "fsdp_meta": {"engine": "fsdp", "sharded_init": "always"},
              "zero3_meta": {"ds_config": DS[3], "sharded_init": "always"}}  # fmt: skip
    coca_file = {"model": coca, "pretrained": coca_weights}
    setups.update({"coca_ddp": coca_file, "coca_fsdp": {**coca_file, "engine": "fsdp", "sharded_init": "always"},
                   "coca_zero3": {**coca_file, "ds_config": DS[3], "sharded_init": "always",
                                  "grad_checkpointing": True}})  # fmt: skip
    runs = [{"name": n, "steps": 6, "text_vocab": 20, "pad_texts": True, "config": {**base, **flags}}
            for n, flags in setups.items()]  # fmt: skip
    r = run_worker(tmp_path, runs, name="hf")
    assert r["coca_ddp"]["losses"][-1] < r["coca_ddp"]["losses"][0]
    for n in ("coca_fsdp", "coca_zero3"):
        assert_same_run(r[n], r["coca_ddp"], FP32_RTOL)
    assert r["ddp"]["losses"][-1] < r["ddp"]["losses"][0]
    for n in ("fsdp", "zero1", "zero2", "zero3", "fsdp_ckpt", "zero3_ckpt"):
        assert_same_run(r[n], r["ddp"], FP32_RTOL)
    for n in ("fsdp_meta_file", "zero3_meta_file"):
        assert_same_run(r[n], r["ddp_file"], FP32_RTOL)
    assert_same_run(r["zero3_meta"], r["fsdp_meta"], FP32_RTOL)


# Extended tier: in CI sharded init by test_layer_scale.py and the pretrained weights streamed into shards (below)
@pytest.mark.extended
def test_wide_model_runs_under_fsdp_and_zero3_with_sharded_init(tmp_path):
    """ViT-bigG-14 widths (vision 1664 / MLP 8192, text 1280, vocab 49408), 2 blocks per tower: built on meta,
    initialised shard by shard, one step on 2 ranks under fsdp and zero3. Building never needs the whole
    model on a rank, and both engines start from the same weights (the same sharded init)."""
    with open(os.path.join(REPO, "bigclip", "model", "configs", "ViT-bigG-14.json")) as f:
        arch = json.load(f)
    arch["vision_cfg"]["layers"] = arch["text_cfg"]["layers"] = 2
    arch["vision_cfg"]["image_size"] = 112  # fewer patches; the widths are what this test is about
    base = {"model": "bigG-2-blocks", "batch_size": 1, "sharded_init": "always"}
    runs = [
        {"name": "fsdp", "steps": 1, "arch": arch, "config": {**base, "engine": "fsdp"}},
        {"name": "zero3", "steps": 1, "arch": arch, "config": {**base, "ds_config": DS[3]}},
    ]
    # tensors of 4 MB and more are mmap'ed and unmapped on free, so RSS follows live memory between runs
    r = run_worker(tmp_path, runs, "wide", MALLOC_MMAP_THRESHOLD_=str(4 << 20))

    full_fp32 = 2 * r["fsdp"]["state_bytes"]["params"]  # world size 2: each rank holds half
    assert full_fp32 > 650e6  # ~176M parameters
    for name in ("fsdp", "zero3"):
        run = r[name]
        assert run["losses"][0] == run["losses"][0] and run["norms"][0] > 0
        assert run["state_bytes"]["params"] < 0.55 * full_fp32
    # Setup memory beyond what the engine keeps (its shards, DeepSpeed's buffers): with sharded init at most
    # one module gathered whole (the 253 MB token embedding is the largest); never the whole model. Measured:
    # 13 MiB (fsdp), 187 MiB (zero3); building the model whole first (--sharded-init never) costs 424 MiB.
    transient = {name: r[name]["build_rss_bytes"] - r[name]["build_state_bytes"] for name in r}
    assert transient["fsdp"] < 0.45 * full_fp32 and transient["zero3"] < 0.45 * full_fp32, transient
    # both engines start from the same weights: the model's init, run on DTensor shards
    assert r["zero3"]["losses"][0] == pytest.approx(r["fsdp"]["losses"][0], rel=1e-4)


def test_pretrained_streams_into_shards_under_fsdp_and_zero3(tmp_path):
    """--pretrained with sharded init on a ViT-B-32 (151M parameters), 2 ranks: OpenCLIP-layout safetensors
    written by OpenCLIP itself stream into each rank's shards. Every element each rank holds equals the file
    (compared where it is held, no gathering; together the ranks cover every element), and no rank's memory ever
    held the whole model: peak RSS growth over the build stays below the model's size plus one tensor (loading the
    file whole and then sharding it needs the model plus the shards)."""
    torch.manual_seed(0)
    reference = open_clip.create_model("ViT-B-32")
    state = reference.state_dict()
    num_params = sum(p.numel() for p in reference.parameters())
    path = str(tmp_path / "openclip-vit-b-32.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    largest = max(v.numel() * v.element_size() for v in state.values())  # the token embedding, 101 MB
    del state, reference

    base = {"model": "ViT-B-32", "batch_size": 1, "sharded_init": "always", "pretrained": path}
    runs = [
        {"name": "fsdp", "steps": 0, "compare_with_pretrained": True, "config": {**base, "engine": "fsdp"}},
        {"name": "zero3", "steps": 0, "compare_with_pretrained": True, "config": {**base, "ds_config": DS[3]}},
        {"name": "zero3_random_init", "steps": 0, "config": {**base, "pretrained": None, "ds_config": DS[3]}},
    ]
    r = run_worker(tmp_path, runs, "pretrained", MALLOC_MMAP_THRESHOLD_=str(4 << 20))
    for name in ("fsdp", "zero3"):
        run = r[name]
        assert "error" not in run, run
        check = run["pretrained_check"]
        assert check["compared"] == check["in_file"] and check["max_abs_diff"] == 0.0, (name, check)
        assert check["elements_compared"] == check["elements_expected"] == num_params, (name, check)
        # what the engine keeps is about half the model per rank; the load itself adds at most one tensor
        # The parameters a rank holds plus everything transient while building stay below the whole model plus
        # one tensor (measured: fsdp 320 MB, zero3 565 MB, model 605 MB, token embedding 101 MB); the gradient
        # and optimizer partitions DeepSpeed allocates up front are its training state, not the load's.
        state = run["state_bytes"]
        held = run["build_rss_bytes"] - state["grads"] - state["optimizer"]
        assert held < model_bytes + largest, (name, held, model_bytes)
    # Streaming the file costs at most one tensor more than initialising the same shards randomly.
    transient = {name: r[name]["build_rss_bytes"] - r[name]["build_state_bytes"] for name in r}
    assert transient["zero3"] < transient["zero3_random_init"] + largest, transient


def test_mission_deepspeed_launch_line(tmp_path):
    """`deepspeed launch/train.py --ds_config ds_configs/zero2.json [flags]` as written, 2 CPU processes."""
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    port = free_port()
    cmd = [
        launcher,
        "--master_port",
        str(port),
        "launch/train.py",
        "--ds_config",
        "ds_configs/zero2.json",
        "--model",
        "test-tiny",
        "--dataset-type",
        "synthetic",
        "--train-num-samples",
        "128",
        "--val-num-samples",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--precision",
        "fp32",
        "--workers",
        "0",
        "--lr",
        "1e-3",
        "--warmup",
        "2",
        "--log-every-n-steps",
        "1",
        "--gather-with-grad",
        "--logs",
        str(tmp_path),
        "--name",
        "ds",
    ]
    # LOCAL_SIZE is how DeepSpeed's CPU accelerator counts its "devices": 2 processes on this node.
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=subprocess_env(DS_ACCELERATOR="cpu", LOCAL_SIZE="2"),
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    run_dir = os.path.join(tmp_path, "ds")
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, 9))  # 128 samples / (8 x 2 ranks)
    assert losses[8] < losses[1]
    evals = [m for m in read_metrics(run_dir) if "eval/val_loss" in m]
    assert evals and evals[-1]["eval/num_samples"] == 32
    assert "engine deepspeed" in proc.stdout + proc.stderr
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "epoch_1", "manifest.json"))
    # DeepSpeed's inference-only shared-memory all-reduce is neither built nor given its per-rank /dev/shm buffers
    # (named by the port), which DeepSpeed would never remove
    assert "deepspeed_shm_comm" not in proc.stdout + proc.stderr
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer") and f"_{port}_" in n]


# Extended tier: in CI FSDP2's checkpoints (test_contracts.py) and validation (test_eval_dist.py) under torchrun
@pytest.mark.extended
def test_torchrun_fsdp_run_with_eval_and_checkpoint(tmp_path):
    """`torchrun --nproc_per_node 2 launch/train.py --engine fsdp ...`: trains, evaluates, saves."""
    proc = torchrun(
        2,
        [
            "--engine",
            "fsdp",
            "--model",
            "test-tiny",
            "--dataset-type",
            "synthetic",
            "--train-num-samples",
            "64",
            "--val-num-samples",
            "32",
            "--batch-size",
            "8",
            "--epochs",
            "1",
            "--precision",
            "amp_bf16",
            "--workers",
            "0",
            "--lr",
            "1e-3",
            "--warmup",
            "2",
            "--grad-checkpointing",
            "--accum-freq",
            "2",
            "--log-every-n-steps",
            "1",
            "--logs",
            str(tmp_path),
            "--name",
            "fsdp",
        ],
        DS_ACCELERATOR="cpu",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = os.path.join(tmp_path, "fsdp")
    assert sorted(step_losses(run_dir)) == [1, 2]
    assert any("eval/val_loss" in m for m in read_metrics(run_dir))
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "epoch_1", "manifest.json"))


# Extended tier: four processes (30 s); in CI FSDP2 and DDP step for step (above)
@pytest.mark.extended
def test_hsdp_on_a_real_2x2_mesh_matches_ddp(tmp_path):
    """4 ranks: --fsdp-replicate-degree 2 is a 2 (replicate) x 2 (shard) mesh (on 2 ranks it would be
    replicate-2 x shard-1, plain replication). Same losses as DDP and as 4-way FSDP; each rank holds half of
    the parameters and optimizer state (4-way FSDP: a quarter)."""
    tiny = {"model": "test-tiny", "batch_size": 4}
    runs = [{"name": name, "steps": 5, "config": {**tiny, **flags}}
            for name, flags in (("ddp", {}), ("fsdp", {"engine": "fsdp"}),
                                ("hsdp", {"engine": "fsdp", "fsdp_replicate_degree": 2}))]  # fmt: skip
    r = run_worker(tmp_path, runs, name="hsdp", nproc=4)
    assert_same_run(r["hsdp"], r["ddp"], FP32_RTOL)
    assert_same_run(r["fsdp"], r["ddp"], FP32_RTOL)
    ddp, fsdp, hsdp = (r[n]["state_bytes"]["total"] for n in ("ddp", "fsdp", "hsdp"))
    assert hsdp == pytest.approx(ddp / 2, rel=0.05) and fsdp == pytest.approx(ddp / 4, rel=0.05), (ddp, fsdp, hsdp)
