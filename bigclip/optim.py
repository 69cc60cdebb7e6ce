"""Parameter groups and optimizers.

Weight decay follows OpenCLIP: parameters with fewer than two dimensions (gains, biases, the logit scale
and bias), and anything named like a norm or bias, are not decayed. The rule works on names and shapes, so
it gives the same groups before and after an engine wraps or shards the model.
"""

from __future__ import annotations

import torch
from timm.optim import create_optimizer_v2
from torch import nn

from bigclip.errors import UserError

ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.98, "eps": 1e-6}


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or "bn" in name or "ln" in name or "norm" in name or "bias" in name or "logit_scale" in name


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if _no_decay(name, p) else decay).append(p)
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]


def hyperparameters(cfg) -> dict:
    return {
        "lr": cfg.lr if cfg.lr is not None else 5e-4,
        "beta1": cfg.beta1 if cfg.beta1 is not None else ADAM_DEFAULTS["beta1"],
        "beta2": cfg.beta2 if cfg.beta2 is not None else ADAM_DEFAULTS["beta2"],
        "eps": cfg.eps if cfg.eps is not None else ADAM_DEFAULTS["eps"],
        "wd": cfg.wd,
    }


def create_optimizer(cfg, groups: list[dict]) -> torch.optim.Optimizer:
    hp = hyperparameters(cfg)
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])
    name = cfg.opt.split("/", 1)[1]
    kwargs = {}
    if cfg.momentum is not None:
        kwargs["momentum"] = cfg.momentum
    if cfg.beta1 is not None or cfg.beta2 is not None:
        kwargs["betas"] = (hp["beta1"], hp["beta2"])
    if cfg.eps is not None:
        kwargs["eps"] = hp["eps"]
    try:
        # Groups carry their own weight decay; timm must not regroup them.
        return create_optimizer_v2(groups, opt=name, lr=hp["lr"], weight_decay=cfg.wd, **kwargs)
    except (ValueError, AssertionError, KeyError) as e:
        raise UserError(f"--opt {cfg.opt}: timm cannot build it ({e}); see timm.optim.list_optimizers()") from None
