"""The contracts of docs/architecture.md, tested through nothing but their interfaces.

- Every engine names a CheckpointLayout; a save through stage/write and a load through another engine's
  layout give back exactly the weights (and the optimizer state: the next step's loss is the same), and the
  layout's one-process reader gives the same weights for export.
- raise_together: a problem found on one rank stops every rank with that rank's message.
- TrainState is saved and restored as one object; older records keep defaults for new fields.
- Engines own their flags' rules (config validation asks every engine); validation writes nothing back.
- The package has no import cycles (imports inside functions count), no stdlib imports inside functions, and
  imports inside functions only the optional or slow packages docs/architecture.md lists.
- Nothing outside bigclip/engine/ names an engine (AST: no comparison with, lookup of, or class of one).
- Components take their typed slice of the config: each flag is declared once, by the slice that owns it; a slice
  field it does not own is a flag of the same name, type and default (or one the run decides); only the run's
  entry points take the whole TrainConfig.
"""

import ast
import dataclasses
import importlib
import json
import os
import re
import sys
import typing

import pytest
from helpers import REPO, launch

from bigclip.config import Sections, TrainConfig, config_fields, resolve
from bigclip.config.flags import OWNERS
from bigclip.engine import ENGINES
from bigclip.errors import UserError
from bigclip.flag_fields import default_of, is_flag
from bigclip.memory import memory_setups
from bigclip.train_state import TrainState

PACKAGE = os.path.join(REPO, "bigclip")


