"""AdamW on torchao: 8-bit moments (--opt adamw8bit) and stochastic rounding into bf16 weights (--precision
pure_bf16; bf16_rounding.py), made to fit bigclip's loop and checkpoints.

Why torchao (measured, docs/benchmarks.md "8-bit AdamW"): its optimizer state is a tensor subclass that FSDP2's
DTensors can wrap, so each rank quantizes its own shard with no code of ours, while bitsandbytes' 8-bit AdamW
stops at the first DTensor ("got mixed torch.Tensor and DTensor"). Both keep the same 2 bytes per parameter
(uint8 codes for each moment + one float32 scale per block of 256 values) and agree with each other.

The quantization (torchao's): each moment tensor is cut into blocks of 256 consecutive values of the rank's local
tensor (row-major), every block scaled by its absolute maximum and mapped to 8-bit codes by a dynamic-tree map
(signed for the first moment, unsigned for the second), as bitsandbytes' blockwise 8-bit Adam. Tensors of fewer
than 4096 values, or whose local size is not a multiple of 256 (an uneven FSDP2 shard), keep float moments.
Under FSDP2 the blocks therefore never cross a shard boundary: a block is 256 values of one rank's shard.

What this module adds to torchao's optimizer:

- The learning rate stays a float in param_groups (the loop and the checkpoint read and write it as one);
  step() hands torchao's compiled update a tensor (so a changing rate does not recompile it).
- step() updates each rank's local tensors (see step()).
- Checkpoints hold the moments dequantized to float32, in the layout of torch's AdamW: DCP reshards them to any
  world size, torch's AdamW checkpoints load into it and the reverse, and loading quantizes them again. Plain
  requantization would not give back the saved codes: the signed map's most negative code is -0.99297, not -1,
  so a block whose largest magnitude is negative would come back with its scale shrunk by that factor. Loading
  therefore recovers each block's scale (the candidates its extreme value allows) and keeps the one whose codes
  reproduce every saved value bit for bit: a run resumed at the same world size continues exactly. Blocks that
  no scale reproduces (a resharded run's blocks straddle the old ones; an AdamW checkpoint) are quantized as a
  step would. A save makes the float32 moments one tensor at a time as its stager copies them to host memory
  (staged_values.py), not all at once on the device (8 bytes per parameter).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch.distributed.tensor import DTensor

from bigclip.dist import local_shard
from bigclip.optim import packed_update
from bigclip.staged_values import made_when_staged

# torchao's import registers an Enum with torch's pytree, which logs a deprecation line on every run; and AOT
# autograd's cache warns on every compile that torchao's state class has no stable hash. Neither is the user's.
_pytree_log = logging.getLogger("torch.utils._pytree")
_level = _pytree_log.level
_pytree_log.setLevel(logging.ERROR)
try:
    from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
    from torchao.optim import _AdamW as _TorchaoAdamW
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned
finally:
    _pytree_log.setLevel(_level)
warnings.filterwarnings("ignore", message="OptimState8bit does not implement _stable_hash_for_caching")

MOMENTS = ("exp_avg", "exp_avg_sq")
SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the first moment has a sign, the second does not


def is_quantized(t: torch.Tensor) -> bool:
    return isinstance(local_shard(t), OptimState8bit)


def _dequantized(t: torch.Tensor):
    """The moment in float32 (whatever the weights are: the codes come back exactly); while a checkpoint stages
    the state dict (staged_values.staging_into), made one tensor at a time as it is copied to host memory."""
    local = local_shard(t)
    if not isinstance(local, OptimState8bit):
        return t

    def wrap(plain: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return DTensor.from_local(
                plain, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return plain

    return made_when_staged(local, lambda: local.dequantize(torch.float32), local.shape, torch.float32, wrap)


@torch.no_grad()
def quantize_exactly_(state: OptimState8bit, values: torch.Tensor) -> None:
    """Set `state` to `values`, with the codes and per-block scales that dequantize to `values` bit for bit
    when the values came from dequantizing such a state (see the module docstring); otherwise as copy_ would."""
    qmap = state.qmap
    blocks = values.detach().reshape(-1, state.block_size).to(device=qmap.device, dtype=torch.float32)
    absmax = blocks.abs().amax(-1)
    candidates = [absmax]  # the block's extreme value was coded as +1.0 (what copy_ assumes)
    if state.signed:  # ... or as the most negative code: scale = |value| / |code|, give or take rounding
        scale = absmax / -qmap.min()
        up, down = torch.nextafter(scale, scale + 1), torch.nextafter(scale, torch.zeros_like(scale))
        candidates += [scale, up, down, torch.nextafter(up, up + 1), torch.nextafter(down, torch.zeros_like(down))]
    codes = torch.empty(blocks.shape, dtype=torch.uint8, device=qmap.device)
    scales = torch.empty_like(absmax)
    found = torch.zeros_like(absmax, dtype=torch.bool)
    for candidate in candidates:
        candidate = candidate.clip(1e-12)  # as torchao's scale_tensor
        trial = quantize_8bit_with_qmap(blocks / candidate[:, None], qmap)
        take = ~found & (qmap[trial.int()] * candidate[:, None] == blocks).all(-1)
        codes[take], scales[take] = trial[take], candidate[take]
        found |= take
    if not bool(found.all()):  # values no scale reproduces: quantized as copy_ (and a step) would
        scale = absmax.clip(1e-12)
        trial = quantize_8bit_with_qmap(blocks / scale[:, None], qmap)
        codes[~found], scales[~found] = trial[~found], scale[~found]
    state.codes.copy_(codes.view(state.codes.shape))
    state.scale.copy_(scales)


class _LocalUpdate:
    """What bigclip changes in torchao's AdamW (mixed into its optimizer classes): float learning rates in
    param_groups, and the step: packed_update.py's one compiled update over windows of many tensors (torchao's
    arithmetic, each rank's local tensors), with counter-based stochastic rounding into bf16 weights."""

    param_groups: list[dict]
    state: dict
    block_size: float
    bf16_stochastic_round: bool
    # The position of its first parameter among the model's: an optimizer of one parameter (stepped in the
    # backward) draws that parameter's rounding bits as the optimizer of them all would.
    first_index: int = 0
    _windows: list[packed_update.Window] | None = None
    _members_planned: list[packed_update.Member]
    window_blocks = packed_update.WINDOW_BLOCKS

    def _float_rates(self) -> None:
        for group in self.param_groups:  # torchao turns them into tensors
            group["lr"] = float(group["lr"])

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.param_groups[-1]["lr"] = float(self.param_groups[-1]["lr"])
        self._windows = None  # planned again at the next step

    def _quantizes(self, local: torch.Tensor) -> bool:
        """torchao's rule (_new_buffer): 8-bit moments for tensors of >= 4096 values in whole blocks."""
        return local.numel() >= 4096 and local.numel() % self.block_size == 0

    def _members(self) -> list[packed_update.Member]:
        """This optimizer's parameters in order; windows group them by this optimizer's groups unless it is one of
        the per-parameter optimizers of a model's group (model_group, set by the engine's in-backward step)."""
        members, index = [], self.first_index
        for number, group in enumerate(self.param_groups):
            for p in group["params"]:
                key = getattr(self, "model_group", None)
                members.append(packed_update.Member(self, number, p, number if key is None else key, index))
                index += 1
        return members

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._windows is None:
            self._members_planned = self._members()
            self._windows = packed_update.plan_windows(self._members_planned, self._quantizes, self.window_blocks)
        packed_step(self._members_planned, self._windows)
        return loss

    @staticmethod
    @torch.no_grad()
    def step_together(optimizers: list[_LocalUpdate], plans: dict) -> None:
        """Step several optimizers of this kind as one (their tensors packed together: the optimizers stepped in
        the backward, a transformer block at a time). `plans`: the caller's cache of window plans."""
        key = tuple(id(optimizer) for optimizer in optimizers)
        if key not in plans:
            members = [member for optimizer in optimizers for member in optimizer._members()]
            first = optimizers[0]
            plans[key] = (members, packed_update.plan_windows(members, first._quantizes, first.window_blocks))
        packed_step(*plans[key])


