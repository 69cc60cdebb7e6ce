"""TrainConfig: every training option in one flat dataclass, the user interface (command line, --config YAML,
params.yaml). Field names are OpenCLIP's argument names (``--batch-size`` -> ``batch_size``) and keep
OpenCLIP's defaults, so a user's launch line carries over unchanged.

Each field's metadata holds its help text, --help group, choices (a registry owned by the component that
gives the names meaning) and value check (config/fields.py); ``cli_args.py`` builds the parser from it.
Components never see this class: they take the typed slices in ``cfg.sections`` (config/sections.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bigclip.ckpt.config import ASYNC_MODES, REMOTE_SYNC_PROTOCOLS
from bigclip.config.fields import (
    CKPT,
    DATA,
    DIST,
    EVAL,
    LOG,
    LOSS,
    MISC,
    MODEL,
    PREC,
    TRAIN,
    flag,
    internal,
    non_negative_int,
    non_negative_number,
    optional,
    positive_int,
    positive_seconds,
    unit_interval,
    unsupported,
)
from bigclip.config.sections import Sections, build_sections
from bigclip.data import DATA_SOURCES
from bigclip.data.transforms import INTERPOLATIONS, RESIZE_MODES
from bigclip.engine import DEFAULT_ENGINE, ENGINES
from bigclip.engine.config import SHARDED_INIT_MODES
from bigclip.log import REPORT_TARGETS
from bigclip.loss import LOSS_IMPLS, LOSSES
from bigclip.model.switchback import SWITCHBACK_VARIANTS
from bigclip.optim import OPTIMIZERS
from bigclip.precision import PRECISIONS
from bigclip.schedule import SCHEDULES


@dataclass(frozen=True)
class TrainConfig:
    """Every training option, flat: the user interface (CLI flags, --config YAML, params.yaml), OpenCLIP's names."""

    # ---- data
    train_data: str | None = flag(
        None,
        "Training data: a CSV file, WebDataset shards with brace expansion "
        "(a::b for several sources), or nothing for the embedded demo.",
        DATA,
    )
    val_data: str | None = flag(None, "Validation data, same formats as --train-data.", DATA)
    train_num_samples: int | None = flag(
        None, "Samples per epoch; required for WebDataset.", DATA, check=optional(positive_int)
    )
    val_num_samples: int | None = flag(
        None, "Samples in the validation set (WebDataset).", DATA, check=optional(positive_int)
    )
    dataset_type: str = flag(
        "auto",
        "The data format: auto (by the file extension of --train-data), or one of " + ", ".join(DATA_SOURCES) + ".",
        DATA,
    )
    dataset_resampled: bool = flag(
        False, "WebDataset: each reader draws shards with replacement (seeded by seed, epoch, rank, worker).", DATA
    )
    csv_separator: str = flag("\t", "Column separator of CSV data.", DATA)
    csv_img_key: str = flag("filepath", "CSV column holding image paths.", DATA)
    csv_caption_key: str = flag("title", "CSV column holding captions.", DATA)
    train_data_upsampling_factors: str | None = flag(
        None, "Per-source sampling weights a::b for the '::' sources of --train-data (with --dataset-resampled).", DATA
    )
    workers: int = flag(4, "Data loader workers per process.", DATA, check=non_negative_int)
    image_mean: list[float] | None = flag(None, "Override the image normalisation mean.", DATA, nargs="+", type=float)
    image_std: list[float] | None = flag(None, "Override the image normalisation std.", DATA, nargs="+", type=float)
    image_interpolation: str | None = flag(None, "bicubic, bilinear or random.", DATA, choices=INTERPOLATIONS)
    image_resize_mode: str | None = flag(None, "shortest, longest or squash.", DATA, choices=RESIZE_MODES)
    aug_cfg: list[str] | dict[str, Any] = flag(
        [], "Augmentation key=value pairs, e.g. scale=0.9::1.0.", DATA, nargs="*"
    )

    # ---- model
    model: str = flag(
        "RN50",
        "Architecture name (see `bigclip models`), or OpenCLIP's local-dir:DIR / hf-hub:ORG/NAME (an "
        "open_clip_config.json and the weights beside it); the demo uses test-tiny.",
        MODEL,
    )
    pretrained: str | None = flag(
        None,
        "One of OpenCLIP's pretrained tags for --model (fetched through the Hugging Face hub into --cache-dir), "
        "or a local bigclip or OpenCLIP state dict (.pt/.bin/.safetensors).",
        MODEL,
    )
    pretrained_image: bool = flag(
        False,
        "timm's ImageNet weights for a timm image tower's trunk (fetched through the Hugging Face hub into "
        "--cache-dir); whole-model weights (--pretrained, local-dir:/hf-hub: models) replace them.",
        MODEL,
    )
    force_image_size: list[int] | None = flag(
        None, "Override the image size (one or two ints).", MODEL, nargs="+", type=int
    )
    force_context_length: int | None = flag(
        None, "Override the text context length.", MODEL, check=optional(positive_int)
    )
    force_patch_dropout: float | None = flag(
        None, "Override patch dropout (0 disables it).", MODEL, check=optional(unit_interval)
    )
    force_quick_gelu: bool = flag(False, "Use QuickGELU (for weights trained with it).", MODEL)
    force_custom_text: bool = flag(
        False, "Separate text tower; bigclip's text tower is always separate, so this changes nothing.", MODEL
    )
    layer_scale_init: float | None = flag(
        None,
        "LayerScale on both residual branches of every transformer block of both towers, starting at this value "
        "(0: zero-init layer scale; new in bigclip). Default: the architecture's own ls_init_value, if any.",
        MODEL,
    )
    lock_image: bool = flag(False, "Freeze the image tower.", MODEL)
    lock_image_unlocked_groups: int = flag(
        0, "Leave the last N image layer groups trainable.", MODEL, check=non_negative_int
    )
    lock_image_freeze_bn_stats: bool = flag(False, "Freeze BatchNorm statistics of locked layers.", MODEL)
    lock_text: bool = flag(False, "Freeze the text tower.", MODEL)
    lock_text_unlocked_layers: int = flag(0, "Leave the last N text layers trainable.", MODEL, check=non_negative_int)
    lock_text_freeze_layer_norm: bool = flag(False, "Freeze LayerNorm of locked text layers.", MODEL)

    # ---- training
    batch_size: int = flag(
        64, "Batch size per process (global = this x world size x accum-freq).", TRAIN, check=positive_int
    )
    epochs: int = flag(32, "Number of epochs.", TRAIN, check=positive_int)
    epochs_cooldown: int | None = flag(None, "Epochs of cooldown at the end (const-cooldown).", TRAIN)
    accum_freq: int = flag(
        1, "Accumulate this many micro-batches per step; negatives span all of them.", TRAIN, check=positive_int
    )
    lr: float | None = flag(None, "Learning rate (default 5e-4).", TRAIN, check=optional(non_negative_number))
    warmup: int = flag(10000, "Linear warmup steps.", TRAIN, check=non_negative_int)
    lr_scheduler: str = flag("cosine", "The learning-rate schedule.", TRAIN, choices=SCHEDULES)
    lr_cooldown_end: float = flag(
        0.0, "Learning rate at the end of the cooldown.", TRAIN, check=optional(non_negative_number)
    )
    lr_cooldown_power: float = flag(1.0, "Power of the polynomial cooldown (1 = linear).", TRAIN)
    opt: str = flag(
        "adamw",
        "adamw; stableadamw (AdamW with per-tensor update clipping, Wortsman et al. 2023; new in bigclip); or "
        "timm/<name> for any timm optimizer.",
        TRAIN,
        choices=OPTIMIZERS,
    )
    beta1: float | None = flag(None, "Adam beta1 (default 0.9).", TRAIN, check=optional(unit_interval))
    beta2: float | None = flag(None, "Adam beta2 (default 0.98).", TRAIN, check=optional(unit_interval))
    eps: float | None = flag(None, "Adam epsilon (default 1e-6).", TRAIN, check=optional(non_negative_number))
    wd: float = flag(
        0.2, "Weight decay (never on gains, biases or the logit scale).", TRAIN, check=optional(non_negative_number)
    )
    momentum: float | None = flag(
        None, "Momentum for timm optimizers that take it.", TRAIN, check=optional(non_negative_number)
    )
    grad_clip_norm: float | None = flag(
        None, "Clip the global gradient norm to this value.", TRAIN, check=optional(non_negative_number)
    )
    seed: int = flag(0, "Random seed.", TRAIN, check=non_negative_int)
    torchcompile: bool = flag(False, "torch.compile each transformer block.", TRAIN)
    torchscript: bool = unsupported(False, "TorchScript the model.", TRAIN, "use --torchcompile")
    trace: bool = unsupported(False, "Trace the model (inference).", TRAIN, "use --torchcompile")
    use_bnb_linear: str | None = flag(
        None,
        "int8 SwitchBack linear layers for the transformer blocks' MLPs: SwitchBackLinearGlobal, "
        "SwitchBackLinearVectorwise, SwitchBackLinearGlobalMemEfficient or StandardLinear (bigclip's own kernels; "
        "bitsandbytes no longer ships them).",
        TRAIN,
        choices=SWITCHBACK_VARIANTS,
    )
    distill_model: str | None = unsupported(
        None, "Teacher architecture for distillation.", TRAIN, "distillation is planned"
    )
    distill_pretrained: str | None = unsupported(
        None, "Teacher weights for distillation.", TRAIN, "distillation is planned"
    )

    # ---- precision and memory
    precision: str = flag("amp", "Numeric precision.", PREC, choices=PRECISIONS)
    grad_checkpointing: bool = flag(False, "Recompute every transformer block in backward.", PREC)
    grad_checkpointing_every: int = flag(
        1, "With --grad-checkpointing, recompute every k-th block only.", PREC, check=positive_int
    )

    # ---- loss
    local_loss: bool = flag(False, "Local features against gathered ones (O(n) logits per rank).", LOSS)
    gather_with_grad: bool = flag(False, "Gradients flow through the feature all-gather.", LOSS)
    loss: str = flag(
        "clip", "The contrastive loss family (new in bigclip; --siglip selects siglip).", LOSS, choices=LOSSES
    )
    siglip: bool = flag(
        False, "Sigmoid loss (logit scale init log 10, bias -10): OpenCLIP's name for --loss siglip.", LOSS
    )
    loss_dist_impl: str | None = flag(
        None,
        "How features move between ranks: gather (default) or ring for clip; bidir (default), shift, reduce or "
        "gather for siglip.",
        LOSS,
    )
    loss_impl: str = flag("auto", "naive, chunked, triton or auto (new in bigclip).", LOSS, choices=LOSS_IMPLS)
    coca_contrastive_loss_weight: float = unsupported(1.0, "CoCa contrastive weight.", LOSS, "CoCa models are planned")
    coca_caption_loss_weight: float = unsupported(2.0, "CoCa caption weight.", LOSS, "CoCa models are planned")

    # ---- checkpoints
    save_frequency: int = flag(1, "Save a checkpoint every N epochs (0: never).", CKPT, check=non_negative_int)
    save_every_n_steps: int = flag(
        0, "Also save every N optimizer steps, mid-epoch (0: never; new in bigclip).", CKPT, check=non_negative_int
    )
    save_every_minutes: float = flag(0.0, "Also save every N minutes of training (0: never; new in bigclip).", CKPT)
    save_most_recent: bool = flag(False, "Also keep the newest state as epoch_latest.", CKPT)
    delete_previous_checkpoint: bool = flag(
        False, "Delete the previous local checkpoint after a save (remote copies are kept; see --keep-last-k).", CKPT
    )
    keep_last_k: int = flag(
        0,
        "Keep only the K newest numbered checkpoints in the remote store (locally when "
        "there is no --remote-sync); 0 keeps all (new in bigclip).",
        CKPT,
        check=non_negative_int,
    )
    resume: str | None = flag(
        None,
        "Checkpoint to resume from: a directory, a URL (s3://, gs://, az://, "
        "https://) of one, or 'latest' (local and --remote-sync).",
        CKPT,
    )
    remote_sync: str | None = flag(
        None,
        "Remote run root (s3://bucket/runs, gs://, az://, or a directory): "
        "checkpoints are uploaded as they are written and committed by a "
        "manifest; logs are copied every --remote-sync-frequency seconds.",
        CKPT,
    )
    remote_sync_frequency: int = flag(
        300, "Seconds between copies of logs and metrics (with --remote-sync).", CKPT, check=non_negative_int
    )
    remote_sync_protocol: str = flag(
        "s3",
        "s3 (needs an s3:// URL) or fsspec (any fsspec URL); both use the same parallel, retried uploads.",
        CKPT,
        choices=REMOTE_SYNC_PROTOCOLS,
    )
    storage_options: str | dict[str, Any] | None = flag(
        None,
        "JSON of fsspec options for remote paths, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\'; '
        "credentials may go here or in AWS_* variables (never logged).",
        CKPT,
    )
    storage_timeout: float = flag(
        60.0,
        "Seconds a remote store may go unanswered or failing when bigclip first reaches it (the start-of-run "
        "write check, --resume, bigclip export) before every rank stops with one line; checkpoint uploads "
        "retry longer, see --checkpoint-upload-timeout (new in bigclip).",
        CKPT,
        check=positive_seconds,
    )
    checkpoint_upload_timeout: float = flag(
        600.0,
        "Seconds one checkpoint upload step retries an unreachable or failing store before that checkpoint is "
        "given up (training goes on, the next save tries again); also the longest the final and the "
        "preemption checkpoint are waited for (new in bigclip).",
        CKPT,
        check=positive_seconds,
    )
    checkpoint_async: str = flag(
        "auto",
        "Where checkpoint files are written and uploaded: auto (thread), thread, "
        "process (DCP's daemon process; DDP/FSDP only) or off (the loop waits; "
        "new in bigclip).",
        CKPT,
        choices=ASYNC_MODES,
    )

    # ---- logging
    logs: str = flag(
        "./logs/",
        "Where logs, metrics and checkpoints go: a directory, or a URL (s3://, gs://, "
        "az://) written through a local staging folder as with --remote-sync.",
        LOG,
    )
    name: str | None = flag(None, "Run name (default: date, model, lr, batch size, precision).", LOG)
    log_every_n_steps: int = flag(100, "Print and record metrics every N steps.", LOG, check=positive_int)
    report_to: str = flag(
        "", f"Trackers besides metrics.jsonl, comma-separated (tensorboard,wandb). {REPORT_TARGETS.help()}", LOG
    )
    wandb_project_name: str = flag("open-clip", "wandb project.", LOG)
    wandb_notes: str = flag("", "wandb notes.", LOG)
    debug: bool = flag(False, "Debug logging; an error also prints its traceback above its one line.", LOG)
    log_local: bool = flag(False, "Log from the first process of every node, not only rank 0.", LOG)
    copy_codebase: bool = flag(False, "Copy the bigclip package into the run directory.", LOG)

    # ---- evaluation
    val_frequency: int = flag(1, "Validate every N epochs.", EVAL, check=positive_int)
    zeroshot_frequency: int = flag(2, "Zero-shot evaluation every N epochs.", EVAL, check=positive_int)
    imagenet_val: str | None = flag(
        None, "ImageNet validation folder (one folder per class) for zero-shot classification.", EVAL
    )
    imagenet_v2: str | None = flag(None, "ImageNet-v2 folder (class folders 0 ... 999) for zero-shot.", EVAL)

    # ---- distributed
    engine: str = flag(
        DEFAULT_ENGINE,
        "Parallelism (new in bigclip); --ds_config FILE or --deepspeed selects deepspeed.",
        DIST,
        choices=ENGINES,
    )
    ds_config: str | None = flag(
        None,
        "DeepSpeed JSON config (ds_configs/zero{1,2,3}.json, zero3_offload.json); "
        '"auto" values are filled from bigclip\'s flags. Selects --engine '
        "deepspeed.",
        DIST,
        aliases=["--ds_config", "--deepspeed_config", "--deepspeed-config"],
        metavar="FILE",
    )
    deepspeed: bool = flag(
        False, "Use the DeepSpeed engine (DeepSpeed's own flag; ZeRO-2 unless --ds_config says otherwise).", DIST
    )
    sharded_init: str = flag(
        "auto",
        "auto, always or never: build the model on the meta device and initialise it "
        "shard by shard (fsdp, deepspeed ZeRO-3); auto does so from 500M parameters.",
        DIST,
        choices=SHARDED_INIT_MODES,
    )
    fsdp_offload_cpu: bool = flag(False, "FSDP: keep parameter, gradient and optimizer shards in host memory.", DIST)
    fsdp_no_reshard_after_forward: bool = flag(
        False,
        "FSDP: keep each block's gathered parameters from forward to backward (more memory, one all-gather less).",
        DIST,
    )
    fsdp_hybrid: bool = flag(False, "FSDP: shard within each node and replicate across nodes (HSDP).", DIST)
    fsdp_replicate_degree: int = flag(
        1,
        "FSDP: replicate across this many groups, sharding within each "
        "(HSDP; --fsdp-hybrid sets it to the number of nodes).",
        DIST,
    )
    dist_url: str | None = flag(None, "Rendezvous URL (default: env:// from the launcher).", DIST)
    dist_backend: str | None = flag(None, "nccl on GPU, gloo on CPU (default: picked by device).", DIST)
    dist_timeout: float = flag(
        1800.0,
        "Seconds a collective may wait, and how long startup waits for every rank to join the process group "
        "(a node that never arrives stops the others after this long).",
        DIST,
        check=positive_seconds,
    )
    ddp_static_graph: bool = flag(False, "DDP static graph.", DIST)
    use_bn_sync: bool = flag(False, "Synchronise BatchNorm statistics across processes.", DIST)
    horovod: bool = unsupported(False, "Horovod.", DIST, "use torchrun, deepspeed or srun")
    no_set_device_rank: bool = flag(False, "Do not pin each process to the GPU of its local rank.", DIST)
    device: str = flag("cuda", "cuda or cpu (cuda falls back to cpu when no GPU is present).", DIST)
    dry_run: bool = flag(
        False,
        "Join the process group, print the world (one line per node), the engine plan and the memory plan, "
        "and exit without building the model or training.",
        DIST,
    )

    # ---- other
    config: str | None = flag(None, "YAML file of option values (flags given on the command line win).", MISC)
    cache_dir: str | None = flag(
        None,
        "Hugging Face hub cache for --pretrained tags, hf-hub: models and --pretrained-image "
        "(default: the hub's own, HF_HUB_CACHE).",
        MISC,
    )

    # Set by resolution, not by users.
    demo: bool = internal(False)

    @cached_property
    def sections(self) -> Sections:
        """The typed slices of these flags that components take (config/sections.py), built and checked once."""
        return build_sections(self)


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
