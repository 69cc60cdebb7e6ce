"""--optimizer-in-backward: each parameter's optimizer step runs inside the backward, as soon as its gradient is
final (synchronised across ranks), and the gradient is freed right after, so the full set of gradients never
exists: at most about one transformer block's gradients are alive at any moment (ViT-bigG-14: 5 GB of bf16
gradients, or 10 GB of fp32 ones, become a few hundred MB).

Each parameter has an optimizer of its own (as torch.distributed.optim's _apply_optimizer_in_backward and
torchtitan's optimizers-in-backward do), built by the --opt registry over a group of one parameter with its
group's hyperparameters; only optimizers whose update of a tensor reads nothing but that tensor's gradient and
state may be used this way (OptimizerKind.steps_per_parameter). DCP saves the list as one FQN-keyed optimizer
state, as it saves one optimizer.

Where the gradient is final, per engine:

- FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after its reduce-scatter (and HSDP's
  all-reduce across replicas): the hook steps the rank's shard.
- DDP: DistributedDataParallel's reducer keeps a flat bucket of every gradient for the whole run, which
  would keep the memory this exists to save, so the engine does not wrap the model in it. A parameter's hook
  starts an asynchronous all-reduce of its gradient (divided by the world size first, as DDP does); when the
  gradients in flight would exceed one block's bytes (less its largest tensor, so that with the gradient just
  produced they stay within one block), the ones in flight are awaited, stepped and freed; the last ones at the
  end of the backward.
- one process: the hook steps at once.

Optimizers that can step many tensors as one (the packed 8-bit / bf16-rounding AdamW, optim/packed_update.py)
are stepped a transformer block at a time (one process, FSDP2: when the block's last gradient is final; DDP:
the gradients awaited together), not one tensor at a time: a giant tower's ~1000 tensors become a few calls per
block. Their gradients are alive together anyway, so this keeps no more memory.

It is exactly the ordinary step (same arithmetic, tensor by tensor) where the ordinary step needs nothing
but each tensor's own gradient. The config refuses the rest in one line (check_config): --accum-freq > 1 (the
step would run after the first micro-batch), --grad-clip-norm (needs the global norm before any update), fp16
loss scaling (needs every gradient checked for overflow first), and optimizers that read other tensors. A step
whose gradients turn out non-finite (with a finite loss) cannot be skipped as the ordinary step skips it: its
tensors were already updated when the norm is known, so the run stops with one line at the end of that step,
before any checkpoint holds the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from bigclip import optim
from bigclip.dist import local_shard
from bigclip.engine.config import EngineConfig
from bigclip.errors import UserError
from bigclip.precision import resolve_precision

FLAG = "--optimizer-in-backward"


def check_config(cfg: EngineConfig) -> None:
    """The rules of --optimizer-in-backward that hold under every engine (DeepSpeed refuses it on its own)."""
    if not cfg.optimizer_in_backward:
        return
    if cfg.accum_freq > 1:
        raise UserError(
            f"{FLAG}: steps each parameter as soon as its gradient exists, so it cannot accumulate micro-batches "
            f"(--accum-freq {cfg.accum_freq}); use one or the other"
        )
    if cfg.grad_clip_norm is not None:
        raise UserError(
            f"{FLAG}: --grad-clip-norm needs the global gradient norm before any parameter is updated; "
            f"drop one of the two (the norm is still logged)"
        )
    if resolve_precision(cfg.precision, torch.device(cfg.device_type())).loss_scaling:
        raise UserError(
            f"{FLAG}: --precision {cfg.precision} scales the loss (fp16), which needs every gradient checked for "
            f"overflow before any update; use --precision amp_bf16, pure_bf16 or fp32"
        )
    if not optim.optimizer_kind(cfg.optimizer).steps_per_parameter:
        raise UserError(
            f"{FLAG}: --opt {cfg.optimizer.opt} is not known to update a tensor from its own gradient alone; "
            f"use --opt adamw, stableadamw or adamw8bit"
        )


class PerParameterOptimizers(torch.optim.Optimizer):
    """One optimizer per trainable parameter, each with its group's hyperparameters. Offers what the engine,
    checkpoints and memory accounting use of one optimizer.

    It is a torch Optimizer (without one's own param groups: they are its optimizers') so that DCP's
    get_state_dict / set_state_dict take it as one: handed an iterable of optimizers they walk every parameter of
    the model once per optimizer, O(parameters^2) in the loop's thread at every save (ViT-B-32's 302: 4 s on
    this CPU; ViT-bigG-14 has 974). Its state_dict() is torch's format over all its parameters, in order, each
    one's entry as its own optimizer gives it."""

    def __init__(self, cfg: optim.OptimizerConfig, groups: list[dict]):
        # torch.optim.Optimizer.__init__ is not called: it would make param groups and state of its own
        self.defaults: dict = {}
        self.by_param: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self.groups: list[tuple[dict, int]] = []  # (hyperparameters, number of parameters) of each group
        self._plans: dict = {}  # the window plans of optimizers stepped together (see step_together)
        index = 0
        for number, group in enumerate(groups):
            hyperparameters = {k: v for k, v in group.items() if k != "params"}
            self.groups.append((hyperparameters, len(group["params"])))
            for p in group["params"]:
                optimizer = optim.create_optimizer(cfg, [{**hyperparameters, "params": [p]}])
                optimizer.first_index = index  # rounding bits drawn as one optimizer over all would draw them
                optimizer.model_group = number  # packed with the group's other tensors when stepped together
                self.by_param[p] = optimizer
                index += 1

    # Checkpoints hold the optimizer state as one optimizer over the model's groups would (DCP's FQN-keyed form:
    # "state" by parameter name, "param_groups" with the names of their parameters), so a run resumes with or
    # without --optimizer-in-backward from a checkpoint written either way.
    def saved_state_dict(self, per_parameter: dict) -> dict:
        """DCP's state dict of the per-parameter optimizers (one group each, in creation order) -> the groups."""
        singles = iter(per_parameter["param_groups"])
        grouped = []
        for hyperparameters, size in self.groups:
            members = [next(singles) for _ in range(size)]
            # a member's values as saved (its lr as last set); an empty group keeps the model's hyperparameters
            values = dict(members[0]) if members else dict(hyperparameters)
            values["params"] = [name for member in members for name in member["params"]]
            grouped.append(values)
        return {"state": per_parameter["state"], "param_groups": grouped}

    @staticmethod
    def loadable_state_dict(grouped: dict) -> dict:
        """The groups' state dict -> one group per parameter, as set_state_dict expects for these optimizers."""
        singles = [{**group, "params": [name]} for group in grouped["param_groups"] for name in group["params"]]
        return {"state": grouped["state"], "param_groups": singles}

    def state_dict(self) -> dict:
        """torch's optimizer state dict over every parameter (index = position in param_groups' order)."""
        state, groups = {}, []
        for index, optimizer in enumerate(self):
            own = optimizer.state_dict()  # one parameter: index 0
            if 0 in own["state"]:
                state[index] = own["state"][0]
            (group,) = own["param_groups"]
            groups.append({**group, "params": [index]})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """state_dict() of the same parameters (its keys may be names, as DCP's set_state_dict hands them)."""
        for optimizer, group in zip(self, state_dict["param_groups"], strict=True):
            (key,) = group["params"]
            own = {key: state_dict["state"][key]} if key in state_dict["state"] else {}
            optimizer.load_state_dict({"state": own, "param_groups": [group]})

    def step(self, closure=None) -> None:
        """Every parameter's step (what DCP does to initialise a fresh optimizer's state before loading)."""
        for optimizer in self:
            optimizer.step()

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.by_param.values())

    def __len__(self) -> int:
        return len(self.by_param)

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self for p, s in optimizer.state.items()}

    def step_together(self, params: list[torch.Tensor]) -> None:
        """Step the optimizers of `params` (whose gradients are final) as one where their kind can (the packed
        8-bit / bf16-rounding AdamW: one compiled call per window of tensors instead of one per tensor), each
        on its own otherwise. The arithmetic is the same either way."""
        optimizers = [self.by_param[p] for p in params]
        together = getattr(type(optimizers[0]), "step_together", None)
        if together is not None and len(optimizers) > 1 and len({type(o) for o in optimizers}) == 1:
            together(optimizers, self._plans)
            return
        for optimizer in optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self:
            optimizer.zero_grad(set_to_none=set_to_none)


