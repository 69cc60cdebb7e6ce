"""No silent no-ops: every flag of `bigclip --help`, under every engine, either acts, or is refused in one line, or
(OpenCLIP's flags only, which open_clip_train accepts there) is warned about in one line.

The walk: for each registered engine and each flag the parser offers, a command line of the tiny model on
synthetic data with that flag set to a value other than its default is resolved. Either

- it is refused: a one-line UserError that names the flag (or a spelling of it); where the flag acts only beside
  others (CONTEXT), it must then act with them, unless it belongs to another engine; or
- it is warned about: the run goes on and says one line naming the flag and "the flag does nothing in this run"
  (flag_fields.idle), and the flag is one of OpenCLIP's (flag_fields.OPENCLIP_FLAGS, checked against
  open_clip_train's own parser); where it acts only beside others, it must then act with them; or
- it acts: against the same command line without the flag, the flag's value reaches a field of the typed slices
  (config/sections.py) the run hands its components, and that field is read by the code that runs under this
  engine (an attribute load outside validation: `check*` and `describe*` functions do not count; for the
  engine's slice only in the engine modules this engine runs: not another engine's module, nor the modules only
  it imports, nor another engine's classes). The run's own flags (RunFlags) are read by train.py itself.

Behaviour under each engine is the engines' tests' business (tests/test_engine_multiprocess.py trains every engine
with the shared flags against DDP); this walk proves no flag is parsed and then read by nothing, or read only by
some engines while the others stay silent. A second walk crosses the data flags with the kinds of data; a third
resolves every command line of OpenCLIP's documentation (../shared/seeds) and asserts none is refused by these rules.
"""

import ast
import dataclasses
import logging
import os
import shlex
import tarfile

import pytest
from helpers import REPO

from bigclip.cli_args import build_train_parser
from bigclip.config import config_fields, resolve
from bigclip.config.flags import RunFlags
from bigclip.config.sections import Sections
from bigclip.data import DATA_SOURCES
from bigclip.engine import ENGINES, Engine
from bigclip.errors import UserError
from bigclip.flag_fields import IDLE, OPENCLIP_FLAGS, default_of, is_openclip_flag
from bigclip.loss import LOSSES

