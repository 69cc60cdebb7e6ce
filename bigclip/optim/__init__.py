"""Parameter groups and optimizers.

Weight decay follows OpenCLIP 3.3: parameters with fewer than two dimensions (gains, biases, the logit scale
and bias), anything named like a norm or bias, and what the model declares (`no_weight_decay()`: the ViT's
class token, a vector in OpenCLIP) are not decayed; --wd-exclude adds name patterns (OpenCLIP main's flag).
Layer-wise learning-rate decay (--image-layer-decay, --text-layer-decay; OpenCLIP main's flags and groups)
gives each parameter of a tower the learning-rate scale decay**depth of its layer group (model/layer_groups.py)
as the group's "lr_scale"; engines set each group's lr to the schedule's lr times it (set_lr). The rules work
on names and shapes, so they give the same groups before and after an engine wraps or shards the model.

`--opt` picks a name registered in OPTIMIZERS: torch's AdamW, torch's NAdam with decoupled weight decay
(nadamw), bigclip's StableAdamW (stableadamw.py: AdamW with per-tensor update clipping), AdamW with 8-bit
moments (adamw8bit.py, torchao's) or any timm optimizer (timm/<name>); --opt-kwargs key=value pairs go to its
constructor. Weights kept in bf16 (--precision pure_bf16) are updated with stochastic rounding
(bf16_rounding.py), by StableAdamW and torchao's optimizers alike.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from timm.optim import create_optimizer_v2, get_optimizer_info
from torch import nn

from bigclip.errors import UserError
from bigclip.flag_fields import (
    TRAIN,
    Applies,
    flag,
    idle,
    non_negative_number,
    optional,
    parse_key_values,
    unit_interval,
)
from bigclip.optim.stableadamw import StableAdamW
from bigclip.registry import Registry

ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.98, "eps": 1e-6}
ADAM_HYPERPARAMETERS = frozenset(ADAM_DEFAULTS)
DEFAULT_LR = 5e-4  # OpenCLIP's --lr default


def decay_factor(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1
    return None if ok else "must be in (0, 1] (1: no decay)"


def _unknown_optimizer(names: list[str]) -> str:
    others = [n for n in names if n not in ("adamw", "timm/<optimizer name>")]
    return "choose adamw or timm/<optimizer name>" + (f", or {', '.join(others)}" if others else "")


OPTIMIZERS: Registry[OptimizerKind] = Registry("--opt", unknown=_unknown_optimizer)


@dataclass(frozen=True)
class OptimizerConfig:
    """The flags an optimizer reads (OpenCLIP's names; None: the optimizer's default)."""

    lr: float | None = flag(None, "Learning rate (default 5e-4).", TRAIN, check=optional(non_negative_number))
    opt: str = flag(
        "adamw",
        "adamw; nadamw (torch's NAdam with decoupled weight decay); "
        "stableadamw (AdamW with per-tensor update clipping, Wortsman et al. 2023; new in bigclip); "
        "adamw8bit (AdamW with 8-bit moments, torchao; new in bigclip); or timm/<name> for any timm optimizer.",
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
    wd_exclude: list[str] = flag(
        [],
        "Name patterns (fnmatch globs, '*' spans dots) of further parameters never decayed, e.g. '*.bias' "
        "'*positional_embedding*'; matched against bigclip's and OpenCLIP's name of each parameter (OpenCLIP "
        "main's flag).",
        TRAIN,
        nargs="*",
        metavar="PATTERN",
    )
    opt_kwargs: list[str] | dict[str, Any] = flag(
        [],
        "Further keyword arguments of the optimizer's constructor as key=value pairs, e.g. amsgrad=true "
        "(OpenCLIP main's flag).",
        TRAIN,
        nargs="*",
    )
    opt_fallback_list: list[str] | None = flag(
        None,
        "Name patterns (fnmatch) of parameters a Muon-family timm optimizer (timm/muon, timm/nadamuon, ...) "
        "steps with its AdamW fallback instead (OpenCLIP main's flag; matched as --wd-exclude is).",
        TRAIN,
        nargs="*",
        metavar="PATTERN",
    )
    image_layer_decay: float | None = flag(
        None,
        "Layer-wise lr decay of the image tower: a layer group at depth d below the projection trains at "
        "lr * decay**d (OpenCLIP main's groups; off when unset or 1).",
        TRAIN,
        check=optional(decay_factor),
        aliases=["--visual-layer-decay"],
    )
    text_layer_decay: float | None = flag(
        None,
        "Layer-wise lr decay of the text tower, as --image-layer-decay (off when unset or 1).",
        TRAIN,
        check=optional(decay_factor),
    )
    text_pooler_own_group: bool = flag(
        False,
        "With --text-layer-decay: a Hugging Face text tower's pooler layer (BERT-like models under cls_pooler) as a "
        "layer group of its own below the projection, instead of in the projection's group (OpenCLIP main's flag).",
        TRAIN,
        applies=Applies(lambda c: c.text_layer_decay not in (None, 1), "with --text-layer-decay (other than 1)"),
    )
    bf16_round_to_nearest: bool = flag(
        False,
        "With bf16 weights (--precision pure_bf16): round each update into the weights to nearest, as torch's "
        "AdamW does, instead of stochastically (bigclip's default for adamw, stableadamw and adamw8bit, which "
        "keeps updates smaller than half a bf16 step in expectation; new in bigclip).",
        TRAIN,
    )


@dataclass(frozen=True)
class OptimizerKind:
    """What an --opt name means: how to build it over parameter groups, and what it needs of its parameters."""

    build: Callable[[OptimizerConfig, list[dict]], torch.optim.Optimizer]
    # True when each update needs whole tensors (per-tensor statistics): an engine that hands the optimizer
    # flattened partitions of many tensors (DeepSpeed ZeRO, its bf16/fp16 wrappers) cannot run it exactly.
    per_tensor: bool = False
    # True when its state is not plain tensors (8-bit codes and scales): only torch's optimizer API over the
    # model's own parameters keeps and checkpoints it; an engine that builds its own optimizer state cannot.
    quantized_state: bool = False
    # True when a tensor's update reads only its own gradient and state, so each parameter can be stepped alone
    # as soon as its gradient is final (--optimizer-in-backward); timm's optimizers are not known to (LAMB reads
    # the global gradient norm).
    steps_per_parameter: bool = False
    # True when it rounds updates into bf16 weights stochastically (rounds_stochastically), to nearest with
    # --bf16-round-to-nearest; an optimizer that always rounds to nearest refuses that flag
    rounds_bf16_stochastically: bool = False
    # which of --beta1, --beta2, --eps and --momentum it takes (Adam's: the betas and eps); one it does not take is
    # refused rather than dropped
    takes: Callable[[OptimizerConfig], frozenset[str]] = lambda cfg: ADAM_HYPERPARAMETERS
    check: Callable[[OptimizerConfig], None] = lambda cfg: None
    # Bytes of optimizer state per parameter, given the weights' bytes (the memory model, bigclip/memory/): two
    # moments in the weights' dtype (Adam's) unless the optimizer says otherwise.
    state_bytes: Callable[[int], float] = lambda weight_bytes: 2 * weight_bytes
    # True when torch's multi-tensor update (CUDA) builds a float32 moment-sized temporary of every parameter at
    # once, and stepped tensor by tensor two float32 temporaries of one tensor (measured for torch's AdamW)
    float32_step_temporaries: bool = False
    # Bytes per value of optim/packed_update.py's temporaries beside a window's packed copies, given the weights'
    # bytes (measured: 8 with 8-bit moments, 12 with 16-bit ones); 0 where its step is not the packed update
    packed_update_temporaries: Callable[[int], float] = lambda weight_bytes: 0


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def _lr_scales(model: nn.Module, cfg: OptimizerConfig) -> dict[int, float]:
    """id(parameter) -> its learning-rate scale under layer-wise decay (parameters not listed: 1)."""
    scales: dict[int, float] = {}
    for tower, decay in (("image", cfg.image_layer_decay), ("text", cfg.text_layer_decay)):
        if decay is None or decay == 1:
            continue
        layer_depths = getattr(model, "layer_depths", None)
        depth_of = layer_depths(not cfg.text_pooler_own_group).get(tower) if layer_depths else None
        if depth_of is None:
            raise UserError(f"--{tower}-layer-decay: this model's {tower} tower has no layer groups")
        if tower == "text" and cfg.text_pooler_own_group and depth_of == layer_depths(True).get(tower):
            idle(
                "text_pooler_own_group",
                "only applies to a text tower with a pooler layer (a Hugging Face tower's, as BERT's under "
                "cls_pooler), and this model's has none",
            )
        scales.update({param_id: decay**depth for param_id, depth in depth_of.items()})
    return scales


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """The optimizer's parameter groups: decayed or not (weight_decay), and under layer-wise lr decay by
    learning-rate scale (lr_scale; largest first). Without layer decay always [not decayed, decayed]."""
    spared = set(getattr(model, "no_weight_decay", set)())
    openclip_names = getattr(model, "openclip_names", dict)()
    scales = _lr_scales(model, cfg)

    def matches(name: str, patterns: list[str]) -> bool:
        names = (name, openclip_names.get(name, name))
        return any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in patterns)

    fallback = fallback_patterns(cfg)
    buckets: dict[tuple[float, bool, bool], dict] = {}
    if not scales:
        for no_wd in (True, False):
            buckets[(1.0, no_wd, False)] = {"params": [], "weight_decay": 0.0 if no_wd else cfg.wd}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        scale = scales.get(id(p), 1.0)
        no_wd = _no_decay(name, p) or name in spared or matches(name, cfg.wd_exclude)
        key = (round(scale, 12), no_wd, matches(name, fallback))
        if key not in buckets:
            buckets[key] = {"params": [], "weight_decay": 0.0 if no_wd else cfg.wd}
            if scales:
                buckets[key]["lr_scale"] = scale
            if key[2]:
                buckets[key]["use_fallback"] = True  # timm's Muon family steps these with AdamW
        buckets[key]["params"].append(p)
    return [buckets[key] for key in sorted(buckets, key=lambda k: (-k[0], not k[1], k[2]))]


def fallback_patterns(cfg: OptimizerConfig) -> list[str]:
    """--opt-fallback-list, or OpenCLIP main's older spelling inside --opt-kwargs (fallback_list=...)."""
    given = parse_key_values("--opt-kwargs", cfg.opt_kwargs, "amsgrad=true").get("fallback_list")
    patterns = cfg.opt_fallback_list or given or []
    return [patterns] if isinstance(patterns, str) else list(patterns)


