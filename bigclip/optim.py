"""Parameter groups and optimizers.

Weight decay follows OpenCLIP 3.3: parameters with fewer than two dimensions (gains, biases, the logit scale
and bias), anything named like a norm or bias, and what the model declares (`no_weight_decay()`: the ViT's
class token, a vector in OpenCLIP) are not decayed; --wd-exclude adds name patterns (OpenCLIP main's flag).
Layer-wise learning-rate decay (--image-layer-decay, --text-layer-decay; OpenCLIP main's flags and groups)
gives each parameter of a tower the learning-rate scale decay**depth of its layer group (model/layer_groups.py)
as the group's "lr_scale"; engines set each group's lr to the schedule's lr times it (set_lr). The rules work
on names and shapes, so they give the same groups before and after an engine wraps or shards the model.

`--opt` picks a name registered in OPTIMIZERS: torch's AdamW, torch's NAdam with decoupled weight decay
(nadamw), bigclip's StableAdamW (AdamW with per-tensor update clipping), AdamW with 8-bit moments
(torchao_optim.py) or any timm optimizer (timm/<name>); --opt-kwargs key=value pairs go to its constructor.
"""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from timm.optim import create_optimizer_v2
from torch import nn
from torch.distributed.tensor import DTensor

from bigclip import bf16_rounding
from bigclip.dist import local_shard
from bigclip.errors import UserError
from bigclip.flag_fields import TRAIN, flag, non_negative_number, optional, parse_key_values, unit_interval
from bigclip.registry import Registry

ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.98, "eps": 1e-6}
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
    check: Callable[[OptimizerConfig], None] = lambda cfg: None


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
    optimizer_kind(cfg).check(cfg)
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
        from bigclip.torchao_optim import AdamWStochasticBF16  # torchao: imported only when asked for

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
    from bigclip.torchao_optim import AdamW8bit  # torchao: imported only when asked for

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


def _debiased(beta: float, step: float) -> float:
    """The paper's bias-corrected decay: with it the moving averages are AdamW's m/(1-beta1^t), v/(1-beta2^t)
    themselves, which the update and the clipping ratio both read (0 at step 1: the moments start as g, g^2)."""
    return beta * (1.0 - beta ** (step - 1)) / (1.0 - beta**step)


def _sharded_dims(tensor: torch.Tensor) -> tuple | None:
    """(mesh, the mesh dimensions `tensor` is split over): where its per-shard sums must be added up."""
    if not isinstance(tensor, DTensor):
        return None
    dims = tuple(i for i, placement in enumerate(tensor.placements) if placement.is_shard())
    return (tensor.device_mesh, dims) if dims else None