PACKAGE = os.path.join(REPO, "bigclip")
BASE = {"dataset_type": "synthetic", "model": "test-tiny"}
SELECT = {name: {"engine": name} for name, _ in ENGINES.items()}
DS_CONFIG = {n: os.path.join(REPO, "ds_configs", f"{n}.json") for n in ("zero2", "zero3", "zero3_nvme")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files flags name: a CSV, weights, an ImageNet-shaped folder (1000 class folders), a YAML config."""
    root = tmp_path_factory.mktemp("flags")
    csv = root / "train.csv"
    csv.write_text("filepath\ttitle\n")
    weights = root / "weights.pt"
    weights.write_bytes(b"")
    imagenet = root / "imagenet"
    for i in range(1000):
        (imagenet / str(i)).mkdir(parents=True)
    (root / "run.yaml").write_text("epochs: 3\n")
    (root / "nvme").mkdir()
    return {"csv": str(csv), "weights": str(weights), "imagenet": str(imagenet), "yaml": str(root / "run.yaml"),
            "dir": str(root), "nvme": str(root / "nvme")}  # fmt: skip


def values(files):
    """A value other than the default for every flag that is not a switch (switches: True)."""
    return {
        "train_data": files["csv"], "val_data": files["csv"], "train_num_samples": 100, "val_num_samples": 10,
        "dataset_type": "csv", "csv_separator": ",", "csv_img_key": "img", "csv_caption_key": "cap",
        "max_image_pixels": 10**6, "shard_prefetch_mb": 8, "image_key": "png", "text_key": "json",
        "json_text_key": "caption", "json_text_key_probs": [1.0], "train_data_upsampling_factors": "1", "workers": 1,
        "image_mean": [0.5], "image_std": [0.5], "image_interpolation": "bilinear", "image_resize_mode": "squash",
        "image_decode": "full", "aug_cfg": ["scale=0.9::1.0"], "model": "ViT-B-32", "pretrained": files["weights"],
        "force_image_size": [32], "force_context_length": 16, "force_patch_dropout": 0.5, "layer_scale_init": 0.1,
        "lock_image_unlocked_groups": 1, "lock_text_unlocked_layers": 1, "use_bnb_linear": "StandardLinear",
        "use_fp8_linear": "tensorwise", "distill_model": "test-tiny", "distill_pretrained": files["weights"],
        "batch_size": 8, "epochs": 3, "accum_freq": 2, "seed": 1, "epochs_cooldown": 1, "warmup": 5,
        "lr_scheduler": "const", "lr_cooldown_end": 0.1, "lr_cooldown_power": 2.0, "lr": 0.01, "opt": "nadamw",
        "beta1": 0.8, "beta2": 0.9, "eps": 1e-7, "wd": 0.1, "momentum": 0.9, "wd_exclude": ["*.bias"],
        "opt_kwargs": ["amsgrad=true"], "opt_fallback_list": ["*.bias"], "image_layer_decay": 0.8,
        "text_layer_decay": 0.8, "grad_clip_norm": 1.0, "torchcompile_backend": "aot_eager",
        "torchcompile_mode": "default", "torchcompile_strategy": "x", "ema_decay": 0.99, "precision": "fp32",
        "grad_checkpointing_every": 2, "loss": "siglip", "loss_dist_impl": "ring", "loss_impl": "naive",
        "loss_precision": "fast", "coca_contrastive_loss_weight": 0.5, "coca_caption_loss_weight": 1.0,
        "save_frequency": 2, "save_every_n_steps": 5, "save_every_minutes": 1.0, "keep_last_k": 2,
        "fsdp_checkpoint": "full", "resume": files["dir"], "remote_sync": "s3://bucket/runs",
        "remote_sync_frequency": 10, "remote_sync_protocol": "fsspec", "storage_options": '{"anon": true}',
        "storage_timeout": 5.0, "checkpoint_upload_timeout": 5.0, "checkpoint_async": "off",
        "log_every_n_steps": 5, "log_metric_every_n_steps": 5, "train_loss_ema_samples": 10,
        "logs": os.path.join(files["dir"], "logs"), "report_to": "tensorboard", "wandb_project_name": "p",
        "wandb_notes": "n", "name": "x", "imagenet_val": files["imagenet"], "imagenet_v2": files["imagenet"],
        "val_frequency": 2, "zeroshot_frequency": 1, "val_retrieval_chunk_size": 16, "val_retrieval_precision": "model",
        "engine": "fsdp", "sharded_init": "never", "fsdp_replicate_degree": 2, "ds_config": DS_CONFIG["zero3"],
        "zero_nvme_path": files["nvme"], "dist_url": "tcp://127.0.0.1:1234", "dist_backend": "gloo",
        "dist_timeout": 10.0, "device": "cpu", "cache_dir": files["dir"], "config": files["yaml"],
    }  # fmt: skip


def context(files, engine):
    """Where a flag acts only beside others: those others under `engine` (None: drop that flag of BASE). Every flag
    must act somewhere, alone or in its context, under some engine (test_every_flag_acts_somewhere)."""
    csv = {"dataset_type": None, "train_data": files["csv"]}
    wds = {"dataset_type": None, "train_data": "s3://bucket/shards-{0000..0003}.tar"}
    val = {**csv, "val_data": files["csv"]}
    remote = {"remote_sync": "s3://bucket/runs"}
    coca = {"model": "coca_ViT-B-32"}
    shared = {
        "train_data": {"dataset_type": None}, "val_data": csv, "dataset_type": {"train_data": files["csv"]},
        "csv_separator": csv, "csv_img_key": csv, "csv_caption_key": csv, "max_image_pixels": csv,
        "dataset_resampled": wds, "shard_prefetch_mb": wds, "image_key": wds, "text_key": wds, "json_text_key": wds,
        "json_text_key_probs": {**wds, "json_text_key": "caption"},
        "train_data_upsampling_factors": {**wds, "dataset_resampled": True},
        "image_mean": csv, "image_std": csv, "image_interpolation": csv, "image_resize_mode": csv,
        "image_decode": csv, "aug_cfg": csv, "pretrained_image": {"model": "convnext_base"},
        "lock_image_unlocked_groups": {"lock_image": True}, "lock_image_freeze_bn_stats": {"lock_image": True},
        "lock_text_unlocked_layers": {"lock_text": True}, "lock_text_freeze_layer_norm": {"lock_text": True},
        "distill_model": {"distill_pretrained": files["weights"]}, "distill_pretrained": {"distill_model": "test-tiny"},
        "epochs_cooldown": {"lr_scheduler": "const-cooldown"},
        "lr_cooldown_end": {"lr_scheduler": "const-cooldown", "epochs_cooldown": 1},
        "lr_cooldown_power": {"lr_scheduler": "const-cooldown", "epochs_cooldown": 1},
        "momentum": {"opt": "timm/sgd"}, "opt_fallback_list": {"opt": "timm/muon"},
        "text_pooler_own_group": {"text_layer_decay": 0.8}, "bf16_round_to_nearest": {"precision": "pure_bf16"},
        "torchcompile_backend": {"torchcompile": True}, "torchcompile_mode": {"torchcompile": True},
        "ema_warmup": {"ema_decay": 0.99}, "eval_ema": {"ema_decay": 0.99},
        "grad_checkpointing_every": {"grad_checkpointing": True},
        "loss_precision": {"loss_impl": "fused"},  # auto is the chunked loss on the CPU, always exact
        "coca_contrastive_loss_weight": coca, "coca_caption_loss_weight": coca,
        "remote_sync_frequency": remote, "remote_sync_protocol": remote, "storage_options": remote,
        "storage_timeout": remote, "checkpoint_upload_timeout": remote,
        "wandb_project_name": {"report_to": "wandb"}, "wandb_notes": {"report_to": "wandb"},
        "val_frequency": val, "val_retrieval_chunk_size": val, "val_retrieval_precision": val,
        "zeroshot_frequency": {"imagenet_val": files["imagenet"]},
        "no_set_device_rank": {"device": "cuda"},  # acts where CUDA is: refused on a CPU-only machine
    }  # fmt: skip
    # an engine's own flags beside what that engine's layout needs to use them
    own = {
        "deepspeed": {"sharded_init": {"ds_config": DS_CONFIG["zero3"]},
                      "zero_nvme_path": {"ds_config": DS_CONFIG["zero3_nvme"]}},
        "fsdp": {"fsdp_replicate_degree": {}},
    }  # fmt: skip
    return {**shared, **own.get(engine, {})}


# Flags no engine can make act on this machine: refused in one line everywhere, and why.
def refused_here():
    import torch

    fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return {
        **{f.name: "not supported yet" for f in config_fields() if f.metadata.get("unsupported")},
        **({} if fp8 else {"use_fp8_linear": "fp8 matmuls need a GPU of compute capability 8.9+"}),
        **({} if torch.cuda.is_available() else {"no_set_device_rank": "pins processes to GPUs"}),
    }


# Flags whose whole meaning is a rule of validation, and what it is: they act by what they let through.
VALIDATION_ONLY = {
    # OpenCLIP's choice between the aws CLI and fsspec; bigclip uploads through one path for both (its help says so)
    "remote_sync_protocol": "fsspec lets --remote-sync name any fsspec URL or a directory, s3 only s3:// URLs",
}


# -- what the run reads: attribute loads outside validation
class _Reads(ast.NodeVisitor):
    def __init__(self, skip_classes: set[str]):
        self.names: set[str] = set()
        self.skip_classes = skip_classes

    def visit_FunctionDef(self, node):
        if not node.name.lstrip("_").startswith(("check", "describe")):  # validation and --dry-run's description
            self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        if node.name not in self.skip_classes:
            self.generic_visit(node)

    def visit_Attribute(self, node):
        if isinstance(node.ctx, ast.Load):
            self.names.add(node.attr)
        self.generic_visit(node)


def _reads(paths, skip_classes=frozenset()) -> set[str]:
    visitor = _Reads(set(skip_classes))
    for path in paths:
        with open(path) as f:
            visitor.visit(ast.parse(f.read()))
    return visitor.names


def _modules(folder: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n.endswith(".py")]


def _engine_modules_imported(path: str) -> set[str]:
    """The bigclip/engine modules `path` imports (module stems)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bigclip.engine"):
            parts = node.module.split(".")
            out |= {parts[2]} if len(parts) > 2 else {a.name for a in node.names}
    return out


def engine_reads() -> dict[str, set[str]]:
    """engine name -> the attributes its run reads in bigclip/engine/: every engine module except another engine's
    own (its module, and the modules only it imports), and no other engine's classes."""
    folder = os.path.join(PACKAGE, "engine")
    stems = {os.path.basename(p)[:-3]: p for p in _modules(folder)}
    importers = {stem: set() for stem in stems}
    for path in _modules(PACKAGE):
        for stem in _engine_modules_imported(path) & set(stems):
            importers[stem].add(os.path.relpath(path, folder)[:-3] if path.startswith(folder) else path)
    owned = {}
    for name, cls in ENGINES.items():
        mine = {cls.__module__.rsplit(".", 1)[1]}
        grew = True
        while grew:  # modules imported only by modules this engine owns
            more = {s for s, by in importers.items() if by and by <= mine} - mine
            grew, mine = bool(more), mine | more
        owned[name] = mine
    classes = {c.__name__: c for _, cls in ENGINES.items() for c in cls.__mro__ if issubclass(c, Engine)}
    reads = {}
    for name, cls in ENGINES.items():
        others = set().union(*(m for n, m in owned.items() if n != name))
        paths = [p for stem, p in stems.items() if stem not in others or stem in owned[name]]
        foreign = {c for c in classes if classes[c] not in cls.__mro__}
        reads[name] = _reads(paths, foreign)
    return reads


def run_reads() -> set[str]:
    """The attributes the run reads outside the engines and the config (which builds and checks the slices)."""
    skip = (os.path.join(PACKAGE, "config"), os.path.join(PACKAGE, "engine"))
    return _reads([p for p in _modules(PACKAGE) if not p.startswith(skip)])


# -- the walk
def parser_flags() -> dict[str, list[str]]:
    """Every flag `bigclip --help` offers: field name -> its spellings."""
    return {
        a.dest: list(a.option_strings)
        for a in build_train_parser()._actions
        if a.option_strings and a.dest not in ("help", "local_rank")
    }


def _selectors() -> dict[str, tuple[str, str]]:
    """Flags that pick another option's name: flag -> (option, name): --fsdp -> (engine, fsdp)."""
    out = {f: ("engine", name) for name, cls in ENGINES.items() for f in cls.selected_by}
    return out | {f: ("loss", name) for name, fam in LOSSES.items() for f in fam.selected_by}


def _resolve(flags: dict):
    try:
        return resolve({k: v for k, v in flags.items() if v is not None}), None
    except UserError as e:
        return None, str(e)


def _differences(on: Sections, off: Sections) -> set[str]:
    """The names of the slice fields whose values differ (the run's engine's own flags included)."""
    names = set()
    for part in dataclasses.fields(Sections):
        a, b = getattr(on, part.name), getattr(off, part.name)
        if not dataclasses.is_dataclass(a):  # not a slice: what validation says (idle_notes)
            continue
        for f in dataclasses.fields(a):
            if f.name in ("resolved", "given_engine_flags", "optimizer"):  # not flags (the optimizer's: its own slice)
                continue
            if getattr(a, f.name) != getattr(b, f.name):
                names.add(f.name)
    own_on, own_off = on.engine.engine_flags, off.engine.engine_flags
    if type(own_on) is type(own_off):
        names |= {f.name for f in dataclasses.fields(own_on) if getattr(own_on, f.name) != getattr(own_off, f.name)}
    return names


def outcome(name: str, value, engine: str, extra: dict, reads: set[str]) -> tuple[str, str]:
    """('refused', the line), ('warned', the line) or ('acts', the field that carries it) for `name`=`value` under
    `engine` beside `extra`; fails the test where the flag is accepted and reaches nothing the run reads without a
    warning, is refused or warned about in more than one line or without being named, or warned about though it is
    not one of OpenCLIP's."""
    spellings = parser_flags()[name]
    selector = _selectors().get(name)
    select = SELECT[engine]
    if name == "engine" or (selector and selector == ("engine", engine)):
        select = {}  # what selects the engine is the flag itself
    off_flags = {**BASE, **select, **extra}
    off_flags.pop(name, None)
    cfg, refused = _resolve({**off_flags, name: value})
    if refused is not None:
        assert "\n" not in refused, (name, engine, refused)
        assert any(s in refused for s in spellings), f"{name} under {engine} refused without naming it: {refused}"
        return "refused", refused
    warned = [line for line in cfg.sections.idle_notes if any(line.startswith(sp + ":") for sp in spellings)]
    if warned:
        assert len(warned) == 1 and "\n" not in warned[0] and warned[0].endswith(IDLE), (name, engine, warned)
        assert is_openclip_flag(name), f"{name} under {engine}: warned, but only OpenCLIP's flags may be: {warned}"
        return "warned", warned[0]
    if name == "engine":
        off_flags["engine"] = next(n for n, _ in ENGINES.items() if n != value)
    off, refused = _resolve(off_flags)
    if off is None:  # flags that act only as a pair (--distill-model, --distill-pretrained): against neither
        off, refused = _resolve({**BASE, **select, **{k: v for k, v in extra.items() if v is None}})
    assert off is not None, f"{name} under {engine}: the command line without it is refused: {refused}"
    differs = _differences(cfg.sections, off.sections)
    if name in {f.name for f in dataclasses.fields(RunFlags)}:  # the run's own: read by train.py itself
        carried = differs if name == "config" else {name} & _reads([os.path.join(PACKAGE, "train.py")])
    elif selector:
        carried = {selector[0]} & differs
    else:
        carried = {name} & differs
    read = carried & reads if name not in {f.name for f in dataclasses.fields(RunFlags)} else carried
    if name in VALIDATION_ONLY:
        read = carried
    assert read, f"{name}={value!r} under {engine} is accepted but reaches nothing the run reads ({sorted(differs)})"
    return "acts", sorted(read)[0]


@pytest.fixture(scope="module")
def matrix(files):
    """(engine, flag) -> (outcome alone, outcome in its context or None)."""
    run, per_engine, given = run_reads(), engine_reads(), values(files)
    out = {}
    for engine, _ in ENGINES.items():
        reads = run | per_engine[engine]
        for name in parser_flags():
            default = default_of(next(f for f in config_fields() if f.name == name))
            value = engine if name == "engine" else given.get(name, True if default is False else None)
            assert value is not None and (value != default or name == "engine"), f"no other value for --{name}"
            extra = context(files, engine).get(name)
            alone = outcome(name, value, engine, {}, reads)
            beside = outcome(name, value, engine, extra, reads) if extra is not None else None
            out[engine, name] = (alone, beside)
    return out


@pytest.mark.slow  # (the walk, in the module's `matrix` fixture: ~10 s)
def test_every_flag_acts_or_is_refused_under_every_engine(matrix):
    """The walk itself runs in the fixture (every assertion of `outcome`); here the matrix is complete and its
    counts are what they are: every engine acts on most flags and refuses the others' own flags."""
    flags = parser_flags()
    for engine, _ in ENGINES.items():
        alone = [matrix[engine, name][0][0] for name in flags]
        acted, refused, warned = alone.count("acts"), alone.count("refused"), alone.count("warned")
        print(f"{engine}: {len(flags)} flags, alone {acted} act, {refused} are refused and {warned} warned about")
        assert acted + refused + warned == len(flags) and acted > len(flags) // 2
        assert all(is_openclip_flag(name) for name in flags if matrix[engine, name][0][0] == "warned")


@pytest.mark.slow  # (the walk, in the module's `matrix` fixture: ~10 s)
def test_every_flag_acts_somewhere(matrix):
    """No flag is parsed only to be refused or ignored everywhere: each acts under some engine, alone or beside what
    it needs, except those refused by design (not supported yet) or on this machine (no fp8 GPU, no CUDA)."""
    here = refused_here()
    for name in parser_flags():
        outcomes = [o for engine, _ in ENGINES.items() for o in matrix[engine, name] if o is not None]
        acts = any(kind == "acts" for kind, _ in outcomes)
        assert acts != (name in here), (name, here.get(name), outcomes)


@pytest.mark.slow  # (the walk, in the module's `matrix` fixture: ~10 s)
def test_engine_flags_act_only_under_their_engine(matrix):
    """Each engine's own flags act under it and are refused under every other engine."""
    for owner, cls in ENGINES.items():
        for f in dataclasses.fields(cls.Flags):
            for engine, _ in ENGINES.items():
                kinds = {o[0] for o in matrix[engine, f.name] if o is not None}
                assert kinds == ({"acts"} if engine == owner else {"refused"}) or (
                    engine == owner and "acts" in kinds
                ), (f.name, engine, matrix[engine, f.name])


def test_no_field_of_a_slice_is_read_by_nothing():
    """Every field of every slice, and every flag its owner declares, is read by the run (outside validation),
    except flags whose reading is the config's own: a selector (--fsdp, --deepspeed pick the engine), a flag refused
    as not supported yet, and the validation-only ones listed above."""
    from bigclip.config.flags import OWNERS

    read = run_reads().union(*engine_reads().values())
    exempt = set(_selectors()) | set(VALIDATION_ONLY)
    exempt |= {f.name for f in config_fields() if f.metadata.get("unsupported")}
    exempt |= {"given"}  # not a flag: resolution's record of the flags typed, read where idle flags are found (config/)
    unread = {
        (owner.__name__, f.name)
        for owner in OWNERS
        for f in dataclasses.fields(owner)
        if f.name not in read and f.name not in exempt
    }
    sections = resolve(BASE).sections
    unread |= {
        (part.name, f.name)
        for part in dataclasses.fields(Sections)
        if dataclasses.is_dataclass(getattr(sections, part.name))  # (idle_notes is not a slice)
        for f in dataclasses.fields(getattr(sections, part.name))
        if f.name not in read and f.name not in exempt
    }
    assert not unread


def test_data_flags_act_only_on_the_data_that_reads_them(files):
    """The data flags crossed with the kinds of data: under each kind a kind's flag acts where that kind reads it
    (its DataSource.flags; the demo's and the zero-shot sets' lists) and is refused in one line elsewhere; and each
    kind's declared flags are read by its own module (or, for the image transform's, by build.py's transforms)."""
    from bigclip.data.sources import DEMO_FLAGS, IMAGE_FLAGS, TRAIN_ONLY, VAL_ONLY

    given = values(files)
    kinds = {
        "synthetic": {**BASE, "val_num_samples": 8},
        "csv": {"model": "test-tiny", "train_data": files["csv"], "val_data": files["csv"]},
        "webdataset": {"model": "test-tiny", "train_data": "s3://b/s-{0..3}.tar", "val_data": "s3://b/v-0.tar"},
        "demo": {"model": "test-tiny"},
    }
    claimed = {name for _, source in DATA_SOURCES.items() for name in source.flags} | set(DEMO_FLAGS)
    for kind, flags in kinds.items():
        reads = set(DEMO_FLAGS) if kind == "demo" else set(DATA_SOURCES.get(kind).flags)
        for name in sorted(claimed):
            value = given.get(name, True)
            extra = {"json_text_key": "caption"} if name == "json_text_key_probs" else {}
            extra |= {"dataset_resampled": True} if name == "train_data_upsampling_factors" else {}
            extra = extra if name in reads else {}  # (where the flag is refused, so would be what it needs)
            cfg, refused = _resolve({**flags, **extra, name: value})
            shown = f"--{name.replace('_', '-')}"
            if name in reads:
                assert refused is None, (kind, name, refused)
                assert getattr(cfg.sections.data, name) == value and not cfg.sections.idle_notes
            elif is_openclip_flag(name):  # OpenCLIP's: the run goes on, saying once that it does nothing
                assert refused is None, (kind, name, refused)
                assert [n.startswith(shown + ":") and n.endswith(IDLE) for n in cfg.sections.idle_notes] == [True]
            else:
                assert refused is not None and refused.startswith(shown), (kind, name, refused)
                assert "\n" not in refused
    for kind, source in DATA_SOURCES.items():
        module = os.path.join(PACKAGE, *source.build.__module__.split(".")[1:]) + ".py"
        shared = [os.path.join(PACKAGE, "data", n) for n in ("factory.py", "config.py", "sources.py")]
        own = _reads([module, *shared])
        transforms = _reads([os.path.join(PACKAGE, "build.py")])
        for name in source.flags:
            assert name in (transforms if name in IMAGE_FLAGS else own), (kind, name)
    assert set(TRAIN_ONLY) | set(VAL_ONLY) <= claimed


CSV = os.path.join(REPO, "tests", "no-such.csv")  # (a path the data checks read only where the run starts)


@pytest.mark.parametrize(
    "flags, message",
    [
        # a flag that another one overrides or bypasses, under the engine that has both: bigclip's own are refused
        (
            {"engine": "fsdp", "fsdp_hybrid": True, "fsdp_replicate_degree": 2},
            "--fsdp-replicate-degree 2: --fsdp-hybrid",
        ),
        ({"optimizer_in_backward": True, "ddp_static_graph": True}, "--ddp-static-graph: only applies to Distributed"),
        ({"engine": "deepspeed", "zero_nvme_path": "/tmp"}, "--zero-nvme-path: only applies when the DeepSpeed config"),
        (
            {"engine": "deepspeed", "sharded_init": "never"},
            "--sharded-init never: DeepSpeed partitions parameters only",
        ),
        ({"sharded_init": "never"}, "--sharded-init never: needs an engine that shards parameters"),
        ({"engine": "deepspeed", "checkpoint_async": "process"}, "--checkpoint-async process: DeepSpeed writes"),
        (
            {"engine": "deepspeed", "precision": "pure_bf16", "bf16_round_to_nearest": True},
            "--bf16-round-to-nearest: DeepSpeed keeps float32 master weights",
        ),
        ({"precision": "amp_bf16", "bf16_round_to_nearest": True}, "--bf16-round-to-nearest: only applies with bf16 w"),
        (
            {"precision": "pure_bf16", "opt": "nadamw", "bf16_round_to_nearest": True},
            "--bf16-round-to-nearest: --opt nadamw always",
        ),
        ({"loss_impl": "naive", "loss_dist_impl": "ring"}, "--loss-dist-impl ring: --loss-impl naive (OpenCLIP's"),
        ({"storage_timeout": 5.0}, "--storage-timeout: only applies with a remote store"),
        ({"dataset_type": None, "val_data": "x.csv"}, "--val-data: needs --train-data"),
        ({"dataset_type": None, "train_data": "s3://b/s-0.tar", "shard_prefetch_mb": 8, "train_num_samples": 8}, None),
        ({"dataset_type": None, "train_data": "/data/s-0.tar", "shard_prefetch_mb": 8}, "--shard-prefetch-mb: only"),
    ],
)
def test_bigclips_flags_that_another_flag_makes_idle_are_refused(flags, message):
    """Beyond one flag at a time: a flag of bigclip's own that the run's other flags override, bypass or make
    meaningless is refused in one line naming it (None: the combination is one where it acts)."""
    cfg, refused = _resolve({**BASE, **flags})
    if message is None:
        assert refused is None and not cfg.sections.idle_notes, refused
        return
    assert refused is not None and refused.startswith(message), refused
    assert "\n" not in refused


@pytest.mark.parametrize(
    "flags, message",
    [
        # OpenCLIP accepts each of these and does nothing with the flag: bigclip runs them and says so once
        ({"skip_scheduler": True, "warmup": 5}, "--warmup: only applies without --skip-scheduler"),
        ({"skip_scheduler": True, "lr_scheduler": "const"}, "--lr-scheduler: only applies without --skip-scheduler"),
        ({"zeroshot_frequency": 1}, "--zeroshot-frequency: only applies with --imagenet-val or --imagenet-v2"),
        ({"val_frequency": 2}, "--val-frequency: only applies with validation data"),
        (
            {"dataset_type": "csv", "train_data": "{csv}", "train_num_samples": 100},
            "--train-num-samples: only applies to synthetic or webdataset training data; this run's training data "
            "is csv",
        ),
        ({"lock_image_unlocked_groups": 2}, "--lock-image-unlocked-groups: only applies with --lock-image"),
        (
            {"torchcompile": True, "torchcompile_backend": "aot_eager", "torchcompile_mode": "max-autotune"},
            "--torchcompile-mode: only applies with torch.compile's inductor backend",
        ),
        ({"siglip": True, "local_loss": True}, "--local-loss: only applies to the CLIP loss (--loss clip)"),
        ({"loss": "siglip", "gather_with_grad": True}, "--gather-with-grad: only applies to the CLIP loss"),
        ({"coca_caption_loss_weight": 1.0}, "--coca-caption-loss-weight: only applies to a captioning model"),
        ({"opt": "timm/sgd", "beta1": 0.8}, "--beta1: --opt timm/sgd takes no beta1"),
        ({"opt": "timm/adamw", "momentum": 0.8}, "--momentum: --opt timm/adamw takes no momentum"),
        ({"val_retrieval_precision": "model"}, "--val-retrieval-precision: only applies with validation data"),
        (
            {"val_num_samples": 8, "precision": "fp32", "val_retrieval_precision": "model"},
            "--val-retrieval-precision: only applies where the model computes in 16 bits",
        ),
        ({"remote_sync_frequency": 60}, "--remote-sync-frequency: only applies with --remote-sync"),
        ({"wandb_project_name": "p"}, "--wandb-project-name: only applies with --report-to wandb"),
        ({"train_data": "{csv}"}, "--train-data: --dataset-type synthetic makes its own data"),
    ],
)
def test_openclips_flags_that_another_flag_makes_idle_run_with_one_warning(flags, message, files):
    """The same for OpenCLIP's flags: open_clip_train accepts these command lines, so bigclip runs them, with one
    warning line naming the flag and where it applies (said at the run's start), not a refusal and not silence."""
    flags = {k: files["csv"] if v == "{csv}" else v for k, v in flags.items()}
    cfg, refused = _resolve({**BASE, **flags})
    assert refused is None, refused
    assert len(cfg.sections.idle_notes) == 1, cfg.sections.idle_notes
    note = cfg.sections.idle_notes[0]
    assert note.startswith(message) and note.endswith(IDLE) and "\n" not in note, note


def test_defaults_and_the_demo_preset_never_warn():
    """What the user did not type never trips a rule: OpenCLIP's defaults (--zeroshot-frequency 2, --val-frequency
    1, --warmup 10000) without ImageNet, validation data or a schedule, and the demo preset's own values; nor does
    a flag set to its default value."""
    assert resolve({**BASE, "skip_scheduler": True}).sections.idle_notes == ()
    assert resolve({}).sections.idle_notes == ()  # the demo
    typed = {**BASE, "zeroshot_frequency": 2, "val_frequency": 1, "warmup": 10000, "skip_scheduler": True}
    assert resolve(typed).sections.idle_notes == ()


def test_openclip_flags_are_open_clip_trains():
    """OPENCLIP_FLAGS (what may warn instead of being refused) holds every flag of the installed open_clip_train's
    parser and names only flags OpenCLIP has: those of main's params.py (tests/test_config.py's list) or of the
    installed release; bigclip's own flags (--engine, --loss-impl, --storage-options, ...) are not in it."""
    import inspect
    import re

    from open_clip_train import params
    from test_config import OPENCLIP_MAIN_FLAGS

    installed = set(re.findall(r'"--([a-z0-9-]+)"', inspect.getsource(params.parse_args)))
    assert installed and installed <= OPENCLIP_FLAGS
    assert OPENCLIP_FLAGS == set(OPENCLIP_MAIN_FLAGS) | installed
    assert not {"engine", "loss-impl", "storage-options", "shard-prefetch-mb", "keep-last-k"} & OPENCLIP_FLAGS


def test_flags_the_model_makes_idle_are_warned_about_where_it_is_built(caplog):
    """What only the built model can tell: BatchNorm to synchronise or freeze, a text pooler to group on its own
    (a ViT and a plain text tower have neither). These are OpenCLIP's flags, which it accepts on any model: the run
    goes on and says one line each where the model is built."""
    from bigclip import optim
    from bigclip.dist import World
    from bigclip.engine import apply_locks
    from bigclip.engine.base import has_batchnorm
    from bigclip.engine.ddp import DDPEngine
    from bigclip.model import create_model

    assert has_batchnorm(create_model("RN50", device="meta")) and not has_batchnorm(create_model("test-tiny"))
    caplog.set_level(logging.WARNING, logger="bigclip")
    cfg = resolve({**BASE, "use_bn_sync": True}).sections
    DDPEngine(cfg.engine, create_model("test-tiny"), World())
    cfg = resolve({**BASE, "lock_image": True, "lock_image_freeze_bn_stats": True}).sections
    apply_locks(create_model("test-tiny"), cfg.engine)
    cfg = resolve({**BASE, "text_layer_decay": 0.8, "text_pooler_own_group": True}).sections
    assert optim.param_groups(create_model("test-tiny"), cfg.optimizer)
    assert optim.param_groups(create_model("test-tiny"), resolve({**BASE, "text_layer_decay": 0.8}).sections.optimizer)
    said = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in said] == [
        "--use-bn-sync",
        "--lock-image-freeze-bn-stats",
        "--text-pooler-own-group",
    ], said
    assert all(line.endswith(IDLE) and "\n" not in line for line in said)