def set_lr(groups: list[dict], lr: float) -> None:
    """Every group's lr: the schedule's lr times the group's layer-decay scale."""
    for group in groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def base_lr(groups: list[dict]) -> float:
    """The schedule's lr, as set_lr last set it."""
    group = groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


# --opt-kwargs keys that set what flags also set: OpenCLIP main merges --opt-kwargs last, so they win
_HYPERPARAMETER_KWARGS = ("lr", "betas", "eps")


def opt_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """--opt-kwargs for the optimizer's constructor, less fallback_list (a parameter-group setting) and lr, betas,
    eps (folded into hyperparameters())."""
    kwargs = parse_key_values("--opt-kwargs", cfg.opt_kwargs, "amsgrad=true")
    for key in ("fallback_list", *_HYPERPARAMETER_KWARGS):
        kwargs.pop(key, None)
    return kwargs


def hyperparameters(cfg: OptimizerConfig) -> dict:
    """lr, betas, eps, wd from the flags (OpenCLIP's defaults where unset), then --opt-kwargs lr/betas/eps over
    them, as OpenCLIP main applies --opt-kwargs last."""
    given = parse_key_values("--opt-kwargs", cfg.opt_kwargs, "amsgrad=true")
    betas = given.get("betas")
    if betas is not None and not (
        isinstance(betas, tuple) and len(betas) == 2 and all(isinstance(b, int | float) for b in betas)
    ):
        raise UserError(f"--opt-kwargs betas={betas}: expected two numbers, e.g. betas=(0.9,0.95)")
    for key in ("lr", "eps"):
        if key in given and (isinstance(given[key], bool) or not isinstance(given[key], int | float)):
            raise UserError(f"--opt-kwargs {key}={given[key]}: expected a number")
    return {
        "lr": given.get("lr", cfg.lr if cfg.lr is not None else DEFAULT_LR),
        "beta1": betas[0] if betas else cfg.beta1 if cfg.beta1 is not None else ADAM_DEFAULTS["beta1"],
        "beta2": betas[1] if betas else cfg.beta2 if cfg.beta2 is not None else ADAM_DEFAULTS["beta2"],
        "eps": given.get("eps", cfg.eps if cfg.eps is not None else ADAM_DEFAULTS["eps"]),
        "wd": cfg.wd,
    }