@pytest.mark.slow
def test_every_engine_round_trips_its_state_through_its_checkpoint_layout(tmp_path):
    out = tmp_path / "out.json"
    worker = os.path.join(REPO, "tests", "layout_worker.py")
    proc = launch(worker, [str(tmp_path / "ckpts"), str(out)], 900, nproc=2, DS_ACCELERATOR="cpu")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    expected = {"ddp": "dcp", "fsdp": "dcp", "zero2": "deepspeed", "zero3": "deepspeed"}
    for name, layout in expected.items():
        run = r[name]
        assert run["is_layout"] and run["layout"] == layout, name
        assert run["differs_before"], name  # the fresh engine really started elsewhere
        assert run["weights_equal"] and run["export_equal"], name
        assert run["next_loss"][0] == pytest.approx(run["next_loss"][1], rel=1e-6, abs=1e-7), name
        after = run["loss_after_update"]
        assert after[0] == pytest.approx(after[1], rel=1e-6, abs=1e-7), (name, "the optimizer state", after)
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
    assert TrainState.checkpoint_kind == "record" and "data" not in state.state_dict()  # per rank: a participant
    restored = TrainState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state
    old = {"step": 16, "epoch": 2, "samples_seen": 128, "batches_in_epoch": 0, "config": {}}  # before TrainState
    restored.load_state_dict(old)
    assert restored == TrainState(step=16, epoch=2, samples_seen=128)
    state.advance(samples=64, accum_freq=2)
    assert (state.step, state.samples_seen, state.batches_in_epoch) == (8, 512, 5)
    state.finish_epoch()
    assert (state.epoch, state.batches_in_epoch) == (2, 0)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"fsdp_hybrid": True}, "--fsdp-hybrid: only applies to --engine fsdp (the engine is ddp)"),
        ({"engine": "deepspeed", "fsdp_offload_cpu": True}, "--fsdp-offload-cpu: only applies to --engine fsdp"),
        ({"fsdp_replicate_degree": 2}, "--fsdp-replicate-degree: only applies to --engine fsdp (the engine is ddp)"),
        # DDP's and DeepSpeed's own flags, which other engines once ignored silently
        ({"engine": "fsdp", "ddp_static_graph": True}, "--ddp-static-graph: only applies to --engine ddp"),
        ({"engine": "deepspeed", "use_bn_sync": True}, "--use-bn-sync: only applies to --engine ddp (the engine is"),
        ({"zero_nvme_path": "/tmp"}, "--zero-nvme-path: only applies to --engine deepspeed (the engine is ddp)"),
        ({"engine": "fsdp", "zero_nvme_path": "/tmp"}, "--zero-nvme-path: only applies to --engine deepspeed"),
        ({"sharded_init": "always"}, "--sharded-init always: needs an engine that shards parameters"),
        ({"engine": "nccl"}, "--engine 'nccl': choose one of ddp, fsdp, deepspeed"),
        (
            {"ds_config": os.path.join(REPO, "ds_configs", "zero2.json"), "sharded_init": "always"},
            "DeepSpeed partitions parameters only at ZeRO stage 3",
        ),
    ],
)
def test_engines_own_their_flag_rules(flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        resolve({"dataset_type": "synthetic", "model": "test-tiny", **flags})
    assert "\n" not in str(err.value)


def test_every_engine_flag_belongs_to_one_engine_and_is_refused_by_the_others():
    """Each engine declares its own flags (Engine.Flags), which reach --help and the flags through the registry
    alone, and are refused in one line under every other engine (where they would do nothing); no flag is claimed
    by two engines, and no engine flag is left in the shared EngineConfig. What they do under their own engine is
    that engine's tests' business."""
    from bigclip.cli_args import build_train_parser
    from bigclip.config import TrainConfig
    from bigclip.engine import ENGINES, EngineConfig

    owners = {}
    for _, cls in ENGINES.items():
        for f in dataclasses.fields(cls.Flags):
            assert f.name not in owners, (f.name, owners.get(f.name), cls.name)
            owners[f.name] = cls.name
    assert set(owners) >= {"ddp_static_graph", "use_bn_sync", "zero_nvme_path", "fsdp_hybrid", "ds_config", "fsdp"}
    assert not set(owners) & {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(owners) <= {f.name for f in dataclasses.fields(TrainConfig)}
    shown = build_train_parser().format_help()
    assert all(f"--{name.replace('_', '-')}" in shown for name in owners)
    set_to = {
        "fsdp_replicate_degree": 2,
        "zero_nvme_path": "/tmp",
        "ds_config": os.path.join(REPO, "ds_configs", "zero2.json"),
    }
    engine_flags = {name: {"engine": name} for name, _ in ENGINES.items()}
    for name, owner in owners.items():
        value = set_to.get(name, True)
        for engine, selecting in engine_flags.items():
            flags = {"dataset_type": "synthetic", "model": "test-tiny", **selecting, name: value}
            if engine == owner:
                continue
            # a selecting flag (--fsdp, --ds_config) under another --engine is a conflict of selections; the
            # others are refused by the one rule
            with pytest.raises(UserError, match=f"--{name.replace('_', '[-_]')}(:| selects)") as err:
                resolve(flags)
            assert "\n" not in str(err.value)


def test_deepspeed_json_is_resolved_once_at_validation():
    cfg = resolve(
        {"dataset_type": "synthetic", "model": "test-tiny", "batch_size": 16, "accum_freq": 2,
         "ds_config": os.path.join(REPO, "ds_configs", "zero3.json")}
    )  # fmt: skip
    values = cfg.sections.engine.resolved
    assert values["train_micro_batch_size_per_gpu"] == 16 and values["gradient_accumulation_steps"] == 2
    assert values["zero_optimization"]["stage"] == 3
    assert "train_batch_size" not in values or values["train_batch_size"] == "auto"  # the world adds it
    assert cfg.sections is cfg.sections  # built once: the file is read at validation only


def test_validation_writes_nothing_onto_the_flags():
    """The resolved DeepSpeed JSON is returned by the engine's check and carried by the engine's slice; the flags
    are frozen and hold only what the user gave (params.yaml records exactly them)."""
    cfg = resolve(
        {"dataset_type": "synthetic", "model": "test-tiny", "ds_config": os.path.join(REPO, "ds_configs", "zero2.json")}
    )
    assert "ds_config_values" not in dataclasses.asdict(cfg) and "resolved" not in dataclasses.asdict(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine = "ddp"
    unresolved = dataclasses.replace(cfg.sections.engine, resolved=None)
    assert ENGINES.get("deepspeed").check_config(unresolved) == cfg.sections.engine.resolved
    assert unresolved.resolved is None


def _python_files(*tops: str) -> list[str]:
    """Paths, relative to the repository, of the .py files under each of `tops`."""
    return [
        os.path.relpath(os.path.join(folder, f), REPO)
        for top in tops
        for folder, _, files in os.walk(os.path.join(REPO, top))
        for f in files
        if f.endswith(".py")
    ]


def _modules() -> dict[str, str]:
    out = {}
    for rel in _python_files("bigclip"):
        name = rel[: -len(".py")].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = os.path.join(REPO, rel)
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
FOUNDATION = {
    "errors", "registry", "flag_fields", "dist", "precision", "optim", "schedule", "train_state", "staged_values",
    "storage_options", "preemption",
}  # fmt: skip
COMPONENTS = {"model", "loss", "data", "ckpt"}
ALLOWED = {
    **{m: FOUNDATION for m in FOUNDATION},
    **{m: FOUNDATION for m in COMPONENTS},
    "memory": FOUNDATION | COMPONENTS,
    "engine": FOUNDATION | {"ckpt", "memory"},
}
# The run: may import anything below (and each other).
RUN = {
    "config", "build", "loop", "train", "run", "metrics", "evaluation", "report", "dry_run", "commands",
    "cli_args", "cli", "__main__",
}  # fmt: skip


def test_every_top_level_module_sits_in_one_layer():
    """A new top-level module or package of bigclip goes into docs/architecture.md's layers table, and here."""
    units = {m.split(".")[1] for m in _modules() if "." in m}
    assert units - (set(ALLOWED) | RUN) == set()
    assert (set(ALLOWED) | RUN) - units == set()
    assert set(ALLOWED) & RUN == set()


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


def _function_level_imports():
    """(module, line, imported module name) of every import statement inside a function of the package."""
    for module, path in _modules().items():
        for func in ast.walk(ast.parse(open(path).read())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    yield from ((module, node.lineno, a.name) for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    yield module, node.lineno, node.module


def test_no_standard_library_imports_inside_functions():
    found = [
        f"{m}:{line} {n}" for m, line, n in _function_level_imports() if n.split(".")[0] in sys.stdlib_module_names
    ]
    assert found == []


# Imports inside functions: only packages that are optional or take seconds to import, each needed by few runs
# (docs/architecture.md, "Imports inside functions"). Module prefix -> why.
LAZY_IMPORTS = {
    "deepspeed": "optional extra; only DeepSpeed runs and checkpoints need it",
    "bigclip.ckpt.deepspeed_staging": "imports DeepSpeed at module level (its checkpoint-engine subclass)",
    "triton": "optional: CPU-only installs have none",
    "bigclip.loss.triton": "imports Triton at module level",
    "bigclip.loss": "the Triton loss backends (fused, triton), imported by name on first use (loss/select.py)",
    "bigclip.model": "the Triton SwitchBack kernels, imported on first CUDA use (model/switchback.py)",
    "wandb": "seconds to import; only --report-to wandb",
    "torch.utils.tensorboard": "seconds to import; only --report-to tensorboard",
    "sklearn": "seconds to import; only the embedded demo's digits",
    "open_clip": "seconds to import; only its tokenizers, pretrained tags and ImageNet class names",
    "huggingface_hub": "only hub downloads (pretrained tags, hf-hub: models, timm trunk weights)",
    "torch.distributed.checkpoint": "DCP's private helpers, guarded by try/except: they may move between releases",
    "transformers": "optional extra, seconds to import; only Hugging Face text towers (hf_model_name)",
    "tiktoken": "optional extra; only OpenCLIP main's tiktoken tokenizer (text_cfg tokenizer_type tiktoken)",
    "torchao": "seconds to import (torch.compile's machinery); --opt adamw8bit, bf16 rounding, --use-fp8-linear",
    "bigclip.optim.adamw8bit": "imports torchao at module level",
    "matplotlib": "optional extra, a second to import; only run reports (bigclip report, report.html)",
}


def test_function_level_imports_are_the_documented_lazy_ones():
    allowed = lambda n: any(n == p or n.startswith(p + ".") for p in LAZY_IMPORTS)  # noqa: E731
    found = [f"{m}:{line} {n}" for m, line, n in _function_level_imports() if not allowed(n)]
    assert found == []
    documented = open(os.path.join(REPO, "docs", "architecture.md")).read()
    assert all(f"`{prefix}`" in documented for prefix in LAZY_IMPORTS)


def _engine_names() -> set[str]:
    return set(ENGINES) | set(memory_setups())


def _bench_scripts() -> dict[str, str]:
    return {rel: os.path.join(REPO, rel) for rel in _python_files("bench")}


def test_no_engine_names_outside_the_engine_package():
    """Outside bigclip/engine/ (bench/ included): no comparison with an engine's (or memory setup's) name, no
    registry lookup by one, and no reference to an engine class. Engine facts (flag rules, memory models,
    layouts) are asked of engines; a benchmark passes an engine's name on as a flag value only."""
    names, classes = _engine_names(), {cls.__name__ for _, cls in ENGINES.items()}
    found = []
    for module, path in {**_modules(), **_bench_scripts()}.items():
        if module == "bigclip.engine" or module.startswith("bigclip.engine."):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            literal = lambda n: isinstance(n, ast.Constant) and n.value in names  # noqa: E731
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                tuples = [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts]
                if any(literal(s) for s in sides + tuples):
                    found.append(f"{module}:{node.lineno} compares with an engine name")
            elif isinstance(node, (ast.Call, ast.Subscript)):
                args = node.args if isinstance(node, ast.Call) else [node.slice]
                package_version = isinstance(node, ast.Call) and ast.unparse(node.func) == "version"  # a package's
                if any(literal(a) for a in args) and not package_version:
                    found.append(f"{module}:{node.lineno} looks up an engine by name")
            elif (
                isinstance(node, ast.Name)
                and node.id in classes
                or isinstance(node, ast.alias)
                and node.name in classes
            ):
                found.append(f"{module}:{node.lineno} names an engine class")
    assert found == []


# Slice fields the run sets from another component's decision, not from a flag of the same name.
DECIDED = {
    ("model", "init"): "the loss family's model_init",
    ("model", "device_type"): "the kind of device the run trains on (--device and whether a GPU is present)",
    ("engine", "optimizer"): "the optimizer's slice",
    ("engine", "resolved"): "what the chosen engine's check_config returned",
    ("engine", "given_engine_flags"): "each engine's own flags, sliced from the flags by their Flags dataclass",
    ("loss", "captioning"): "whether the model captions (CoCa), which the model's config says",
    ("loss", "device_type"): "the kind of device the run trains on (what --loss-impl auto picks there)",
}


def test_each_flag_is_declared_once_by_its_owner_and_slices_that_read_it_agree():
    """Every TrainConfig field is declared with flag() by exactly one slice (its owner) or by RunFlags; a slice
    that reads a flag it does not own declares the same name, type and default."""
    owners: dict[str, list[str]] = {}
    declared = {}
    for owner in OWNERS:
        for f in dataclasses.fields(owner):
            if is_flag(f):
                owners.setdefault(f.name, []).append(owner.__name__)
                declared[f.name] = f
    assert {name: who for name, who in owners.items() if len(who) > 1} == {}
    flags = {f.name for f in config_fields()}
    assert set(owners) == flags
    problems = []
    for section in dataclasses.fields(Sections):
        cls = typing.get_type_hints(Sections)[section.name]
        if not dataclasses.is_dataclass(cls):  # not a slice: what validation says (idle_notes)
            continue
        for f in dataclasses.fields(cls):
            if (section.name, f.name) in DECIDED or is_flag(f) or f.metadata.get("internal"):
                continue
            flag = declared.get(f.name) or next((g for g in dataclasses.fields(TrainConfig) if g.name == f.name), None)
            if flag is None:
                problems.append(f"{cls.__name__}.{f.name}: no flag of that name")
            elif str(f.type) != str(flag.type) or default_of(f) != default_of(flag):
                problems.append(f"{cls.__name__}.{f.name}: {f.type} = {default_of(f)!r}, not as its flag")
    assert problems == []


ENTRY_POINTS = {"bigclip.train", "bigclip.config"}  # the run itself, and the flags' own package


def test_only_the_run_takes_the_whole_config():
    """Components take their slice (engine, data, loss, ...): a parameter annotated TrainConfig, or an unannotated
    `cfg`, appears only in the run's entry points."""
    found = []
    for module, path in _modules().items():
        if any(module == m or module.startswith(m + ".") for m in ENTRY_POINTS):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(a.annotation) if a.annotation else None
                    if annotation == "TrainConfig" or (a.arg == "cfg" and annotation is None):
                        found.append(f"{module}:{node.lineno} {node.name}({a.arg})")
    assert found == []


LONG_MODULE_LINES = 450


def test_long_modules_say_why_at_their_top():
    """A library module over LONG_MODULE_LINES lines says at its top why it is not split ("Longer than most
    modules: ...")."""
    long = []
    for module, path in _modules().items():
        text = open(path).read()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > LONG_MODULE_LINES and "Longer than most modules" not in doc:
            long.append(f"{module}: {text.count(chr(10))} lines")
    assert long == []


def test_architecture_md_names_only_what_exists():
    """docs/architecture.md, the project's map: every file and package it names exists (a bare file name
    somewhere in the repository's code), and every registry in its table is in the module it names."""
    text = open(os.path.join(REPO, "docs", "architecture.md")).read()
    code_files = set(_python_files("bigclip", "bench", "launch", "tests"))
    basenames = {os.path.basename(f) for f in code_files}
    missing = []
    for name in sorted(set(re.findall(r"`([\w./-]+\.py)`", text))):
        found = name in basenames if "/" not in name else any(f == name or f.endswith("/" + name) for f in code_files)
        if not found:
            missing.append(name)
    for package in sorted(set(re.findall(r"`(\w+)/`", text))):
        if not (os.path.isdir(os.path.join(PACKAGE, package)) or os.path.isdir(os.path.join(REPO, package))):
            missing.append(package + "/")
    rows = re.findall(r"^\| `([A-Z0-9_]+)` \| `([\w/.]+)`", text, re.M)
    assert len(rows) >= 11, rows  # the registry table
    for registry, path in rows:
        module = "bigclip." + path[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        if not hasattr(importlib.import_module(module), registry):
            missing.append(f"{registry} in {path}")
    assert missing == []
