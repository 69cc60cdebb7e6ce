"""TrainConfig: every training option in one dataclass.

Precedence: defaults < the embedded demo's preset (only when no data is given) < ``--config file.yaml``
< command-line flags. Field names are OpenCLIP's argument names (``--batch-size`` -> ``batch_size``) and
keep OpenCLIP's defaults, so a user's launch line carries over unchanged.

Each field's metadata holds its help text and argparse group; ``cli.py`` builds the parser from it.
``validate()`` is the single place a value is checked, for YAML and flags alike, and it fails with one
line that names the flag, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from braceexpand import braceexpand  # ships with webdataset

from bigclip.ckpt.manager import ASYNC_MODES
from bigclip.ckpt.storage import is_url, parse_storage_options, redact_options, redact_url
from bigclip.data import DATASET_TYPES, check_dataset_type, validate_aug_cfg
from bigclip.data.imagenet import class_folders
from bigclip.data.wds_plan import parse_upsampling_factors
from bigclip.engine import ENGINE_CLASSES
from bigclip.engine import check_config as check_engine_config
from bigclip.errors import UserError
from bigclip.loss.select import check_dist_impl as check_loss_dist_impl
from bigclip.loss.select import check_impl as check_loss_impl
from bigclip.model import get_model_config, list_models
from bigclip.model.pretrained import check_pretrained, check_pretrained_image
from bigclip.model.registry import is_schema_name
from bigclip.model.switchback import VARIANTS as SWITCHBACK_VARIANTS

PRECISIONS = ("amp", "amp_bf16", "amp_bfloat16", "bf16", "fp16", "pure_bf16", "pure_fp16", "fp32")
LR_SCHEDULERS = ("cosine", "const", "const-cooldown")
REPORT_TARGETS = ("tensorboard", "wandb")
OPTIMIZERS = ("adamw", "stableadamw")  # besides timm/<name>


def _flag(default: Any, help: str, group: str, **argparse_kwargs: Any) -> Any:
    """A config field with its help text, its argparse group and any extra argparse settings."""
    meta = {"help": help, "group": group, "argparse": argparse_kwargs}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _unsupported(default: Any, help: str, group: str, why: str, **argparse_kwargs: Any) -> Any:
    """An OpenCLIP flag bigclip does not implement yet: setting it stops the run, never a silent no-op."""
    f = _flag(default, f"{help} [not supported yet: {why}]", group, **argparse_kwargs)
    f.metadata = {**f.metadata, "unsupported": why}
    return f


DATA, MODEL, TRAIN, PREC, CKPT, LOG, EVAL, DIST, LOSS, MISC = (
    "data",
    "model",
    "training",
    "precision and memory",
    "checkpoints",
    "logging",
    "evaluation",
    "distributed",
    "loss",
    "other",
)


@dataclass
class TrainConfig:
    # ---- data
    train_data: str | None = _flag(
        None,
        "Training data: a CSV file, WebDataset shards with brace expansion "
        "(a::b for several sources), or nothing for the embedded demo.",
        DATA,
    )
    val_data: str | None = _flag(None, "Validation data, same formats as --train-data.", DATA)
    train_num_samples: int | None = _flag(None, "Samples per epoch; required for WebDataset.", DATA)
    val_num_samples: int | None = _flag(None, "Samples in the validation set (WebDataset).", DATA)
    dataset_type: str = _flag("auto", f"One of {', '.join(DATASET_TYPES)}.", DATA)
    dataset_resampled: bool = _flag(
        False, "WebDataset: each reader draws shards with replacement (seeded by seed, epoch, rank, worker).", DATA
    )
    csv_separator: str = _flag("\t", "Column separator of CSV data.", DATA)
    csv_img_key: str = _flag("filepath", "CSV column holding image paths.", DATA)
    csv_caption_key: str = _flag("title", "CSV column holding captions.", DATA)
    train_data_upsampling_factors: str | None = _flag(
        None, "Per-source sampling weights a::b for the '::' sources of --train-data (with --dataset-resampled).", DATA
    )
    workers: int = _flag(4, "Data loader workers per process.", DATA)
    image_mean: list[float] | None = _flag(None, "Override the image normalisation mean.", DATA, nargs="+", type=float)
    image_std: list[float] | None = _flag(None, "Override the image normalisation std.", DATA, nargs="+", type=float)
    image_interpolation: str | None = _flag(None, "bicubic, bilinear or random.", DATA)
    image_resize_mode: str | None = _flag(None, "shortest, longest or squash.", DATA)
    aug_cfg: list[str] | dict[str, Any] = _flag(
        [], "Augmentation key=value pairs, e.g. scale=0.9::1.0.", DATA, nargs="*"
    )

    # ---- model
    model: str = _flag(
        "RN50",
        "Architecture name (see `bigclip models`), or OpenCLIP's local-dir:DIR / hf-hub:ORG/NAME (an "
        "open_clip_config.json and the weights beside it); the demo uses test-tiny.",
        MODEL,
    )
    pretrained: str | None = _flag(
        None,
        "One of OpenCLIP's pretrained tags for --model (fetched through the Hugging Face hub into --cache-dir), "
        "or a local bigclip or OpenCLIP state dict (.pt/.bin/.safetensors).",
        MODEL,
    )
    pretrained_image: bool = _flag(
        False,
        "timm's ImageNet weights for a timm image tower's trunk (fetched through the Hugging Face hub into "
        "--cache-dir); whole-model weights (--pretrained, local-dir:/hf-hub: models) replace them.",
        MODEL,
    )
    force_image_size: list[int] | None = _flag(
        None, "Override the image size (one or two ints).", MODEL, nargs="+", type=int
    )
    force_context_length: int | None = _flag(None, "Override the text context length.", MODEL)
    force_patch_dropout: float | None = _flag(None, "Override patch dropout (0 disables it).", MODEL)
    force_quick_gelu: bool = _flag(False, "Use QuickGELU (for weights trained with it).", MODEL)
    force_custom_text: bool = _flag(
        False, "Separate text tower; bigclip's text tower is always separate, so this changes nothing.", MODEL
    )
    layer_scale_init: float | None = _flag(
        None,
        "LayerScale on both residual branches of every transformer block of both towers, starting at this value "
        "(0: zero-init layer scale; new in bigclip). Default: the architecture's own ls_init_value, if any.",
        MODEL,
    )
    lock_image: bool = _flag(False, "Freeze the image tower.", MODEL)
    lock_image_unlocked_groups: int = _flag(0, "Leave the last N image layer groups trainable.", MODEL)
    lock_image_freeze_bn_stats: bool = _flag(False, "Freeze BatchNorm statistics of locked layers.", MODEL)
    lock_text: bool = _flag(False, "Freeze the text tower.", MODEL)
    lock_text_unlocked_layers: int = _flag(0, "Leave the last N text layers trainable.", MODEL)
    lock_text_freeze_layer_norm: bool = _flag(False, "Freeze LayerNorm of locked text layers.", MODEL)

    # ---- training
    batch_size: int = _flag(64, "Batch size per process (global = this x world size x accum-freq).", TRAIN)
    epochs: int = _flag(32, "Number of epochs.", TRAIN)
    epochs_cooldown: int | None = _flag(None, "Epochs of cooldown at the end (const-cooldown).", TRAIN)
    accum_freq: int = _flag(1, "Accumulate this many micro-batches per step; negatives span all of them.", TRAIN)
    lr: float | None = _flag(None, "Learning rate (default 5e-4).", TRAIN)
    warmup: int = _flag(10000, "Linear warmup steps.", TRAIN)
    lr_scheduler: str = _flag("cosine", f"One of {', '.join(LR_SCHEDULERS)}.", TRAIN)
    lr_cooldown_end: float = _flag(0.0, "Learning rate at the end of the cooldown.", TRAIN)
    lr_cooldown_power: float = _flag(1.0, "Power of the polynomial cooldown (1 = linear).", TRAIN)
    opt: str = _flag(
        "adamw",
        "adamw; stableadamw (AdamW with per-tensor update clipping, Wortsman et al. 2023; new in bigclip); or "
        "timm/<name> for any timm optimizer.",
        TRAIN,
    )
    beta1: float | None = _flag(None, "Adam beta1 (default 0.9).", TRAIN)
    beta2: float | None = _flag(None, "Adam beta2 (default 0.98).", TRAIN)
    eps: float | None = _flag(None, "Adam epsilon (default 1e-6).", TRAIN)
    wd: float = _flag(0.2, "Weight decay (never on gains, biases or the logit scale).", TRAIN)
    momentum: float | None = _flag(None, "Momentum for timm optimizers that take it.", TRAIN)
    grad_clip_norm: float | None = _flag(None, "Clip the global gradient norm to this value.", TRAIN)
    seed: int = _flag(0, "Random seed.", TRAIN)
    torchcompile: bool = _flag(False, "torch.compile each transformer block.", TRAIN)
    torchscript: bool = _unsupported(False, "TorchScript the model.", TRAIN, "use --torchcompile")
    trace: bool = _unsupported(False, "Trace the model (inference).", TRAIN, "use --torchcompile")
    use_bnb_linear: str | None = _flag(
        None,
        "int8 SwitchBack linear layers for the transformer blocks' MLPs: SwitchBackLinearGlobal, "
        "SwitchBackLinearVectorwise, SwitchBackLinearGlobalMemEfficient or StandardLinear (bigclip's own kernels; "
        "bitsandbytes no longer ships them).",
        TRAIN,
    )
    distill_model: str | None = _unsupported(
        None, "Teacher architecture for distillation.", TRAIN, "distillation is planned"
    )
    distill_pretrained: str | None = _unsupported(
        None, "Teacher weights for distillation.", TRAIN, "distillation is planned"
    )

    # ---- precision and memory
    precision: str = _flag("amp", f"One of {', '.join(PRECISIONS)}. On CPU, amp means bfloat16 autocast.", PREC)
    grad_checkpointing: bool = _flag(False, "Recompute every transformer block in backward.", PREC)
    grad_checkpointing_every: int = _flag(1, "With --grad-checkpointing, recompute every k-th block only.", PREC)

    # ---- loss
    local_loss: bool = _flag(False, "Local features against gathered ones (O(n) logits per rank).", LOSS)
    gather_with_grad: bool = _flag(False, "Gradients flow through the feature all-gather.", LOSS)
    siglip: bool = _flag(False, "Sigmoid loss (logit scale init log 10, bias -10).", LOSS)
    loss_dist_impl: str | None = _flag(None, "Distributed loss implementation (see docs).", LOSS)
    loss_impl: str = _flag("auto", "naive, chunked, triton or auto (new in bigclip).", LOSS)
    coca_contrastive_loss_weight: float = _unsupported(1.0, "CoCa contrastive weight.", LOSS, "CoCa models are planned")
    coca_caption_loss_weight: float = _unsupported(2.0, "CoCa caption weight.", LOSS, "CoCa models are planned")

    # ---- checkpoints
    save_frequency: int = _flag(1, "Save a checkpoint every N epochs (0: never).", CKPT)
    save_every_n_steps: int = _flag(0, "Also save every N optimizer steps, mid-epoch (0: never; new in bigclip).", CKPT)
    save_every_minutes: float = _flag(0.0, "Also save every N minutes of training (0: never; new in bigclip).", CKPT)
    save_most_recent: bool = _flag(False, "Also keep the newest state as epoch_latest.", CKPT)
    delete_previous_checkpoint: bool = _flag(
        False, "Delete the previous local checkpoint after a save (remote copies are kept; see --keep-last-k).", CKPT
    )
    keep_last_k: int = _flag(
        0,
        "Keep only the K newest numbered checkpoints in the remote store (locally when "
        "there is no --remote-sync); 0 keeps all (new in bigclip).",
        CKPT,
    )
    resume: str | None = _flag(
        None,
        "Checkpoint to resume from: a directory, a URL (s3://, gs://, az://, "
        "https://) of one, or 'latest' (local and --remote-sync).",
        CKPT,
    )
    remote_sync: str | None = _flag(
        None,
        "Remote run root (s3://bucket/runs, gs://, az://, or a directory): "
        "checkpoints are uploaded as they are written and committed by a "
        "manifest; logs are copied every --remote-sync-frequency seconds.",
        CKPT,
    )
    remote_sync_frequency: int = _flag(300, "Seconds between copies of logs and metrics (with --remote-sync).", CKPT)
    remote_sync_protocol: str = _flag(
        "s3", "s3 (needs an s3:// URL) or fsspec (any fsspec URL); both use the same parallel, retried uploads.", CKPT
    )
    storage_options: str | dict[str, Any] | None = _flag(
        None,
        "JSON of fsspec options for remote paths, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\'; '
        "credentials may go here or in AWS_* variables (never logged).",
        CKPT,
    )
    storage_timeout: float = _flag(
        60.0,
        "Seconds a remote store may go unanswered or failing when bigclip first reaches it (the start-of-run "
        "write check, --resume, bigclip export) before every rank stops with one line; checkpoint uploads "
        "retry longer, see --checkpoint-upload-timeout (new in bigclip).",
        CKPT,
    )
    checkpoint_upload_timeout: float = _flag(
        600.0,
        "Seconds one checkpoint upload step retries an unreachable or failing store before that checkpoint is "
        "given up (training goes on, the next save tries again); also the longest the final and the "
        "preemption checkpoint are waited for (new in bigclip).",
        CKPT,
    )
    checkpoint_async: str = _flag(
        "auto",
        "Where checkpoint files are written and uploaded: auto (thread), thread, "
        "process (DCP's daemon process; DDP/FSDP only) or off (the loop waits; "
        "new in bigclip).",
        CKPT,
    )

    # ---- logging
    logs: str = _flag(
        "./logs/",
        "Where logs, metrics and checkpoints go: a directory, or a URL (s3://, gs://, "
        "az://) written through a local staging folder as with --remote-sync.",
        LOG,
    )
    name: str | None = _flag(None, "Run name (default: date, model, lr, batch size, precision).", LOG)
    log_every_n_steps: int = _flag(100, "Print and record metrics every N steps.", LOG)
    report_to: str = _flag("", "tensorboard, wandb or tensorboard,wandb.", LOG)
    wandb_project_name: str = _flag("open-clip", "wandb project.", LOG)
    wandb_notes: str = _flag("", "wandb notes.", LOG)
    debug: bool = _flag(False, "Debug logging; an error also prints its traceback above its one line.", LOG)
    log_local: bool = _flag(False, "Log from the first process of every node, not only rank 0.", LOG)
    copy_codebase: bool = _flag(False, "Copy the bigclip package into the run directory.", LOG)

    # ---- evaluation
    val_frequency: int = _flag(1, "Validate every N epochs.", EVAL)
    zeroshot_frequency: int = _flag(2, "Zero-shot evaluation every N epochs.", EVAL)
    imagenet_val: str | None = _flag(
        None, "ImageNet validation folder (one folder per class) for zero-shot classification.", EVAL
    )
    imagenet_v2: str | None = _flag(None, "ImageNet-v2 folder (class folders 0 ... 999) for zero-shot.", EVAL)

    # ---- distributed
    engine: str = _flag(
        "ddp",
        f"One of {', '.join(ENGINE_CLASSES)} (new in bigclip). --ds_config FILE or --deepspeed selects deepspeed.",
        DIST,
    )
    ds_config: str | None = _flag(
        None,
        "DeepSpeed JSON config (ds_configs/zero{1,2,3}.json, zero3_offload.json); "
        '"auto" values are filled from bigclip\'s flags. Selects --engine '
        "deepspeed.",
        DIST,
        aliases=["--ds_config", "--deepspeed_config", "--deepspeed-config"],
        metavar="FILE",
    )
    deepspeed: bool = _flag(
        False, "Use the DeepSpeed engine (DeepSpeed's own flag; ZeRO-2 unless --ds_config says otherwise).", DIST
    )
    sharded_init: str = _flag(
        "auto",
        "auto, always or never: build the model on the meta device and initialise it "
        "shard by shard (fsdp, deepspeed ZeRO-3); auto does so from 500M parameters.",
        DIST,
    )
    fsdp_offload_cpu: bool = _flag(False, "FSDP: keep parameter, gradient and optimizer shards in host memory.", DIST)
    fsdp_no_reshard_after_forward: bool = _flag(
        False,
        "FSDP: keep each block's gathered parameters from forward to backward (more memory, one all-gather less).",
        DIST,
    )
    fsdp_hybrid: bool = _flag(False, "FSDP: shard within each node and replicate across nodes (HSDP).", DIST)
    fsdp_replicate_degree: int = _flag(
        1,
        "FSDP: replicate across this many groups, sharding within each "
        "(HSDP; --fsdp-hybrid sets it to the number of nodes).",
        DIST,
    )
    dist_url: str | None = _flag(None, "Rendezvous URL (default: env:// from the launcher).", DIST)
    dist_backend: str | None = _flag(None, "nccl on GPU, gloo on CPU (default: picked by device).", DIST)
    dist_timeout: float = _flag(
        1800.0,
        "Seconds a collective may wait, and how long startup waits for every rank to join the process group "
        "(a node that never arrives stops the others after this long).",
        DIST,
    )
    ddp_static_graph: bool = _flag(False, "DDP static graph.", DIST)
    use_bn_sync: bool = _flag(False, "Synchronise BatchNorm statistics across processes.", DIST)
    horovod: bool = _unsupported(False, "Horovod.", DIST, "use torchrun, deepspeed or srun")
    no_set_device_rank: bool = _flag(False, "Do not pin each process to the GPU of its local rank.", DIST)
    device: str = _flag("cuda", "cuda or cpu (cuda falls back to cpu when no GPU is present).", DIST)
    dry_run: bool = _flag(
        False,
        "Join the process group, print the world (one line per node), the engine plan and the memory plan, "
        "and exit without building the model or training.",
        DIST,
    )

    # ---- other
    config: str | None = _flag(None, "YAML file of option values (flags given on the command line win).", MISC)
    cache_dir: str | None = _flag(
        None,
        "Hugging Face hub cache for --pretrained tags, hf-hub: models and --pretrained-image "
        "(default: the hub's own, HF_HUB_CACHE).",
        MISC,
    )

    # Set by resolution, not by users.
    demo: bool = field(default=False, metadata={"internal": True})
    # The --ds_config JSON with every flag-decided "auto" filled (engine/ds_config.py), resolved once at
    # validation; the DeepSpeed engine completes it with the world size and the model's width.
    ds_config_values: dict | None = field(default=None, metadata={"internal": True})


# The embedded demo: what `python launch/train.py` with no data flags runs. These replace defaults only;
# anything the user sets (YAML or flags) still wins. Tuned so a 2-core CPU finishes in well under 3 minutes.
DEMO_PRESET: dict[str, Any] = {
    "model": "test-tiny",
    "batch_size": 64,
    "epochs": 24,
    "lr": 3e-3,
    "warmup": 100,
    "wd": 0.1,
    "precision": "fp32",
    "workers": 0,
    "log_every_n_steps": 20,
    "zeroshot_frequency": 6,
    "val_frequency": 6,
    "save_frequency": 6,
}


def config_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("internal")]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def load_yaml(path: str) -> dict[str, Any]:
    """Read a --config file: a mapping of option names (dashes or underscores) to values."""
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: file not found; pass a YAML file of option: value lines")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"--config {path}: not valid YAML{where}; fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    fields = {f.name: f for f in config_fields()}
    out = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in fields or name == "config":
            raise UserError(f"--config {path}: unknown option '{key}'; see `bigclip --help` for names")
        expected = _yaml_type_problem(fields[name], value)
        if expected:
            raise UserError(f"--config {path}: {key}: {value!r} is not {expected}; fix the value or remove the line")
        out[name] = value
    return out


# A field's annotation (a string: `from __future__ import annotations`) -> what a YAML value may be.
_YAML_TYPES = {
    "str": (("a string",), lambda v: isinstance(v, str)),
    "int": (("an integer",), lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": (("a number",), lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": (("true or false",), lambda v: isinstance(v, bool)),
    "list": (("a list",), lambda v: isinstance(v, list)),
    "dict": (("a mapping",), lambda v: isinstance(v, dict)),
    "None": (("null",), lambda v: v is None),
}


def _yaml_type_problem(field: dataclasses.Field, value: Any) -> str | None:
    """None when `value` fits the field's annotation, else what it should have been (a YAML file bypasses
    argparse's type conversion, so `model: null` must be caught here, not deep in the run)."""
    kinds = [re.sub(r"\[.*", "", part.strip()) for part in str(field.type).split("|")]
    if any(kind not in _YAML_TYPES for kind in kinds):
        return None  # Any, or a type this check does not describe
    if any(_YAML_TYPES[kind][1](value) for kind in kinds):
        return None
    return " or ".join(_YAML_TYPES[kind][0][0] for kind in kinds)