def _seed_command_lines() -> list[tuple[str, str]]:
    """(NNN:line, its flags) of tests/openclip_command_lines.txt: every open_clip_train command line of OpenCLIP's
    documentation (../shared/seeds), its paths placeholders for the fixtures below."""
    with open(os.path.join(REPO, "tests", "openclip_command_lines.txt")) as f:
        rows = [line.rstrip("\n").partition(" ") for line in f if line.strip() and not line.startswith("#")]
    return [(where, flags) for where, _, flags in rows]


SEED_COMMAND_LINES = _seed_command_lines()
# What bigclip says of them, one warning line each where a flag does nothing here (all else: nothing):
# 002:225 is --use-bn-sync alone, so the embedded demo's ViT, which has no BatchNorm (said where it is built).
SEED_WARNINGS = {"002:225": ["--use-bn-sync: only applies to a model with BatchNorm layers"]}
# and the same lines as they are also run: without the ImageNet folder at hand, and OpenCLIP's own training tests'
# flag list (its tests/test_training_simple.py), which names none
SEED_VARIANTS = [
    ("000:110 without --imagenet-val", dict(SEED_COMMAND_LINES)["000:110"].replace(" --imagenet-val {imagenet}", "")),
    ("OpenCLIP's test_training_simple", "--save-frequency 1 --zeroshot-frequency 1 --dataset-type synthetic "
     "--train-num-samples 16 --warmup 1 --batch-size 4 --lr 1e-3 --wd 0.1 --epochs 1 --workers 2 --model RN50"),
]  # fmt: skip
SEED_WARNINGS |= {
    name: ["--zeroshot-frequency: only applies with --imagenet-val or --imagenet-v2"] for name, _ in SEED_VARIANTS
}