def packed_step(members: list[packed_update.Member], windows: list[packed_update.Window]) -> None:
    """One AdamW step of `members` (see packed_update.py): their states made on their first gradient (by their
    owners, as torchao makes them), then each window with an active tensor updated by the compiled function."""
    params = [member.param for member in members]
    states = []
    for member in members:
        p, owner = member.param, member.owner
        state = owner.state[p] if p.grad is not None else owner.state.get(p, {})
        if p.grad is not None:
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = owner._new_buffer(p, True)
                state["exp_avg_sq"] = owner._new_buffer(p, False)
            state["step"] += 1
        states.append(state)
    update = packed_update.compiled_window_update()
    constants: dict[object, dict] = {}
    for window in windows:
        active = [params[piece.position].grad is not None for piece in window.pieces]
        if not any(active):
            continue
        operands = packed_update.WindowOperands(window, params, states, active)
        owner, group_key = members[window.group].owner, members[window.group].group_key
        if group_key not in constants:  # once per group of hyperparameters
            constants[group_key] = _constants(members[window.group].hyperparameters)
        device = operands.packed["p"].device
        per_block = packed_update.block_vectors(window, members, states, active, device)
        packed = operands.packed
        stochastic = owner.bf16_stochastic_round and packed["p"].dtype == torch.bfloat16
        for t in [*packed.values(), *per_block]:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.profiler.record_function(packed_update.PROFILER_LABEL):  # counted by bench/gpu/giant_levers.py
            update(
                packed["p"], packed["g"], packed["m"], packed["v"], packed.get("m_scale"), packed.get("v_scale"),
                *_code_maps(device), *per_block, **constants[group_key], key=_key(window.key, device),
                stochastic=stochastic,
            )  # fmt: skip
        operands.write_back()
        # the next window's buffers are packed before `operands` would be rebound: without this, two windows'
        # packed copies are alive at once (measured: 3 MiB of the leanest ViT-B-32 setup's peak)
        del operands, packed, per_block