def resolve(cli_values: dict[str, Any]) -> TrainConfig:
    """Apply the precedence chain to the flags the user actually typed and return a validated config."""
    yaml_values = load_yaml(cli_values["config"]) if cli_values.get("config") else {}
    explicit = {**yaml_values, **cli_values}
    values = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default) for f in config_fields()}
    demo = explicit.get("train_data") is None and explicit.get("dataset_type", "auto") != "synthetic"
    if demo:
        values.update(DEMO_PRESET)
    values.update(explicit)
    _select_deepspeed(values, explicit)
    cfg = TrainConfig(**values)
    cfg.demo = demo
    reject_unsupported(cfg, explicit)
    validate(cfg)
    return cfg


def _select_deepspeed(values: dict[str, Any], explicit: dict[str, Any]) -> None:
    """DeepSpeed's launch lines name a config (--ds_config / --deepspeed_config) or --deepspeed, not an engine."""
    if not (values.get("ds_config") or values.get("deepspeed")):
        return
    if explicit.get("engine", "deepspeed") != "deepspeed":
        which = "--ds_config" if values.get("ds_config") else "--deepspeed"
        raise UserError(f"{which} selects the deepspeed engine but --engine is {explicit['engine']}; drop one of them")
    values["engine"] = "deepspeed"