def in_flight_budget(model: nn.Module) -> int:
    """How many gradient bytes may wait for their all-reduce (DDP): the largest transformer block's trainable
    parameters less its largest tensor, so that those in flight and the one just produced never exceed one
    block's gradients."""
    budgets = []
    for block in model.transformer_blocks():
        sizes = [local_shard(p).numel() * p.element_size() for p in block.parameters() if p.requires_grad]
        budgets.append(sum(sizes) - max(sizes, default=0))
    return max(budgets, default=0)


class StepInBackward:
    """Post-accumulate-grad hooks that step each parameter's optimizer and free its gradient.

    `average_over`: the process group whose gradients are averaged here (DDP without its reducer; None when the
    gradient arrives final: one process, FSDP2). `norm_group`: the group whose ranks hold disjoint pieces of each
    gradient, over which the squared norms are summed (FSDP2's shard group; None when each rank holds whole
    gradients). `in_flight_bytes`: how many gradient bytes may wait for their all-reduce before they are stepped.
    """

    def __init__(
        self,
        optimizers: PerParameterOptimizers,
        device: torch.device,
        average_over=None,
        norm_group=None,
        in_flight_bytes: int = 0,
        units: list[list[torch.Tensor]] = (),
    ):
        self.optimizers = optimizers
        self.device = device
        self.average_over = average_over
        self.norm_group = norm_group
        self.in_flight_bytes = in_flight_bytes
        self._in_flight: list[tuple[torch.Tensor, object]] = []
        self._in_flight_total = 0
        self._square_sum: torch.Tensor | None = None
        # Units stepped together (the transformer blocks: FSDP2's units): a block's tensors are stepped in one
        # packed call when its last gradient is final. Their gradients are alive together anyway (FSDP2: the
        # unit's reduce-scatter output; one process: the block's backward), so this keeps no more memory.
        self._unit_of: dict[torch.Tensor, int] = {}
        self._unit_sizes: list[int] = []
        for members in units:
            members = [p for p in members if p in optimizers.by_param]
            for p in members:
                self._unit_of[p] = len(self._unit_sizes)
            self._unit_sizes.append(len(members))
        self._pending: dict[int, list[torch.Tensor]] = {}
        # Called once, right before the first update of the next backward (then cleared): what must happen before
        # any parameter or optimizer state changes (a save's copy of them), while the forward and the backward up
        # to the first final gradient run beside it. Cleared at the end of a backward that updated nothing.
        self.before_first_step: Callable[[], None] | None = None
        self.handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in optimizers.by_param]

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self.average_over is None:
            unit = self._unit_of.get(param)
            if unit is None:
                self._step([param])
                return
            pending = self._pending.setdefault(unit, [])
            pending.append(param)
            if len(pending) == self._unit_sizes[unit]:
                self._step(self._pending.pop(unit))
            return
        grad = param.grad
        size = grad.numel() * grad.element_size()
        if self._in_flight and self._in_flight_total + size > self.in_flight_bytes:
            self.finish_backward()
        grad.div_(dist.get_world_size(self.average_over))  # before the sum, as DDP does: no overflow
        work = dist.all_reduce(grad, group=self.average_over, async_op=True)
        self._in_flight.append((param, work))
        self._in_flight_total += size

    def finish_backward(self) -> None:
        """Await, step and free the gradients still in flight (the engine calls it after loss.backward()), and
        those of units some of whose tensors got no gradient this step."""
        for _param, work in self._in_flight:
            work.wait()
        if self._in_flight:  # at most one block's gradients: stepped together
            self._step([param for param, _work in self._in_flight])
        self._in_flight.clear()
        self._in_flight_total = 0
        for unit in list(self._pending):
            self._step(self._pending.pop(unit))
        self.before_first_step = None

    @torch.no_grad()
    def _step(self, params: list[torch.Tensor]) -> None:
        if self.before_first_step is not None:
            gate, self.before_first_step = self.before_first_step, None
            gate()
        for param in params:  # in arrival order, as they came: the norm sums alike however they are stepped
            grad = local_shard(param.grad)
            square = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            self._square_sum = square if self._square_sum is None else self._square_sum + square
        self.optimizers.step_together(params)
        for param in params:
            param.grad = None

    def take_norm(self) -> float:
        """The global gradient norm of the step that just ran in the backward (0.0 when nothing was stepped)."""
        total = self._square_sum if self._square_sum is not None else torch.zeros((), device=self.device)
        self._square_sum = None
        if self.norm_group is not None:
            dist.all_reduce(total, group=self.norm_group)
        return math.sqrt(float(total))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