def _constants(group: dict) -> dict[str, torch.Tensor]:
    """A group's hyperparameters as float32 scalars (changing them recompiles nothing). 1 - beta is formed in
    float64 and rounded once, as torchao's Python-float lerp weight is."""
    beta1, beta2 = group["betas"]
    values = {"lr": float(group["lr"]), "one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2,
              "weight_decay": group["weight_decay"], "eps": group["eps"]}  # fmt: skip
    return {name: torch.tensor(value, dtype=torch.float32) for name, value in values.items()}


@functools.cache
def _key(key: int, device: torch.device) -> torch.Tensor:
    """A shard's rounding key as an int64 tensor: a Python int would make dynamo recompile for each rank's key
    (and its code for a symbolic key did not compile on CPU: torch 2.14)."""
    return torch.tensor(key, dtype=torch.int64, device=device)


@functools.cache
def _code_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's signed and unsigned 8-bit code maps on `device`."""
    return tuple(torch.tensor(q, dtype=torch.float32, device=device) for q in (get_qmap_signed(), get_qmap_unsigned()))


class AdamWStochasticBF16(_LocalUpdate, _TorchaoAdamW):
    """AdamW whose update is computed in float32 and rounded stochastically into bf16 weights (--precision
    pure_bf16 with --opt adamw); its moments are kept in the weights' dtype, as torch's AdamW keeps them."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bf16_stochastic_round=True)
        self._float_rates()


class AdamW8bit(_LocalUpdate, _TorchaoAdamW8bit):
    """torchao's AdamW8bit (decoupled weight decay, bias-corrected moments as torch.optim.AdamW) with float
    learning rates in param_groups and float32 moments in its state_dict (see the module docstring)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0, **kw):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)
        self._float_rates()

    @staticmethod
    def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int):
        # Quantized moments that read as float32 whatever the weights are (torchao gives them the weights'
        # dtype): the update computes in float32 anyway, and with bf16 weights under FSDP2 torchao's bf16-looking
        # state stopped its compiled update ("OptimState8bit ... unimplemented operator aten.view.dtype").
        return OptimState8bit.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state"] = {
            index: {k: (_dequantized(v) if k in MOMENTS else v) for k, v in per_param.items()}
            for index, per_param in sd["state"].items()
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's load casts floating state to each parameter's dtype (bf16 weights: bf16 moments), which would
        # lose the float32 values' exactness: the quantized moments are made from the values as given.
        given_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        given = [state_dict["state"].get(i, {}) for i in given_ids]
        super().load_state_dict(state_dict)
        self._float_rates()
        params = [p for group in self.param_groups for p in group["params"]]
        for p, saved in zip(params, given, strict=True):
            state = self.state.get(p)
            for key in MOMENTS:
                if state and key in saved and not is_quantized(state[key]):
                    fresh = self._new_buffer(p, SIGNED[key])
                    if is_quantized(fresh):  # a tensor the optimizer quantizes: quantize the loaded values
                        quantize_exactly_(local_shard(fresh), local_shard(saved[key]))
                        state[key] = fresh
