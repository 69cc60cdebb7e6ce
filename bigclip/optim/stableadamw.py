"""StableAdamW (Wortsman et al. 2023, Algorithm 2): AdamW with AdaFactor's update clipping per tensor, the
optimizer of the SwitchBack paper's stable int8 recipe (`--opt stableadamw`; registered in bigclip.optim)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import bigclip.optim.bf16_rounding as bf16_rounding
from bigclip.dist import local_shard


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
    (bigclip/optim/bf16_rounding.py).
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
        self.stochastic_rounding = stochastic_rounding  # bf16 weights: see bigclip/optim/bf16_rounding.py
        # The position of its first parameter among the model's: an optimizer of one parameter (stepped in the
        # backward) draws that parameter's rounding bits as the optimizer of them all would.
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
        index = self.first_index - 1  # the parameter's position (its rounding bits' counter)
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
                step = int(self.state[p]["step"])
                bf16_rounding.round_into_bf16_(param, target, step, index, bf16_rounding.shard_key(p))
        return loss
