"""DeepSpeed JSON configs: read them, fill every "auto" from the flags (an EngineConfig), refuse contradictions.

DeepSpeed itself does not resolve "auto" (only the Hugging Face integration does), so a config written
for bigclip may leave the values bigclip already knows to bigclip:

    train_micro_batch_size_per_gpu   --batch-size
    gradient_accumulation_steps      --accum-freq
    train_batch_size                 micro x accum x world size (computed; an explicit value must agree)
    gradient_clipping                --grad-clip-norm (0 = off)
    bf16.enabled / fp16.enabled      --precision (amp on CPU, amp_bf16, bf16 -> bf16; GPU amp, fp16 -> fp16)
    optimizer.params.*               --lr, --beta1/--beta2 (betas), --eps, --wd
    zero_optimization.*bucket*, stage3_param_persistence_threshold   from the model's width
    zero_optimization.offload_param.nvme_path   --zero-nvme-path (ZeRO-Infinity; the folder must be writable)

An explicit value that contradicts the run (e.g. train_micro_batch_size_per_gpu 32 with --batch-size 64)
stops the run before any work with one line naming both. bigclip's --lr-scheduler drives the learning rate
(engine.set_lr), so a "scheduler" section is refused rather than silently fighting it.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from bigclip.engine.config import EngineConfig
from bigclip.errors import UserError
from bigclip.optim import hyperparameters, opt_kwargs
from bigclip.precision import resolve_precision

AUTO = "auto"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_configs")
# Used by `--engine deepspeed` without a config file: ZeRO-2, everything else filled from flags.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": AUTO,
    "gradient_accumulation_steps": AUTO,
    "gradient_clipping": AUTO,
    "bf16": {"enabled": AUTO},
    "fp16": {"enabled": AUTO},
    "zero_optimization": {"stage": 2},
}


def read(path: str, flag: str = "--ds_config") -> dict[str, Any]:
    """The JSON object in `path`, or a UserError naming the file (and line, for syntax errors)."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: file not found; pass a DeepSpeed JSON config (examples in ds_configs/)")
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{flag} {path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}); fix the file"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{flag} {path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def precision_flags(cfg: EngineConfig, device_type: str) -> tuple[bool, bool]:
    """(bf16, fp16) as DeepSpeed should run for --precision on this device."""
    p = resolve_precision(cfg.precision, torch.device(device_type))
    low = {p.autocast_dtype, p.param_dtype}
    return torch.bfloat16 in low, torch.float16 in low


def _fill(section: dict, key: str, value: Any, where: str, source: str, path: str, equal=lambda a, b: a == b) -> None:
    """Set section[key] to `value` when it is absent or "auto"; otherwise it must agree."""
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif not equal(current, value):
        raise UserError(
            f"{path}: {where} is {json.dumps(current)} but {source} means {json.dumps(value)}; "
            f'make them agree or set it to "auto"'
        )


def _close(a, b) -> bool:
    try:
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    except (TypeError, ValueError):
        return False


def _close_seq(a, b) -> bool:
    return isinstance(a, (list, tuple)) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))


def _find_auto(node: Any, prefix: str = "") -> str | None:
    if node == AUTO:
        return prefix or "(top level)"
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{prefix}.{k}" if prefix else k)
            if found:
                return found
    if isinstance(node, list):
        for i, v in enumerate(node):
            found = _find_auto(v, f"{prefix}[{i}]")
            if found:
                return found
    return None


