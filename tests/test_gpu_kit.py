"""The GPU acceptance kit (bench/gpu) cannot rot between the times a GPU is at hand: its smoke run (every part,
on CPU at toy sizes) produces the report and JSON with the figures each part promises, and prepare.sh's wheels
are complete for the GPU machine and install there with no network."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from helpers import REPO, subprocess_env

from bigclip.model.switchback import VARIANTS

KIT = os.path.join(REPO, "bench", "gpu")
PARTS = ("env", "losses", "int8", "train", "engines", "ckpt", "giant", "decode")


# Extended tier: every part of the GPU kit at CPU sizes (2-5 min); in CI its flags, dependencies and wheels (below)
@pytest.mark.extended
@pytest.mark.slow
def test_smoke_run_reports_every_part_with_its_figures(tmp_path):
    out = tmp_path / "kit"
    env = subprocess_env(PYTHON=sys.executable, DS_ACCELERATOR="cpu")
    proc = subprocess.run(["bash", os.path.join(KIT, "run.sh"), "--smoke", str(out)], capture_output=True, text=True,
                          env=env, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["parts"]
    assert {name: r["status"] for name, r in results.items()} == dict.fromkeys(PARTS, "ok")
    tables = {name: r["tables"] for name, r in results.items()}
    # every row says when its part wrote it (seconds since the part's process started): where each budget went
    for name, r in results.items():
        for table in r["tables"].values():
            stamps = [row["at_s"] for row in table]
            assert stamps == sorted(stamps) and 0 < stamps[0] and stamps[-1] <= r["wall_s"] + 1, (name, stamps)

    rows = tables["losses"]["rows"]  # long form: one row per (family, n, d, dtype, impl, precision)
    assert {(r["family"], r["impl"], r["precision"]) for r in rows} == {
        (family, impl, precision)
        for family, peer in (("clip", "inf-cl"), ("siglip", "siglip-kernel"))
        for impl, precision in (("fused", "exact"), ("fused", "fast"), ("naive", None), ("chunked", None),
                                (peer, None), ("triton", None))
    }  # fmt: skip
    for r in rows:
        if r["impl"] in ("inf-cl", "siglip-kernel"):
            assert r["ms"] == "not run: CUDA only", r  # the peers' rows are there; their kernels need a GPU
            continue
        assert isinstance(r["ms"], float) and "tflops" in r and "peak_gib" in r, r
        # against the float64 formulas on the same features: fp32 exact to rounding; bf16 within its own rounding
        # of the gradients (2^-9 relative: 2e-3) for bigclip's paths, open_clip's bf16 logits a little more
        bound = 1e-5 if r["dtype"] == "float32" and r["precision"] != "fast" else 6e-3
        assert float(r["max_rel_err"]) < bound, r

    layers = tables["int8"]["layers"]
    assert {r["impl"] for r in layers} == {"bf16", *VARIANTS}  # fp8 and torchao's int8 are CUDA-only arms
    assert all(isinstance(r["ms"], float) and r["speedup_vs_bf16"] > 0 for r in layers), layers
    assert all(r["int8_matmuls"] == 2 for r in layers if r["impl"].startswith("SwitchBack"))
    assert {r["impl"] for r in tables["int8"]["tower"]} == {"bf16", *VARIANTS}

    runs = tables["train"]["runs"]
    assert {r["trainer"] for r in runs} == {"bigclip", "open_clip_train"}
    assert all(r["samples_per_s_per_gpu"] > 0 for r in runs)

    engines = {r["engine"]: r for r in tables["engines"]["engines"]}
    assert set(engines) == {"ddp", "fsdp2", "zero2", "zero3"}
    for name, r in engines.items():  # fp32 in the smoke run: every engine takes DDP's steps
        assert float(r["max_rel_diff_vs_ddp"]) < 1e-4, (name, r)

    saves = tables["ckpt"]["saves"]  # per state and writer: the first save (repetition 0), then the repetitions
    assert {(r["state"], r["writer"], r["repetition"]) for r in saves} == {
        (state, writer, repetition)
        for state in ("ViT-L-14 + AdamW", "ViT-bigG-14 leanest")
        for writer in ("thread", "process")
        for repetition in (0, 1)
    }, saves
    for r in saves:
        assert r["default"] == (r["writer"] == "thread") and r["commit_s"] > 0 and r["steps_during_save"] >= 1, r
        assert r["within_target"] == (r["blocked_s"] <= 1 and r["slowdown_pct"] <= 5), r
    giant = tables["giant"]["giant"]
    assert [r["model"] for r in giant[:2]] == ["test-tiny", "test-tiny"]
    # EVA02-E-14's row, trained as a tiny EVA (the same timm trunk code) in the lean setup, planned with its
    # activations traced on meta; peak memory is measured on CUDA only
    eva = giant[2]
    assert eva["model"].endswith("eva02-tiny") and "adamw8bit" in eva["setup"] and eva["s_per_step"] > 0, eva
    assert "peak_gib" in eva and eva["plan_gib"] > eva["plan_state_gib"], eva

    assert all(r["mean_grey_levels"] < 0.3 for r in tables["decode"]["pixels"])  # the device path vs PIL's full decode
    loaders = {r["decode"]: r for r in tables["decode"]["loader"]}
    assert set(loaders) == {"device", "reduced", "openclip"} and all(r["samples"] > 0 for r in loaders.values())
    (crossover,) = tables["decode"]["crossover"]  # one size, one worker count in the smoke run
    assert crossover["auto_picks"] == "reduced" and crossover["faster"] in ("device", "reduced")  # auto on a CPU

    report = (out / "report.md").read_text()
    for name in PARTS[1:]:
        assert f"## {name}: " in report


def test_a_parts_own_budget_is_a_flag_and_a_malformed_one_is_refused_in_one_line(tmp_path):
    suite = [sys.executable, os.path.join(KIT, "suite.py"), "--smoke", "--parts", "env"]
    proc = subprocess.run([*suite, "--part-s", "env=1", str(tmp_path / "a")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # a part that did not run is not a pass
    status = json.loads((tmp_path / "a" / "results.json").read_text())["parts"]["env"]["status"]
    assert status.startswith("not run: under 5 s"), status  # the 1 s budget replaced the smoke run's 60 s
    for bad in ("envv=30", "env=soon"):
        proc = subprocess.run([*suite, "--part-s", bad, str(tmp_path / "b")], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert f"--part-s {bad}: expected PART=SECONDS" in proc.stderr
    assert not (tmp_path / "b").exists()  # refused before anything is written


def test_every_runtime_dependency_is_carried_to_or_found_on_the_gpu_machine():
    """prepare.sh's three lists (the wheels it carries, the GPU machine's own packages, those the kit never imports)
    name every runtime dependency bigclip installs: one missing from them would fail every part of the kit on the
    GPU machine, which has no network to fetch it."""
    text = open(os.path.join(KIT, "prepare.sh")).read()

    def names(found: str) -> set[str]:
        return {re.sub(r"[-_.]+", "-", name).lower() for name in re.findall(r"[A-Za-z0-9_.-]+", found)}

    pinned = re.sub(r"#.*", "", re.search(r"^pinned=\((.*?)^\)", text, re.M | re.S)[1])  # comments out
    carried = names(" ".join(re.findall(r"([A-Za-z0-9_.-]+)==", pinned)))
    present = names(re.search(r'^present="(.*?)"', text, re.M | re.S)[1])
    not_carried = names(re.search(r'^not_carried="(.*?)"', text, re.M)[1])
    pyproject = open(os.path.join(REPO, "pyproject.toml")).read()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)[1]
    required = names(" ".join(re.findall(r'^\s*"([A-Za-z0-9_.-]+)', dependencies, re.M)))
    assert {"torch", "simplejpeg", "webdataset"} <= required
    assert required - carried - present - not_carried == set()


@pytest.mark.slow  # it downloads the wheels from the package registry
def test_prepared_wheels_are_complete_and_install_offline_for_python_3_12(tmp_path):
    # With a stock python3, as on a fresh machine: a new venv's interpreter, without `wheel` or torch.
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "stock")], check=True, timeout=300)
    stock = str(tmp_path / "stock" / "bin" / "python")
    lacks = subprocess.run([stock, "-c", "import wheel"], capture_output=True, timeout=60)
    assert lacks.returncode != 0, "a fresh venv has no wheel package"
    proc = subprocess.run(
        ["bash", os.path.join(KIT, "prepare.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": stock, "PIP_NO_CACHE_DIR": "1"},  # builds DeepSpeed's wheel afresh
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = proc.stdout.strip().splitlines()[-1]
    names = sorted(os.listdir(wheels))
    assert len({n.split("-")[0].lower() for n in names}) == len(names)  # one version of each
    assert sum(os.path.getsize(os.path.join(wheels, n)) for n in names) < 48 * 2**20
    with zipfile.ZipFile(os.path.join(wheels, next(n for n in names if n.startswith("deepspeed")))) as z:
        assert not any(n.endswith(".so") for n in z.namelist())  # no compiled ops: it runs on any CUDA
    # What the GPU machine's run.sh does, with no network, for CPython 3.12 whatever Python runs the test.
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", str(site), "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
               "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
               *(os.path.join(wheels, n) for n in names)]  # fmt: skip
    proc = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"deepspeed", "open_clip_train", "webdataset", "torchdata", "pydantic_core"} <= set(os.listdir(site))
    python312 = _python_3_12()
    if python312:  # what needs nothing from the GPU machine's image imports under 3.12 here, the compiled one too
        code = (
            "import glob, importlib.util, braceexpand, hjson, ftfy, annotated_types\n"
            f"so = glob.glob({str(site)!r} + '/pydantic_core/_pydantic_core*.so')[0]\n"
            "spec = importlib.util.spec_from_file_location('pydantic_core._pydantic_core', so)\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        )
        proc = subprocess.run([python312, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(site)})
        assert proc.returncode == 0, proc.stderr[-3000:]


def _python_3_12() -> str | None:
    """A CPython 3.12 interpreter on this machine, if any (pyenv's own, not its shim, which needs a selection)."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    if found:
        return found[-1]
    path = shutil.which("python3.12")
    return path if path and "/shims/" not in path else None


# Extended tier: the tuner's interpreted kernels (1 min); in CI the fused loss reads the shipped plans
# (test_loss_triton.py)
@pytest.mark.extended
@pytest.mark.slow
def test_the_loss_tuner_writes_plans_the_fused_loss_reads(tmp_path):
    """bench/gpu/tune_losses.py end to end on CPU (Triton's interpreter, toy sizes): its file has a plan for every
    family, dtype and N range, each measurement it chose from, where it was made, and the launchers read it."""
    out = tmp_path / "tuned.json"
    env = subprocess_env(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "bench"), KIT]))
    proc = subprocess.run([sys.executable, os.path.join(KIT, "tune_losses.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads(out.read_text())
    assert table["source"].startswith("bench/gpu/tune_losses.py on CPU (smoke run")
    steps = {(m["step"], m["family"], m["dtype"]) for m in table["measurements"]}
    assert {("tile", "clip", "bfloat16"), ("chunk", "siglip", "float32"), ("naive", "clip", "bfloat16")} <= steps
    for family in ("clip", "siglip"):
        for dtype in ("bfloat16", "float16", "float32"):
            plans = table["plans"][family][dtype]
            assert [p["max_n"] for p in plans] == [32768, 131072, None], plans
    measured = [m for m in table["measurements"] if m["step"] == "chunk" and m["family"] == "clip"]
    fastest_at_64 = min((m for m in measured if m["n"] == 64), key=lambda m: m["ms"])["chunk"]
    assert table["plans"]["clip"]["bfloat16"][0]["chunk_rows"] == fastest_at_64

    import torch

    from bigclip.loss import fused_tuning

    fused_tuning.use_table(table)
    try:
        plan = fused_tuning.launch_plan("clip", torch.bfloat16, 100000, 64, torch.device("cpu"), None)
        assert plan.chunk_rows == table["plans"]["clip"]["bfloat16"][1]["chunk_rows"]
    finally:
        fused_tuning.use_table(None)


@pytest.mark.slow
def test_giant_levers_reports_every_setup_its_ratio_to_amp_and_its_profile():
    """bench/gpu/giant_levers.py --profile on CPU at toy size (issue 41's prepared GPU measurement): a row per
    setup, its step time against amp_bf16 + AdamW's, and the packed update's calls: a few per step for the whole
    optimizer, one per block's windows (and per tensor outside the blocks) when stepped in the backward."""
    env = subprocess_env(PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "bench"), KIT]))
    cmd = [sys.executable, os.path.join(KIT, "giant_levers.py"), "--model", "test-tiny", "--batch", "4", "--steps",
           "2", "--profile"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row["setup"]: row for row in map(json.loads, re.findall(r"^\{.*\}$", proc.stdout, re.M))}
    assert list(rows) == ["amp_bf16, adamw", "pure_bf16, adamw", "pure_bf16, adamw8bit",
                          "pure_bf16, adamw, optimizer in backward",
                          "pure_bf16, adamw8bit, optimizer in backward (leanest)"]  # fmt: skip
    assert rows["amp_bf16, adamw"]["vs_amp"] == 1.0
    for row in rows.values():
        assert row["s_per_step"] > 0 and row["profile_clock"] == "cpu" and len(row["profile_top"]) > 3
    calls = {setup: row["window_update_calls"] for setup, row in rows.items()}
    assert calls["amp_bf16, adamw"] == 0  # torch's AdamW
    assert 0 < calls["pure_bf16, adamw8bit"] < 8 < calls["pure_bf16, adamw8bit, optimizer in backward (leanest)"]
