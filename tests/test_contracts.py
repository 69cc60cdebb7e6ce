"""The contracts of docs/architecture.md, tested through nothing but their interfaces.

- Every engine names a CheckpointLayout; a save through stage/write and a load through another engine's
  layout give back exactly the weights (and the optimizer state: the next step's loss is the same), and the
  layout's one-process reader gives the same weights for export.
- raise_together: a problem found on one rank stops every rank with that rank's message.
- TrainState is saved and restored as one object; older records keep defaults for new fields.
- Engines own their flags' rules (config validation asks every engine).
- The package has no import cycles (imports inside functions count) and no stdlib imports inside functions.
"""

import ast
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, subprocess_env, torchrun_cmd

from bigclip.config import resolve
from bigclip.errors import UserError
from bigclip.train_state import TrainState

PACKAGE = os.path.join(REPO, "bigclip")


@pytest.mark.slow
def test_every_engine_round_trips_its_state_through_its_checkpoint_layout(tmp_path):
    out = tmp_path / "out.json"
    cmd = torchrun_cmd(2, os.path.join(REPO, "tests", "layout_worker.py"), str(tmp_path / "ckpts"), str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=subprocess_env(DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    expected = {"ddp": "dcp", "fsdp": "dcp", "zero2": "deepspeed", "zero3": "deepspeed"}
    for name, layout in expected.items():
        run = r[name]
        assert run["is_layout"] and run["layout"] == layout, name
        assert run["differs_before"], name  # the fresh engine really started elsewhere
        assert run["weights_equal"] and run["export_equal"], name
        assert run["next_loss"][0] == pytest.approx(run["next_loss"][1], rel=1e-6, abs=1e-7), name
    assert r["zero2"]["extra"] == {"zero_stage": 2} and r["zero3"]["extra"] == {"zero_stage": 3}
    rank0, rank1 = r["files_by_rank"]
    # DCP: DDP's replicated state is written half by each rank; FSDP's shards by their owners.
    for name in ("ddp", "fsdp"):
        assert ".metadata" in rank0[name] and ".metadata" not in rank1[name], name
        assert any(f.startswith("__0_") for f in rank0[name]) and any(f.startswith("__1_") for f in rank1[name])
    # DeepSpeed: each rank hands over its own ZeRO partition files, and no other rank's.
    for name in ("zero2", "zero3"):
        assert any("zero_pp_rank_0_" in f for f in rank0[name]) and not any("rank_1_" in f for f in rank0[name])
        assert any("zero_pp_rank_1_" in f for f in rank1[name]) and not any("rank_0_" in f for f in rank1[name])
    assert r["raise_together"] == "rank 1 found a problem"
    assert r["raise_together_result"] == 41  # rank 0's result, where the check ran


def test_train_state_round_trips_as_one_record():
    state = TrainState(step=7, epoch=1, samples_seen=448, batches_in_epoch=3, nonfinite_streak=1, nonfinite_steps=2)
    state.data = {"epoch": 1, "loader": {"worker": [5, 120]}}  # this rank's: saved in its own rank file
    record = json.loads(json.dumps({**state.to_record(), "config": {"model": "test-tiny"}}))
    assert "data" not in record
    assert TrainState.from_record({**record, "data": state.data}) == state
    old = {"step": 16, "epoch": 2, "samples_seen": 128, "batches_in_epoch": 0, "config": {}}  # before TrainState
    assert TrainState.from_record(old) == TrainState(step=16, epoch=2, samples_seen=128)
    state.advance(samples=64, accum_freq=2)
    assert (state.step, state.samples_seen, state.batches_in_epoch) == (8, 512, 5)
    state.finish_epoch()
    assert (state.epoch, state.batches_in_epoch) == (2, 0)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"fsdp_hybrid": True}, "--fsdp-hybrid: only applies to --engine fsdp (the engine is ddp)"),
        ({"engine": "deepspeed", "fsdp_offload_cpu": True}, "--fsdp-offload-cpu: only applies to --engine fsdp"),
        ({"sharded_init": "always"}, "--sharded-init always: needs an engine that shards parameters"),
        ({"engine": "nccl"}, "--engine 'nccl': choose one of ddp, fsdp, deepspeed"),
        (
            {"ds_config": os.path.join(REPO, "ds_configs", "zero2.json"), "sharded_init": "always"},
            "DeepSpeed partitions parameters only at ZeRO stage 3",
        ),
    ],
)
def test_engines_own_their_flag_rules(flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve({"dataset_type": "synthetic", "model": "test-tiny", **flags})


def test_deepspeed_json_is_resolved_once_at_validation():
    cfg = resolve(
        {"dataset_type": "synthetic", "model": "test-tiny", "batch_size": 16, "accum_freq": 2,
         "ds_config": os.path.join(REPO, "ds_configs", "zero3.json")}
    )  # fmt: skip
    values = cfg.ds_config_values
    assert values["train_micro_batch_size_per_gpu"] == 16 and values["gradient_accumulation_steps"] == 2
    assert values["zero_optimization"]["stage"] == 3
    assert "train_batch_size" not in values or values["train_batch_size"] == "auto"  # the world adds it


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imported_modules(node: ast.AST, known: set[str]) -> set[str]:
    """bigclip modules an import statement names (from a import b: a.b if that is a module, else a)."""
    names = set()
    if isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
        names = {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
    return {n for n in names if n in known}


def test_no_import_cycles_counting_imports_inside_functions():
    modules = _modules()
    known = set(modules)
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            graph[module] |= _imported_modules(node, known) - {module}
    # A package imports its submodules through __init__; a submodule importing its own package's name is
    # the normal way in, not a cycle.
    for module in graph:
        graph[module] = {m for m in graph[module] if not module.startswith(m + ".")}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongly_connected(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongly_connected(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            strongly_connected(v)
    assert cycles == []


# docs/architecture.md's layers: what each top-level module or package of bigclip may import.
FOUNDATION = {"errors", "dist", "precision", "optim", "schedule", "train_state", "log", "storage_options", "preemption"}
COMPONENTS = {"model", "loss", "data", "ckpt"}
ALLOWED = {
    **{m: FOUNDATION for m in FOUNDATION},
    **{m: FOUNDATION for m in COMPONENTS},
    "engine": FOUNDATION | {"ckpt"},
}


def test_layers_import_only_what_the_architecture_allows():
    modules = _modules()
    known = set(modules)

    def unit(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    broken = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            for target in _imported_modules(node, known):
                here, there = unit(module), unit(target)
                if there in ("bigclip",) or here == there or here not in ALLOWED:
                    continue
                if there not in ALLOWED[here]:
                    broken.append(f"{module} imports {target}")
    assert broken == []


def test_no_standard_library_imports_inside_functions():
    found = []
    for module, path in _modules().items():
        for func in ast.walk(ast.parse(open(path).read())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                found += [f"{module}:{node.lineno} {n}" for n in names if n.split(".")[0] in sys.stdlib_module_names]
    assert found == []