def resolve(
    cfg: EngineConfig,
    world_size: int | None,
    device_type: str,
    hidden_size: int | None = None,
    raw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config DeepSpeed receives: the file (or DEFAULT_CONFIG) with every "auto" filled.

    world_size None checks everything except train_batch_size (as at flag-validation time, before the
    launcher's world is known). hidden_size (the model's widest tower) fills the bucket sizes.
    """
    return for_run(resolve_flags(cfg, device_type, raw), cfg, world_size, hidden_size)


# DeepSpeed sections (and sub-sections) that are JSON objects: anything else would reach DeepSpeed's config
# classes (or bigclip's .get) and end in a traceback instead of a line naming the file and the key.
OBJECT_SECTIONS = (
    "bf16", "fp16", "amp", "optimizer", "optimizer.params", "scheduler", "zero_optimization",
    "zero_optimization.offload_param", "zero_optimization.offload_optimizer", "torch_autocast",
    "activation_checkpointing", "flops_profiler", "comms_logger", "aio", "checkpoint", "data_types",
    "tensorboard", "wandb", "csv_monitor", "monitor_config", "compression_training", "data_efficiency",
    "elasticity", "autotuning", "pipeline", "sparse_attention",
)  # fmt: skip


def _require_objects(ds: dict[str, Any], path: str) -> None:
    for dotted in OBJECT_SECTIONS:
        node: Any = ds
        for key in dotted.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            raise UserError(
                f'{path}: "{dotted}" must be a JSON object ({{...}}), not {type(node).__name__} {node!r}; see the '
                f"examples in ds_configs/"
            )


def resolve_flags(cfg: EngineConfig, device_type: str, raw: dict[str, Any] | None = None) -> dict[str, Any]:
    """The file (read once, here) with every value that depends on flags alone filled and checked: what
    flag validation computes and the engine later completes with for_run()."""
    path = cfg.engine_flags.ds_config or "the default DeepSpeed config"
    ds = copy.deepcopy(
        raw if raw is not None else (read(cfg.engine_flags.ds_config) if cfg.engine_flags.ds_config else DEFAULT_CONFIG)
    )
    _require_objects(ds, path)

    _fill(
        ds,
        "train_micro_batch_size_per_gpu",
        cfg.batch_size,
        "train_micro_batch_size_per_gpu",
        f"--batch-size {cfg.batch_size}",
        path,
    )
    _fill(
        ds,
        "gradient_accumulation_steps",
        cfg.accum_freq,
        "gradient_accumulation_steps",
        f"--accum-freq {cfg.accum_freq}",
        path,
    )
    clip = cfg.grad_clip_norm if cfg.grad_clip_norm is not None else 0.0
    _fill(
        ds,
        "gradient_clipping",
        float(clip),
        "gradient_clipping",
        f"--grad-clip-norm {cfg.grad_clip_norm}",
        path,
        _close,
    )

    bf16, fp16 = precision_flags(cfg, device_type)
    for name, want in (("bf16", bf16), ("fp16", fp16)):
        section = ds.setdefault(name, {})
        if not isinstance(section, dict):
            raise UserError(f'{path}: "{name}" must be an object like {{"enabled": "auto"}}')
        _fill(section, "enabled", want, f"{name}.enabled", f"--precision {cfg.precision} on {device_type}", path)
    if fp16:
        ds["fp16"].setdefault("loss_scale", 0)  # 0: dynamic loss scaling, as torch's GradScaler
    if "bfloat16" in ds:
        raise UserError(f'{path}: use the "bf16" section instead of the legacy "bfloat16" one')
    if ds.get("torch_autocast", {}).get("enabled"):
        raise UserError(
            f'{path}: "torch_autocast" is not used by bigclip; remove it and pick mixed '
            f"precision with --precision (amp_bf16 -> DeepSpeed bf16)"
        )

    if "scheduler" in ds:
        raise UserError(
            f'{path}: remove the "scheduler" section; bigclip\'s --lr-scheduler, --lr and '
            f"--warmup drive DeepSpeed's learning rate"
        )
    if "optimizer" in ds:
        _fill_optimizer(ds["optimizer"], cfg, path)
    else:
        # bigclip hands DeepSpeed its own torch optimizer (no FusedAdam/CPUAdam JIT build).
        ds.setdefault("zero_allow_untested_optimizer", True)

    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict) or zero.get("stage", 0) not in (0, 1, 2, 3):
        raise UserError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3")
    _fill_nvme_paths(zero, cfg, path)
    if offloads_to_nvme(ds) and device_type == "cpu" and not bf16:
        # zero.Init(dtype=...) takes the accelerator's default instead when the accelerator has no fp16, so the
        # CPU accelerator's parameter swapper keeps float32 weights as bf16 (measured: the losses drift from
        # ZeRO-3 offload's); with bf16 weights that is what they are anyway.
        raise UserError(
            f"{path}: parameters swapped to NVMe on the CPU accelerator are stored in bf16 by DeepSpeed whatever "
            f"--precision {cfg.precision} keeps; use --precision amp or amp_bf16 (DeepSpeed bf16) for ZeRO-Infinity"
        )
    ds.setdefault("steps_per_print", 10**9)  # bigclip logs progress itself
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def for_run(
    flag_values: dict[str, Any], cfg: EngineConfig, world_size: int | None, hidden_size: int | None
) -> dict[str, Any]:
    """resolve_flags()'s dict completed with what the run adds: train_batch_size from the world size, bucket
    sizes from the model's width. Any "auto" left after that is an error."""
    ds = copy.deepcopy(flag_values)
    path = cfg.engine_flags.ds_config or "the default DeepSpeed config"
    zero = ds["zero_optimization"]
    if world_size is not None:
        total = cfg.batch_size * cfg.accum_freq * world_size
        _fill(
            ds,
            "train_batch_size",
            total,
            "train_batch_size",
            f"--batch-size {cfg.batch_size} x --accum-freq {cfg.accum_freq} x {world_size} processes",
            path,
        )
    if hidden_size is not None:
        # The Hugging Face integration's rule of thumb for these sizes.
        for key, value in (
            ("reduce_bucket_size", hidden_size * hidden_size),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
            ("stage3_param_persistence_threshold", 10 * hidden_size),
        ):
            if zero.get(key) == AUTO:
                zero[key] = value
    # Before the world (or the model) is known, what only it can fill may still be "auto".
    unknown = ({"train_batch_size"} if world_size is None else set()) | (
        {"zero_optimization"} if hidden_size is None else set()
    )
    leftover = _find_auto({k: v for k, v in ds.items() if k not in unknown})
    if leftover:
        raise UserError(f'{path}: {leftover} is "auto" but bigclip cannot fill it; give a value')
    return ds


def _fill_optimizer(section: dict, cfg: EngineConfig, path: str) -> None:
    kind = str(section.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise UserError(
            f"{path}: optimizer.type {section.get('type')!r} is not supported by bigclip; "
            f'use "AdamW" or drop the optimizer section (bigclip then passes its own --opt)'
        )
    if cfg.optimizer.opt != "adamw":
        raise UserError(
            f"{path}: optimizer.type {section.get('type')!r} contradicts --opt {cfg.optimizer.opt}; "
            f"drop the optimizer section or use --opt adamw"
        )
    if opt_kwargs(cfg.optimizer):
        raise UserError(
            f"{path}: the optimizer section's params are DeepSpeed's optimizer arguments; put what --opt-kwargs "
            f"says there, or drop the section (bigclip then builds --opt with --opt-kwargs)"
        )
    hp = hyperparameters(cfg.optimizer)
    params = section.setdefault("params", {})
    _fill(params, "lr", hp["lr"], "optimizer.params.lr", f"--lr {hp['lr']}", path, _close)
    _fill(
        params,
        "betas",
        [hp["beta1"], hp["beta2"]],
        "optimizer.params.betas",
        f"--beta1 {hp['beta1']} --beta2 {hp['beta2']}",
        path,
        _close_seq,
    )
    _fill(params, "eps", hp["eps"], "optimizer.params.eps", f"--eps {hp['eps']}", path, _close)
    # bigclip's parameter groups carry their own weight decay (none on gains, biases, logit scale);
    # this value applies to the decayed group.
    _fill(params, "weight_decay", hp["wd"], "optimizer.params.weight_decay", f"--wd {hp['wd']}", path, _close)
    if kind == "adam":
        params.setdefault("adam_w_mode", True)  # OpenCLIP's AdamW: decoupled weight decay


def _fill_nvme_paths(zero: dict[str, Any], cfg: EngineConfig, path: str) -> None:
    """ZeRO-Infinity's parameter swap folder: "auto" is --zero-nvme-path; the folder must exist and be writable,
    and DeepSpeed swaps parameters to NVMe only at stage 3. Optimizer state on NVMe is refused (see below)."""
    for section in ("offload_param", "offload_optimizer"):
        offload = zero.get(section) or {}
        if offload.get("device") != "nvme":
            continue
        where = f"zero_optimization.{section}.nvme_path"
        if section == "offload_optimizer":
            # engine.load_checkpoint skips the ZeRO optimizer file when the optimizer is swapped to NVMe and copies
            # back only the swap files: Adam's step counts, and every sub-group under aio's 1 MiB minimum (never
            # swapped), restart from scratch. Measured with DeepSpeed 0.19.8: the second step after a resume
            # differs from the uninterrupted run's (the first already does for small sub-groups).
            raise UserError(
                f'{path}: zero_optimization.offload_optimizer.device "nvme": DeepSpeed cannot resume the '
                f"checkpoints it writes so (its load restarts Adam's step counts); offload the optimizer to "
                f'"cpu" and the parameters to "nvme", as ds_configs/zero3_nvme.json does'
            )
        if zero.get("stage", 0) != 3:
            raise UserError(
                f'{path}: zero_optimization.{section}.device is "nvme" but ZeRO-Infinity swaps to NVMe only '
                f'at zero_optimization.stage 3 (this file: {zero.get("stage", 0)}); use stage 3 or device "cpu"'
            )
        if offload.get("nvme_path", AUTO) == AUTO:
            if not cfg.engine_flags.zero_nvme_path:
                raise UserError(
                    f'{path}: {where} is "auto"; pass --zero-nvme-path DIR (a folder on a local NVMe drive) or '
                    f"write the folder into the file"
                )
            offload["nvme_path"] = cfg.engine_flags.zero_nvme_path
        elif cfg.engine_flags.zero_nvme_path and offload["nvme_path"] != cfg.engine_flags.zero_nvme_path:
            raise UserError(
                f"{path}: {where} is {json.dumps(offload['nvme_path'])} but --zero-nvme-path says "
                f'{json.dumps(cfg.engine_flags.zero_nvme_path)}; make them agree or set it to "auto"'
            )
        folder = offload["nvme_path"]
        if not (isinstance(folder, str) and os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)):
            source = (
                f"--zero-nvme-path {folder}"
                if folder == cfg.engine_flags.zero_nvme_path
                else f"{path}: {where} {folder!r}"
            )
            raise UserError(f"{source}: not a writable folder; create it (on a local NVMe drive) or name another")


def offloads_to_nvme(ds: dict[str, Any]) -> bool:
    zero = ds.get("zero_optimization", {})
    return any((zero.get(s) or {}).get("device") == "nvme" for s in ("offload_param", "offload_optimizer"))


def stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offloads_params(ds: dict[str, Any]) -> bool:
    device = (ds.get("zero_optimization", {}).get("offload_param") or {}).get("device", "none")
    return device not in (None, "none")


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = (ds.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    return device not in (None, "none")