def reject_unsupported(cfg: TrainConfig, explicit: dict[str, Any]) -> None:
    for f in config_fields():
        why = f.metadata.get("unsupported")
        if why and f.name in explicit and explicit[f.name] != f.default:
            raise UserError(f"{flag_name(f.name)}: not supported yet ({why})")


def _fail(name: str, value: Any, accepted: str) -> None:
    raise UserError(f"{flag_name(name)} {value!r}: {accepted}")


def validate(cfg: TrainConfig) -> None:
    """Check every user-controlled value before any work starts; the first problem stops the run. Each
    component owns the rules of its own flags (engines, losses, augmentation, storage options)."""
    _validate_choices(cfg)
    _validate_numbers(cfg)
    check_engine_config(cfg)  # engine flags; the DeepSpeed JSON is read and resolved here, once
    _validate_optimizer(cfg)
    check_loss_impl(cfg.loss_impl)
    check_loss_dist_impl(cfg.loss_dist_impl, cfg.siglip)
    validate_aug_cfg(cfg.aug_cfg)
    _validate_checkpoint_flags(cfg)
    _validate_paths(cfg)


def _validate_choices(cfg: TrainConfig) -> None:
    models = list_models()
    if is_schema_name(cfg.model):
        get_model_config(cfg.model, cfg.cache_dir)  # OpenCLIP's open_clip_config.json: there and well formed
        models = [*models, cfg.model]
    if cfg.model not in models and cfg.model.startswith(("convnext", "coca", "EVA", "mt5", "xlm")):
        raise UserError(
            f"--model {cfg.model}: not supported yet (bigclip builds ViT, ResNet and timm image towers); "
            f"choose one of {', '.join(models)}"
        )
    choices = {
        "model": (models, "unknown architecture; choose one of"),
        "precision": (PRECISIONS, "choose one of"),
        "lr_scheduler": (LR_SCHEDULERS, "choose one of"),
        "sharded_init": (("auto", "always", "never"), "choose one of"),
        "image_interpolation": ((None, "bicubic", "bilinear", "random"), "choose one of"),
        "image_resize_mode": ((None, "shortest", "longest", "squash"), "choose one of"),
        "remote_sync_protocol": (("s3", "fsspec"), "choose one of"),
        "checkpoint_async": (ASYNC_MODES, "choose one of"),
        "use_bnb_linear": ((None, *SWITCHBACK_VARIANTS), "choose one of"),
    }
    for name, (allowed, what) in choices.items():
        if getattr(cfg, name) not in allowed:
            _fail(name, getattr(cfg, name), f"{what} {', '.join(a for a in allowed if a is not None)}")
    check_dataset_type(cfg.dataset_type)
    if cfg.train_data_upsampling_factors is not None:  # OpenCLIP's rules, before any shard is listed
        sources = [[source] for source in (cfg.train_data or "").split("::")]
        parse_upsampling_factors(cfg.train_data_upsampling_factors, sources, cfg.dataset_resampled)
    if not (cfg.opt in OPTIMIZERS or cfg.opt.startswith("timm/")):
        _fail("opt", cfg.opt, "choose adamw or timm/<optimizer name>, or stableadamw (AdamW with update clipping)")
    for target in (t for t in cfg.report_to.split(",") if t):
        if target not in REPORT_TARGETS:
            _fail("report_to", cfg.report_to, "use tensorboard, wandb or tensorboard,wandb")
    if cfg.device not in ("cuda", "cpu") and not cfg.device.startswith("cuda:"):
        _fail("device", cfg.device, "choose cuda or cpu")
    if cfg.lr_scheduler == "const-cooldown" and cfg.epochs_cooldown is None:
        raise UserError("--lr-scheduler const-cooldown needs --epochs-cooldown N")