def optimizer_kind(cfg: OptimizerConfig) -> OptimizerKind:
    return OPTIMIZERS.get(cfg.opt)


def check_optimizer(cfg: OptimizerConfig) -> None:
    """The optimizer flags' rules, before any work: a registered --opt, that optimizer's own rules, and
    --opt-kwargs its constructor takes (tried on one small tensor)."""
    kind = optimizer_kind(cfg)
    kind.check(cfg)
    taken = kind.takes(cfg)
    for name in ("beta1", "beta2", "eps", "momentum"):
        if getattr(cfg, name) is not None and name not in taken:
            idle(name, f"--opt {cfg.opt} takes no {name}")
    if fallback_patterns(cfg) and not cfg.opt.startswith("timm/"):
        raise UserError(
            f"--opt-fallback-list: only Muon-family timm optimizers (e.g. --opt timm/muon) have a fallback; "
            f"--opt {cfg.opt} has none"
        )
    hyperparameters(cfg)  # --opt-kwargs lr/betas/eps well formed
    if opt_kwargs(cfg):
        create_optimizer(cfg, [{"params": [nn.Parameter(torch.zeros(1))]}])


def create_optimizer(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    try:
        return optimizer_kind(cfg).build(cfg, groups)
    except (TypeError, ValueError) as e:
        if not opt_kwargs(cfg):
            raise
        shown = " ".join(f"{k}={v}" for k, v in opt_kwargs(cfg).items())
        raise UserError(f"--opt-kwargs {shown}: --opt {cfg.opt} refused them ({e})") from None


def rounds_stochastically(cfg: OptimizerConfig, groups: list[dict]) -> bool:
    """Whether updates are rounded stochastically into the weights: bf16 weights, unless the flag says not."""
    bf16 = any(p.dtype == torch.bfloat16 for group in groups for p in group["params"])
    return bf16 and not cfg.bf16_round_to_nearest


def _adamw(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    hp = hyperparameters(cfg)
    if rounds_stochastically(cfg, groups):
        from bigclip.optim.adamw8bit import AdamWStochasticBF16  # torchao: imported only when asked for

        return AdamWStochasticBF16(
            groups, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], **opt_kwargs(cfg)
        )
    return torch.optim.AdamW(groups, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], **opt_kwargs(cfg))