class StableAdamW(torch.optim.Optimizer):
    """AdamW with AdaFactor's update clipping applied per tensor: StableAdamW, Algorithm 2 of Wortsman et al.,
    "Stable and low-precision training for large-scale vision-language models" (2023).

    For every parameter tensor, at its step t (counted from 1 per tensor, as torch's AdamW does):

        beta1_hat = beta1 (1 - beta1^(t-1)) / (1 - beta1^t),  likewise beta2_hat
        v_t   = beta1_hat v_{t-1} + (1 - beta1_hat) g_t               (state "exp_avg")
        u_t   = beta2_hat u_{t-1} + (1 - beta2_hat) g_t^2             (state "exp_avg_sq")
        RMS_t = sqrt(mean over the whole tensor of g_t^2 / max(u_t, eps^2))
        eta_t = lr / max(1, RMS_t)
        theta_t = theta_{t-1} - eta_t weight_decay theta_{t-1} - eta_t v_t / (sqrt(u_t) + eps)

    The variant, where implementations differ:

    - Bias correction as in the paper: the debiased betas make v_t and u_t equal to AdamW's bias-corrected
      moments m_t / (1 - beta1^t) and v_t / (1 - beta2^t), and the clipping ratio uses the corrected u_t.
      While RMS_t <= 1 a step is therefore exactly torch.optim.AdamW's step. The stored moments are the
      corrected ones, so an AdamW checkpoint's optimizer state does not carry over (nor the reverse).
    - eps: added to sqrt(u_t) outside the square root (as AdamW), and eps^2 floors u_t inside the ratio; it must
      be positive (a zero gradient entry with u_t = 0 would otherwise make the ratio 0/0).
    - Weight decay is decoupled and uses the clipped eta_t, as the paper's algorithm, optimi and the later
      version of the author's reference gist do (its first version decayed with the unclipped lr). Each
      parameter group carries its own weight_decay (bigclip's groups: 0 for gains, biases, logit scale).
    - The clipping threshold is 1 (the paper's); there is no separate gradient clipping inside.

    Sharded parameters (FSDP2's DTensors): RMS_t is over the whole tensor, not the local shard. Each rank sums
    its shard's ratios and the sums are all-reduced over the mesh dimensions the tensor is sharded on (one
    all-reduce for all tensors of a mesh), so every rank clips exactly as one process holding the whole tensor
    would. step() is therefore a collective under FSDP2, as the engine's grad-norm already is. Flattened
    partitions of many tensors (DeepSpeed ZeRO) cannot be clipped per tensor; the config refuses that pairing.

    Moments are kept in the parameter's dtype (as AdamW); the ratio is summed in float32. With bf16 weights and
    stochastic_rounding, the update is computed in float32 and rounded into the weights stochastically
    (bigclip/bf16_rounding.py).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        stochastic_rounding: bool = False,
    ):
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"StableAdamW: lr must be a non-negative number, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"StableAdamW: betas must lie in [0, 1), got {betas}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"StableAdamW: eps must be positive (it floors u_t in the clipping ratio), got {eps}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"StableAdamW: weight_decay must be non-negative, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.stochastic_rounding = stochastic_rounding  # bf16 weights: see bigclip/bf16_rounding.py
        # The position of its first parameter among the model's: an optimizer of one parameter (stepped in the
        # backward) seeds that parameter's rounding as the optimizer of them all would.
        self.first_index = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Pass 1: moments and each tensor's (local) sum of g^2 / max(u, eps^2).
        work: list[tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        sums: list[torch.Tensor] = []
        numels: list[int] = []
        batches: dict[tuple, list[int]] = defaultdict(list)  # (mesh and sharded dims or None, device) -> indices
        index = self.first_index - 1  # the parameter's position (a stochastic rounding seed)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            eps = group["eps"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StableAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # A CPU float step, as torch's AdamW keeps it: checkpoints and load_state_dict treat it alike.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                param, grad = local_shard(p), local_shard(p.grad)
                exp_avg, exp_avg_sq = local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
                beta1_hat, beta2_hat = _debiased(beta1, t), _debiased(beta2, t)
                exp_avg.mul_(beta1_hat).add_(grad, alpha=1.0 - beta1_hat)
                exp_avg_sq.mul_(beta2_hat).addcmul_(grad, grad, value=1.0 - beta2_hat)
                ratio = grad.float().square().div_(exp_avg_sq.float().clamp(min=eps * eps))
                batches[(_sharded_dims(p), param.device)].append(len(sums))
                sums.append(ratio.sum())
                numels.append(p.numel())  # a DTensor's numel is the whole tensor's
                work.append((group, param, exp_avg, exp_avg_sq, index, p))

        # Pass 2: whole-tensor sums, one host transfer per batch; sharded tensors' shard sums are all-reduced
        # first, once per mesh and set of sharded dims.
        totals = [0.0] * len(sums)
        for (sharded, _device), members in batches.items():
            stacked = torch.stack([sums[i] for i in members])
            if sharded is not None:
                mesh, dims = sharded
                if stacked.device.type != mesh.device_type:  # CPU-offloaded shards on a CUDA mesh
                    stacked = stacked.to(mesh.device_type)
                for dim in dims:
                    dist.all_reduce(stacked, group=mesh.get_group(dim))
            for i, total in zip(members, stacked.tolist()):
                totals[i] = total

        # Pass 3: the update with the clipped learning rate, weight decay included.
        with bf16_rounding.own_random_stream([w[1] for w in work]):
            for (group, param, exp_avg, exp_avg_sq, index, p), total, numel in zip(work, totals, numels):
                rms = math.sqrt(total / max(numel, 1))
                eta = float(group["lr"]) / max(1.0, rms)
                stochastic = self.stochastic_rounding and param.dtype == torch.bfloat16
                target = param.float() if stochastic else param  # bf16: the update in float32, then rounded
                if group["weight_decay"] != 0:
                    target.mul_(1.0 - eta * group["weight_decay"])
                m, v = (exp_avg.float(), exp_avg_sq.float()) if stochastic else (exp_avg, exp_avg_sq)
                target.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-eta)
                if stochastic:
                    bf16_rounding.seed_update(int(self.state[p]["step"]), index, p)
                    bf16_rounding.round_into_bf16_(param, target)
        return loss


OPTIMIZERS.register("adamw", OptimizerKind(_adamw, steps_per_parameter=True), help="torch's AdamW")
OPTIMIZERS.register(
    "nadamw",
    OptimizerKind(_nadamw, steps_per_parameter=True),
    help="torch's NAdam with decoupled weight decay (OpenCLIP main's nadamw)",
)
OPTIMIZERS.register(
    "stableadamw",
    OptimizerKind(_stableadamw, per_tensor=True, steps_per_parameter=True, check=_check_stableadamw),
    help="AdamW with per-tensor update clipping, Wortsman et al. 2023; new in bigclip",
)
OPTIMIZERS.register(
    "adamw8bit",
    OptimizerKind(_adamw8bit, quantized_state=True, steps_per_parameter=True),
    help="AdamW with 8-bit blockwise-quantized moments (torchao; 2 bytes per parameter instead of 8); new in bigclip",
)
OPTIMIZERS.register(
    "timm/", OptimizerKind(_timm), prefix=True, shown_as="timm/<optimizer name>", help="any timm optimizer"
)