@pytest.fixture(scope="module")
def seed_files(files):
    """The fixtures the seed lines' paths become: two empty WebDataset shards, besides `files`'."""
    root = files["dir"]
    for i in range(2):
        tarfile.open(os.path.join(root, f"shard-{i:04d}.tar"), "w").close()
    os.makedirs(os.path.join(root, "ckpt"), exist_ok=True)
    return {"shards": os.path.join(root, "shard-{0000..0001}.tar"), "csv": files["csv"], "imagenet": files["imagenet"],
            "logs": os.path.join(root, "logs"), "ckpt": os.path.join(root, "ckpt")}  # fmt: skip


def _builds_slowly(line: str) -> bool:
    """A full-size --model (ViT-H-14: ~40 s and GBs on the CPU) or torch.compile's wrapper."""
    return "--model " in line or "--torchcompile" in line


@pytest.mark.parametrize(
    "where, line", SEED_COMMAND_LINES + SEED_VARIANTS, ids=[w for w, _ in SEED_COMMAND_LINES + SEED_VARIANTS]
)
def test_every_seed_command_line_runs_unrefused(where, line, seed_files, caplog):
    """Each command line of OpenCLIP's documentation resolves through the parser and validation launch/train.py
    uses (cli_args.parse_train_args): none is refused; a flag that does nothing here is warned about in one line.
    Where the line trains the embedded demo (no data flags), the model is built too, for the rules only the built
    model can tell: the demo's tiny model and its engine as the run builds them; a full-size --model on the meta
    device, as --dry-run tells them (the run's path for a built model is test_flags_the_model_makes_idle_…)."""
    from bigclip.build import build_model
    from bigclip.cli_args import parse_train_args
    from bigclip.dist import World
    from bigclip.engine import build_engine, say_idle_batchnorm_flags
    from bigclip.model import create_model

    argv = shlex.split(line.format(**seed_files))
    try:
        cfg, _ = parse_train_args(argv)
    except UserError as e:
        pytest.fail(f"{where}: refused: {e}")
    said = list(cfg.sections.idle_notes)
    if cfg.demo:
        caplog.set_level(logging.WARNING, logger="bigclip")
        run = cfg.sections
        if _builds_slowly(line):
            size = run.model.force_image_size[0] if run.model.force_image_size else None
            say_idle_batchnorm_flags(run.engine, create_model(run.model.model, device="meta", image_size=size))
        else:
            world = World()
            build_engine(run.engine, build_model(run.model, run.engine, world), world)
        said += [r.getMessage() for r in caplog.records if r.getMessage().endswith(IDLE)]
    expected = SEED_WARNINGS.get(where, [])
    assert len(said) == len(expected) and all(map(str.startswith, said, expected)), said
    assert all(line.endswith(IDLE) and "\n" not in line for line in said)


def test_dry_run_says_the_idle_flags_as_the_run_would(caplog, capsys):
    """--dry-run says the same warnings the run says at its start, those only the model tells (from its meta build:
    ViT-B-32 has no BatchNorm) included; RN50's BatchNorm makes --use-bn-sync act, so nothing is said of it."""
    from bigclip import train

    caplog.set_level(logging.WARNING, logger="bigclip")
    for model, expected in (
        ("ViT-B-32", ["--zeroshot-frequency", "--use-bn-sync"]),
        ("RN50", ["--zeroshot-frequency"]),
    ):
        caplog.clear()
        flags = {"dataset_type": "synthetic", "model": model, "use_bn_sync": True, "zeroshot_frequency": 1}
        assert train.run(resolve({**flags, "dry_run": True, "device": "cpu"})) == 0
        said = [r.getMessage() for r in caplog.records]
        assert [line.split(":")[0] for line in said] == expected, said
        assert all(line.endswith(IDLE) and "\n" not in line for line in said)
        assert f"model {model}:" in capsys.readouterr().out
