"""Engine selection, DeepSpeed config resolution and its errors, sharded-init decisions, `bigclip plan`.

Fast, single-process checks. The multi-process engine runs (equivalence against DDP, the mission's
`deepspeed` launch line, the wide ViT-bigG-14 model) are in test_engine_multiprocess.py.
"""

import json
import os

import pytest
from helpers import REPO, TINY_SYNTHETIC, python_train, step_losses

from bigclip import cli
from bigclip.engine import ds_config as dsc
from bigclip.errors import UserError

SHIPPED = {
    name: os.path.join(REPO, "ds_configs", f"{name}.json") for name in ("zero1", "zero2", "zero3", "zero3_offload")
}


def parse(*argv):
    cfg, launcher = cli.parse_train_args(list(argv))
    return cfg


def tiny(*argv):
    return parse("--model", "test-tiny", "--dataset-type", "synthetic", *argv)


def write(tmp_path, data, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# ---------------------------------------------------------------------------------- engine selection
@pytest.mark.parametrize("flag", ["--ds_config", "--deepspeed_config", "--ds-config"])
def test_a_deepspeed_config_selects_the_deepspeed_engine(flag):
    cfg = tiny(flag, SHIPPED["zero2"])
    assert cfg.engine == "deepspeed" and cfg.ds_config == SHIPPED["zero2"]


def test_deepspeed_flag_and_launcher_local_rank_select_deepspeed():
    cfg, launcher = cli.parse_train_args(
        ["--model", "test-tiny", "--dataset-type", "synthetic", "--deepspeed", "--local_rank=1"]
    )
    assert cfg.engine == "deepspeed" and launcher["local_rank"] == 1


def test_ds_config_with_another_engine_is_refused():
    with pytest.raises(UserError, match=r"--ds_config selects the deepspeed engine but --engine is fsdp"):
        tiny("--engine", "fsdp", "--ds_config", SHIPPED["zero2"])


def test_fsdp_flags_need_the_fsdp_engine():
    with pytest.raises(UserError, match=r"--fsdp-offload-cpu: only applies to --engine fsdp"):
        tiny("--fsdp-offload-cpu")
    assert tiny("--engine", "fsdp", "--fsdp-hybrid", "--fsdp-no-reshard-after-forward").fsdp_hybrid


# ---------------------------------------------------------------------------------- DeepSpeed configs
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_fill_every_auto_from_flags(name):
    cfg = tiny(
        "--ds_config",
        SHIPPED[name],
        "--batch-size",
        "16",
        "--accum-freq",
        "2",
        "--grad-clip-norm",
        "1.0",
        "--precision",
        "amp_bf16",
        "--lr",
        "3e-4",
        "--wd",
        "0.1",
    )
    ds = dsc.resolve(cfg.sections.engine, world_size=4, device_type="cpu", hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 16
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16 * 2 * 4  # computed, never asked for
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert "auto" not in json.dumps(ds)
    if "optimizer" in ds:  # zero3_offload: DeepSpeed's own (CPU) Adam with bigclip's hyper-parameters
        expected = {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.1}
        assert ds["optimizer"]["params"] == expected
    else:  # bigclip hands DeepSpeed its own torch optimizer
        assert ds["zero_allow_untested_optimizer"] is True


def test_precision_maps_to_deepspeed_sections():
    fp32 = dsc.resolve(tiny("--ds_config", SHIPPED["zero2"], "--precision", "fp32").sections.engine, 2, "cpu")
    assert not fp32["bf16"]["enabled"] and not fp32["fp16"]["enabled"]
    amp_cpu = dsc.resolve(tiny("--ds_config", SHIPPED["zero2"], "--precision", "amp").sections.engine, 2, "cpu")
    assert amp_cpu["bf16"]["enabled"]  # amp on CPU means bfloat16
    amp_gpu = dsc.resolve(tiny("--ds_config", SHIPPED["zero2"], "--precision", "amp").sections.engine, 2, "cuda")
    assert amp_gpu["fp16"]["enabled"] and amp_gpu["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_contradicting_micro_batch_stops_before_work(tmp_path):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 2}})
    with pytest.raises(UserError) as e:
        tiny("--ds_config", path, "--batch-size", "64")
    msg = str(e.value)
    assert path in msg and "train_micro_batch_size_per_gpu is 32" in msg and "--batch-size 64" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "section,flags,named",
    [
        ({"gradient_accumulation_steps": 4}, ["--accum-freq", "2"], "--accum-freq 2"),
        ({"gradient_clipping": 1.0}, [], "--grad-clip-norm None"),
        ({"bf16": {"enabled": True}}, ["--precision", "fp32"], "--precision fp32"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, ["--lr", "0.001"], "--lr 0.001"),
        ({"optimizer": {"type": "AdamW"}}, ["--opt", "timm/lamb"], "--opt timm/lamb"),
    ],
)
def test_each_contradiction_names_the_flag(tmp_path, section, flags, named):
    path = write(tmp_path, section)
    with pytest.raises(UserError, match=named.replace("(", r"\(")):
        tiny("--ds_config", path, *flags)


def test_explicit_train_batch_size_must_be_micro_x_accum_x_world(tmp_path):
    path = write(tmp_path, {"train_batch_size": 100})
    cfg = tiny("--ds_config", path, "--batch-size", "8")
    with pytest.raises(UserError, match=r"train_batch_size is 100 but --batch-size 8 x --accum-freq 1 x 2"):
        dsc.resolve(cfg.sections.engine, world_size=2, device_type="cpu")
    assert (
        dsc.resolve(
            tiny(
                "--ds_config", write(tmp_path, {"train_batch_size": 16}, "ok.json"), "--batch-size", "8"
            ).sections.engine,
            2,
            "cpu",
        )["train_batch_size"]
        == 16
    )


def test_invalid_json_names_the_file_and_line(tmp_path):
    text = '{\n  "train_micro_batch_size_per_gpu": "auto",\n  "zero_optimization": {"stage": 2,}\n}'
    path = write(tmp_path, text)
    with pytest.raises(UserError) as e:
        tiny("--ds_config", path)
    assert str(e.value).startswith(f"--ds_config {path}: not valid JSON at line 3")


def test_bad_json_through_the_cli_is_one_line_and_exit_code_2(tmp_path, capsys):
    path = write(tmp_path, '{"zero_optimization": {"stage": 2}')
    code = cli.main(
        ["--model", "test-tiny", "--dataset-type", "synthetic", "--ds_config", path, "--logs", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"{path}: not valid JSON at line 1" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # the config itself; no run folder was made


def test_missing_config_file_and_refused_sections(tmp_path):
    with pytest.raises(UserError, match=r"file not found"):
        tiny("--ds_config", str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match=r"remove the \"scheduler\" section"):
        tiny("--ds_config", write(tmp_path, {"scheduler": {"type": "WarmupLR"}}))
    with pytest.raises(UserError, match=r"zero_optimization.stage must be 0, 1, 2 or 3"):
        tiny("--ds_config", write(tmp_path, {"zero_optimization": {"stage": 4}}, "s4.json"))
    with pytest.raises(UserError, match=r"foo.bar is \"auto\" but bigclip cannot fill it"):
        tiny("--ds_config", write(tmp_path, {"foo": {"bar": "auto"}}, "auto.json"))


# ------------------------------------------------------------------------------------- sharded init
def test_giant_models_are_built_on_meta_under_sharding_engines():
    from bigclip.dist import World
    from bigclip.engine import build_model
    from bigclip.engine.sharded_init import count_params, is_meta
    from bigclip.model import create_model

    def build(name, *flags):
        cfg = parse("--model", name, "--dataset-type", "synthetic", *flags)

        def factory(**overrides):
            if name != "test-tiny" and overrides.get("device") != "meta":
                raise AssertionError(f"{name} was built whole")
            return create_model(name, **overrides)

        return build_model(cfg.sections.engine, World(), factory)

    # auto: from 500M parameters; the factory is asked for a meta model first (never a real giant one)
    assert is_meta(build("ViT-bigG-14", "--engine", "fsdp"))
    assert is_meta(build("ViT-H-14", "--engine", "fsdp"))
    assert is_meta(build("ViT-bigG-14", "--ds_config", SHIPPED["zero3"]))
    assert count_params(build("ViT-bigG-14", "--engine", "fsdp")) > 2.5e9
    assert not is_meta(build("test-tiny", "--engine", "fsdp"))
    assert not is_meta(build("test-tiny", "--ds_config", SHIPPED["zero3"]))
    assert is_meta(build("test-tiny", "--engine", "fsdp", "--sharded-init", "always"))
    with pytest.raises(UserError, match=r"--sharded-init always: needs an engine that shards parameters"):
        parse("--model", "test-tiny", "--dataset-type", "synthetic", "--sharded-init", "always")


# --------------------------------------------------------------------------------------- bigclip plan
def test_plan_arithmetic_and_printout(capsys):
    from bigclip.memory import model_facts, state_bytes

    facts = model_facts("ViT-bigG-14")
    psi = facts.params
    # OpenCLIP issue #296: 16 bytes per parameter under DDP is ~40 GB for ViT-bigG-14
    assert 38e9 < state_bytes("ddp", psi, 8) < 42e9
    for n in (2, 8, 1024):
        assert state_bytes("zero3", psi, n) == pytest.approx(16 * psi / n)
        assert state_bytes("zero3", psi, n) < state_bytes("zero2", psi, n)
        # ZeRO-1 keeps full gradients only between micro-batches (test_plan_measured.py's accumulation test)
        assert state_bytes("zero1", psi, n) == state_bytes("zero2", psi, n)
    assert state_bytes("fsdp", psi, 2, "fp32") / state_bytes("ddp", psi, 2, "fp32") == 0.5
    assert cli.main(["plan", "--model", "ViT-H-14", "--gpus", "8", "1024", "--gpu-mem", "40"]) == 0
    out = capsys.readouterr().out
    assert "ViT-H-14" in out and "| zero3 |" in out and "| fsdp |" in out and "max batch @ 40 GB" in out


def test_dry_run_counts_hsdp_state_per_replica_group():
    """--fsdp-replicate-degree R: each replica group of world/R ranks holds one copy of the state, so --dry-run's
    state per GPU is FSDP2's over world/R ranks (counted over all of them it was R times too little)."""
    from bigclip import dry_run, memory
    from bigclip.config import resolve
    from bigclip.dist import World
    from bigclip.engine import state_ranks

    base = {"model": "ViT-B-32", "dataset_type": "synthetic", "batch_size": 16, "engine": "fsdp"}
    hsdp, fsdp = resolve({**base, "fsdp_replicate_degree": 2}).sections.engine, resolve(base).sections.engine
    assert state_ranks(hsdp, World(world_size=8)) == 4 and state_ranks(fsdp, World(world_size=8)) == 8
    facts = memory.model_facts("ViT-B-32")

    def line(cfg, n):
        return dry_run._memory_lines(cfg, World(world_size=n), "fsdp", facts)[0]

    def state(text):
        return text.split(": state ")[1].split(" GiB")[0]

    assert "8 rank(s) (the state over 4 of them)" in line(hsdp, 8) and "of them" not in line(fsdp, 8)
    assert state(line(hsdp, 8)) == state(line(fsdp, 4)) != state(line(fsdp, 8))


def test_plan_shows_hsdp_rows_whose_state_is_the_runs_on_one_node(capsys):
    """FSDP2 can keep the state in replica groups (HSDP): its plan row beside the plain one holds, per GPU, what a
    run on one node holds; --dry-run of a run with that many groups (--fsdp-replicate-degree) says the same. A GPU
    count that is not whole nodes has none; the fit lines weigh it beside the other setups."""
    from bigclip import dry_run
    from bigclip.commands.plan import render
    from bigclip.config import resolve
    from bigclip.dist import World
    from bigclip.memory import StateRecipe, fitting_setups, max_batch, model_facts, model_state_bytes, peak_parts

    facts, amp = model_facts("ViT-bigG-14"), StateRecipe("amp")
    table = render(["ViT-bigG-14"], [64, 8, 12], [80], 32, "amp", gpus_per_node=8)
    rows = {line.split(" | ")[0][2:]: line.strip(" |").split(" | ")[1:] for line in table.splitlines() if "|" in line}
    node = f"{model_state_bytes('fsdp', facts, 8, amp) / 2**30:.1f}"
    assert rows["fsdp HSDP, 8 GPUs per node"][:3] == [node, node, "n/a"]  # 64 GPUs: 8 groups; 12: not whole nodes
    assert rows["fsdp"][:2] == [f"{model_state_bytes('fsdp', facts, 64, amp) / 2**30:.1f}", node]
    hsdp_batch = max_batch(facts, "fsdp", 64, 80e9, True, amp, state_ranks=8)
    assert rows["fsdp HSDP, 8 GPUs per node"][3].endswith(f" / {hsdp_batch}")
    assert hsdp_batch < max_batch(facts, "fsdp", 64, 80e9, True, amp)  # more state per GPU, fewer samples
    assert [name for name in rows if "HSDP" in name] == ["fsdp HSDP, 8 GPUs per node"]  # the others cannot
    assert "| fsdp HSDP" not in render(["ViT-bigG-14"], [8], [80], 32, "amp", gpus_per_node=8)  # one node: FSDP
    # --dry-run of --fsdp-replicate-degree 8 on 64 ranks: the same state per GPU
    cfg = resolve({"model": "ViT-bigG-14", "dataset_type": "synthetic", "batch_size": 32, "engine": "fsdp",
                   "fsdp_replicate_degree": 8}).sections.engine  # fmt: skip
    line = dry_run._memory_lines(cfg, World(world_size=64), "fsdp", facts)[0]
    assert "the state over 8 of them" in line and f"state {node} GiB" in line
    # the fit lines: HSDP is a candidate beside the plain setups, with the state of its group
    fits = {(name, recipe): state for state, name, recipe in fitting_setups(facts, 64, 80e9, 32, group=8)}
    assert fits[("fsdp HSDP", amp)] == peak_parts("fsdp", facts, 64, amp, 32, True, state_ranks=8)["state"]
    assert not any("HSDP" in name for _, name, _ in fitting_setups(facts, 64, 80e9, 32)) and ("fsdp", amp) in fits
    assert cli.main(["plan", "--model", "ViT-B-32", "--gpus", "16", "--gpu-mem", "40", "--gpus-per-node", "4"]) == 0
    assert "| fsdp HSDP, 4 GPUs per node |" in capsys.readouterr().out
    assert cli.main(["plan", "--gpus-per-node", "0"]) == 2
    assert "argument --gpus-per-node: 0 is not a positive integer" in capsys.readouterr().err


def test_plan_for_towers_without_an_activation_formula(capsys, tmp_path):
    """ResNet and timm image towers: the state rows hold (parameter count as OpenCLIP's model), the activations are
    traced on meta (memory/traced.py), so a batch size is suggested; a tower that cannot be traced says so."""
    import dataclasses

    import open_clip

    from bigclip.memory import activation_bytes, max_batch, model_facts, state_bytes

    facts = model_facts("RN50")
    assert facts.params == sum(p.numel() for p in open_clip.create_model("RN50").parameters())
    assert facts.uncounted is None and len(facts.towers) == 1 and len(facts.traced) == 1  # text formula, image traced
    (resnet,) = facts.traced
    assert len(resnet.blocks) == 16  # the bottleneck blocks, the units checkpointed
    assert state_bytes("ddp", facts.params, 8) == 16 * facts.params
    image_only = activation_bytes(dataclasses.replace(facts, towers=()), 1, False)
    assert image_only == resnet.kept_bytes(False, 2) and 20 * 2**20 < image_only < 200 * 2**20
    assert max_batch(facts, "ddp", 8, 80e9, False) > max_batch(facts, "ddp", 8, 40e9, False) > 0
    assert max_batch(dataclasses.replace(facts, uncounted="image tower (X)"), "ddp", 8, 80e9, False) is None
    timm_dir = tmp_path / "timm"
    timm_dir.mkdir()
    text_cfg = {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
    vision_cfg = {"timm_model_name": "test_resnet", "timm_pool": "", "timm_proj": "linear", "image_size": 64}
    (timm_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": {"embed_dim": 32, "vision_cfg": vision_cfg, "text_cfg": text_cfg}})
    )
    assert cli.main(["plan", "--model", "RN50", f"local-dir:{timm_dir}", "--gpus", "8", "--gpu-mem", "40"]) == 0
    out = capsys.readouterr().out
    assert "not counting" not in out and "not estimated" not in out
    assert out.count("| ddp | ") == 2 and "| ddp | 1.5 | n/a |" not in out
    # --dry-run's memory line counts them too
    from bigclip import dry_run
    from bigclip.config import resolve
    from bigclip.dist import World

    cfg = resolve({"model": "RN50", "dataset_type": "synthetic", "batch_size": 16})
    lines = dry_run.report(cfg.sections.model, cfg.sections.engine, World())
    assert "model RN50: 102.0M parameters" in lines
    assert "not estimated" not in lines[-1] and "activations 0.0 GiB" not in lines[-1], lines[-1]


# ------------------------------------------------------------------------------------- world size 1
@pytest.mark.slow
def test_fsdp_in_a_single_process(tmp_path):
    """--engine fsdp without a launcher: world size 1 (a process group of one), same losses as ddp."""
    common = [*TINY_SYNTHETIC, "--epochs", "1", "--logs", str(tmp_path), "--save-frequency", "0"]
    for name, extra in {"ddp": [], "fsdp": ["--engine", "fsdp"]}.items():
        assert cli.main([*common, "--name", name, *extra]) == 0
    ddp, fsdp = (step_losses(os.path.join(tmp_path, n)) for n in ("ddp", "fsdp"))
    assert len(ddp) == 8 and ddp.keys() == fsdp.keys()
    for step in ddp:
        assert fsdp[step] == pytest.approx(ddp[step], rel=1e-5)


@pytest.mark.slow
def test_deepspeed_in_a_single_process(tmp_path):
    """A DeepSpeed config in a plain `python launch/train.py` run: ZeRO-3 at world size 1."""
    proc = python_train(
        [
            *TINY_SYNTHETIC,
            "--epochs",
            "1",
            "--logs",
            str(tmp_path),
            "--save-frequency",
            "0",
            "--name",
            "zero3",
            "--ds_config",
            SHIPPED["zero3"],
        ],
        DS_ACCELERATOR="cpu",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(step_losses(os.path.join(tmp_path, "zero3"))) == 8


_FORWARD_WITHOUT_AUTOCAST = """
import torch
from bigclip.build import build_engine, build_model
from bigclip.config import resolve
from bigclip.dist import World

world = World()
cfg = resolve(dict(model="test-tiny", dataset_type="synthetic", precision="amp_bf16", batch_size=2, workers=0,
                   ds_config={ds_config!r}))
engine = build_engine(cfg.sections.engine, build_model(cfg.sections.model, cfg.sections.engine, world), world)
images, texts = torch.randn(2, 3, 16, 16), torch.randint(1, 250, (2, 32))
with torch.autocast("cpu", enabled=False):  # what DeepSpeed's forward does to an outer autocast on CUDA
    bare = engine.module(images=images, texts=texts)["image_features"]  # as the loop and eval call it
    positional = engine.module(images, texts)["image_features"]
with engine.autocast():
    under_autocast = engine.module(images=images, texts=texts)["image_features"]
assert bare.dtype == torch.bfloat16 and torch.isfinite(bare).all()
torch.testing.assert_close(bare, positional)
torch.testing.assert_close(bare.float(), under_autocast.float(), rtol=2e-2, atol=2e-2)
print("same features")
"""


@pytest.mark.slow
def test_deepspeed_bf16_forward_needs_no_outer_autocast():
    """DeepSpeed's forward turns an outer CUDA autocast off (the GPU kit found `--precision amp_bf16 --ds_config`
    stopping at the first convolution: fp32 images, bf16 weights). On CPU its check misses the CPU autocast, so
    the run here disables autocast as it does on CUDA: the engine casts the images itself, and the features equal
    those computed under autocast."""
    import subprocess
    import sys

    code = _FORWARD_WITHOUT_AUTOCAST.format(ds_config=SHIPPED["zero2"])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0 and "same features" in proc.stdout, proc.stderr[-3000:]