POSITIVE_INTS = (
    "batch_size", "epochs", "accum_freq", "log_every_n_steps", "val_frequency", "zeroshot_frequency",
    "grad_checkpointing_every",
)  # fmt: skip
NON_NEGATIVE_INTS = (
    "workers", "warmup", "save_frequency", "lock_image_unlocked_groups", "lock_text_unlocked_layers", "seed",
    "save_every_n_steps", "keep_last_k", "remote_sync_frequency",
)  # fmt: skip
OPTIONAL_POSITIVE_INTS = ("train_num_samples", "val_num_samples", "force_context_length")
OPTIONAL_NON_NEGATIVE_NUMBERS = ("lr", "wd", "eps", "grad_clip_norm", "lr_cooldown_end", "momentum")


def _validate_numbers(cfg: TrainConfig) -> None:
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in POSITIVE_INTS:
        if not is_int(getattr(cfg, name)) or getattr(cfg, name) < 1:
            _fail(name, getattr(cfg, name), "must be a positive integer")
    for name in NON_NEGATIVE_INTS:
        if not is_int(getattr(cfg, name)) or getattr(cfg, name) < 0:
            _fail(name, getattr(cfg, name), "must be a non-negative integer")
    for name in OPTIONAL_POSITIVE_INTS:
        v = getattr(cfg, name)
        if v is not None and (not is_int(v) or v < 1):
            _fail(name, v, "must be a positive integer")
    for name in OPTIONAL_NON_NEGATIVE_NUMBERS:
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            _fail(name, v, "must be a non-negative number")
    for name in ("dist_timeout", "storage_timeout", "checkpoint_upload_timeout"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
            _fail(name, v, "must be a positive number of seconds")
    if not isinstance(cfg.save_every_minutes, (int, float)) or not (cfg.save_every_minutes >= 0):
        _fail("save_every_minutes", cfg.save_every_minutes, "must be a non-negative number of minutes")
    for name in ("beta1", "beta2"):
        v = getattr(cfg, name)
        if v is not None and not (0 <= v < 1):
            _fail(name, v, "must be in [0, 1)")
    if cfg.layer_scale_init is not None and (
        isinstance(cfg.layer_scale_init, bool)
        or not isinstance(cfg.layer_scale_init, (int, float))
        or not math.isfinite(cfg.layer_scale_init)
    ):
        _fail("layer_scale_init", cfg.layer_scale_init, "must be a finite number (0 for zero-init layer scale)")
    if cfg.force_patch_dropout is not None and not (0 <= cfg.force_patch_dropout < 1):
        _fail("force_patch_dropout", cfg.force_patch_dropout, "must be in [0, 1)")
    if cfg.force_image_size is not None and (len(cfg.force_image_size) not in (1, 2) or min(cfg.force_image_size) < 1):
        _fail("force_image_size", cfg.force_image_size, "give one or two positive integers")
    if cfg.epochs_cooldown is not None and not (0 <= cfg.epochs_cooldown <= cfg.epochs):
        _fail("epochs_cooldown", cfg.epochs_cooldown, f"must be between 0 and --epochs ({cfg.epochs})")
    for name in ("image_mean", "image_std"):
        v = getattr(cfg, name)
        if v is not None and len(v) not in (1, 3):
            _fail(name, v, "give one value or three (R G B)")


def _validate_optimizer(cfg: TrainConfig) -> None:
    """StableAdamW's rules; runs after the engine check, which has resolved the DeepSpeed JSON."""
    if cfg.opt != "stableadamw":
        return
    if cfg.eps is not None and cfg.eps <= 0:
        _fail("eps", cfg.eps, "must be positive with --opt stableadamw (eps^2 floors the second moment it clips by)")
    if cfg.engine == "deepspeed":
        ds = cfg.ds_config_values or {}
        stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        mixed = [name for name in ("bf16", "fp16") if ds.get(name, {}).get("enabled")]
        if stage or mixed:
            # DeepSpeed hands its optimizer flat partitions of many tensors (ZeRO, and its bf16/fp16 wrappers),
            # so per-tensor update clipping would clip arbitrary slices together: refused, not approximated.
            why = ", ".join(([f"ZeRO stage {stage}"] if stage else []) + mixed)
            raise UserError(
                f"--opt stableadamw: DeepSpeed ({why}) steps flattened partitions, not whole tensors, so the "
                f"per-tensor update clipping cannot be applied; use --engine fsdp (exact on shards) or ddp"
            )


def dataset_paths(value: str) -> list[str]:
    """Every file a --train-data/--val-data value names: '::' separates sources, braces expand."""
    return [p for source in value.split("::") for p in braceexpand(source)]


def _validate_paths(cfg: TrainConfig) -> None:
    for name in ("train_data", "val_data"):
        value = getattr(cfg, name)
        if value is None:
            continue
        for path in dataset_paths(value):
            if not is_url(path) and not os.path.exists(path):
                _fail(name, value, f"'{path}' does not exist; check the path")
    if cfg.pretrained:
        check_pretrained(cfg.model, cfg.pretrained)
    if cfg.pretrained_image:
        check_pretrained_image(cfg.model, cfg.cache_dir)
    for name in ("imagenet_val", "imagenet_v2"):
        if getattr(cfg, name):
            class_folders(getattr(cfg, name), name)  # 1000 class folders, before any work
    if cfg.resume and cfg.resume != "latest" and not is_url(cfg.resume) and not os.path.exists(cfg.resume):
        _fail("resume", cfg.resume, "not found; pass a checkpoint directory or 'latest'")
    if cfg.train_data is None and cfg.dataset_type not in ("synthetic", "auto"):
        _fail("dataset_type", cfg.dataset_type, "needs --train-data")


def _validate_checkpoint_flags(cfg: TrainConfig) -> None:
    parse_storage_options(cfg.storage_options)
    if cfg.remote_sync and cfg.remote_sync_protocol == "s3" and not cfg.remote_sync.startswith("s3://"):
        raise UserError(
            f"--remote-sync {cfg.remote_sync}: --remote-sync-protocol s3 (the default) needs an "
            f"s3:// URL; add --remote-sync-protocol fsspec for other stores and directories"
        )
    for name in ("remote_sync", "logs"):
        value = getattr(cfg, name)
        if value and str(value).startswith(("http://", "https://")):
            _fail(name, value, "http(s) is read-only; use s3://, gs://, az:// or a directory")


def scrub_argv(argv: list[str]) -> list[str]:
    """A command line that can be recorded (wandb stores it): --storage-options' value redacted like to_dict's,
    every URL without userinfo or query string."""
    out, redact_next = [], False
    for arg in argv:
        if redact_next:
            out.append(json.dumps(redact_options(arg)))
            redact_next = False
        elif arg == "--storage-options":
            out.append(arg)
            redact_next = True
        elif arg.startswith("--storage-options="):
            out.append("--storage-options=" + json.dumps(redact_options(arg.split("=", 1)[1])))
        else:
            out.append(" ".join(redact_url(word) or word for word in arg.split(" ")) if "://" in arg else arg)
    return out


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as a plain dict for params.yaml, checkpoints and trackers: secrets redacted."""
    values = dataclasses.asdict(cfg)
    if values.get("storage_options"):
        values["storage_options"] = redact_options(values["storage_options"])
    for name in ("remote_sync", "resume", "logs", "train_data", "val_data"):
        if isinstance(values.get(name), str):
            values[name] = redact_url(values[name])
    return values