def _nadamw(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """torch's NAdam with AdamW's decoupled weight decay (OpenCLIP main's nadamw); bf16 weights round to
    nearest."""
    hp = hyperparameters(cfg)
    kwargs = {"decoupled_weight_decay": True, **opt_kwargs(cfg)}
    return torch.optim.NAdam(groups, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], **kwargs)


def _stableadamw(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    hp = hyperparameters(cfg)
    return StableAdamW(
        groups,
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        stochastic_rounding=rounds_stochastically(cfg, groups),
        **opt_kwargs(cfg),
    )


def _adamw8bit(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    from bigclip.optim.adamw8bit import AdamW8bit  # torchao: imported only when asked for

    hp = hyperparameters(cfg)
    sr = rounds_stochastically(cfg, groups)
    betas = (hp["beta1"], hp["beta2"])
    return AdamW8bit(groups, lr=hp["lr"], betas=betas, eps=hp["eps"], bf16_stochastic_round=sr, **opt_kwargs(cfg))


def _check_stableadamw(cfg: OptimizerConfig) -> None:
    if cfg.eps is not None and cfg.eps <= 0:
        raise UserError(
            f"--eps {cfg.eps!r}: must be positive with --opt stableadamw (eps^2 floors the second moment it clips by)"
        )


def _timm(cfg: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    hp = hyperparameters(cfg)
    name = cfg.opt.split("/", 1)[1]
    kwargs = {}
    given = parse_key_values("--opt-kwargs", cfg.opt_kwargs, "amsgrad=true")
    if cfg.momentum is not None:
        kwargs["momentum"] = cfg.momentum
    if cfg.beta1 is not None or cfg.beta2 is not None or "betas" in given:
        kwargs["betas"] = (hp["beta1"], hp["beta2"])
    if cfg.eps is not None or "eps" in given:
        kwargs["eps"] = hp["eps"]
    kwargs.update(opt_kwargs(cfg))
    try:
        # Groups carry their own weight decay; timm must not regroup them.
        return create_optimizer_v2(groups, opt=name, lr=hp["lr"], weight_decay=cfg.wd, **kwargs)
    except (ValueError, AssertionError, KeyError) as e:
        raise UserError(f"--opt {cfg.opt}: timm cannot build it ({e}); see timm.optim.list_optimizers()") from None


# --opt adamw8bit's state per parameter: two 8-bit moments, each with a float32 scale per block of 256 values
# (tensors under 4096 values keep float32 moments; not counted).
ADAMW8BIT_BYTES = 2 * (1 + 4 / 256)

OPTIMIZERS.register(
    "adamw",
    OptimizerKind(
        _adamw,
        steps_per_parameter=True,
        float32_step_temporaries=True,
        rounds_bf16_stochastically=True,
        packed_update_temporaries=lambda weight_bytes: 12 if weight_bytes == 2 else 0,  # bf16 weights: packed
    ),
    help="torch's AdamW",
)
OPTIMIZERS.register(
    "nadamw",
    OptimizerKind(_nadamw, steps_per_parameter=True),
    help="torch's NAdam with decoupled weight decay (OpenCLIP main's nadamw)",
)
OPTIMIZERS.register(
    "stableadamw",
    OptimizerKind(
        _stableadamw,
        per_tensor=True,
        steps_per_parameter=True,
        check=_check_stableadamw,
        float32_step_temporaries=True,
        rounds_bf16_stochastically=True,
    ),
    help="AdamW with per-tensor update clipping, Wortsman et al. 2023; new in bigclip",
)
OPTIMIZERS.register(
    "adamw8bit",
    OptimizerKind(
        _adamw8bit,
        quantized_state=True,
        steps_per_parameter=True,
        state_bytes=lambda weight_bytes: ADAMW8BIT_BYTES,
        rounds_bf16_stochastically=True,
        packed_update_temporaries=lambda weight_bytes: 8,
    ),
    help="AdamW with 8-bit blockwise-quantized moments (torchao; 2 bytes per parameter instead of 8); new in bigclip",
)


def _timm_takes(cfg: OptimizerConfig) -> frozenset[str]:
    """The hyperparameter flags timm's optimizer takes: timm drops betas and eps for one without them and sets
    momentum only for one with it (timm.optim's OptimizerInfo)."""
    name = cfg.opt.split("/", 1)[1].lower().split("_")[-1]  # timm's own parsing: lookahead_adamw -> adamw
    try:
        info = get_optimizer_info(name)
    except (ValueError, KeyError):
        return frozenset({"beta1", "beta2", "eps", "momentum"})  # an unknown name stops where it is built
    return frozenset(
        (["beta1", "beta2"] if info.has_betas else []) + (["eps"] if info.has_eps else [])
        + (["momentum"] if info.has_momentum else [])
    )  # fmt: skip


OPTIMIZERS.register(
    "timm/",
    OptimizerKind(_timm, takes=_timm_takes),
    prefix=True,
    shown_as="timm/<optimizer name>",
    help="any timm optimizer",
)
