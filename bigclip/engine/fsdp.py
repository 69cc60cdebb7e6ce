"""FSDP2 engine: torch.distributed.fsdp.fully_shard, every transformer block a unit, then the root.

Each rank keeps 1/N of every parameter, gradient and optimizer state (DTensors sharded along dim 0) and
all-gathers one block's parameters just before the block runs; gradients are reduce-scattered after it.

Applied in this order (the engine half of engine/__init__.py's list):
    cast        --precision bf16/fp16 store the weights in that dtype (as DDP does)
    shard       fully_shard(block) for every block of both towers, then fully_shard(model) for the rest
                (embeddings, projections, logit scale: parameters of shape (1,) shard fine, 0-d ones don't)
    materialise a model built on meta gets its local shards allocated and initialised (sharded_init.py)

--precision maps onto MixedPrecisionPolicy: amp / amp_bf16 all-gather parameters in bf16 (fp16 for amp
on GPU) and reduce gradients in fp32; weights and optimizer state stay fp32. The loop's autocast context
is kept as well, so ops outside the blocks (loss, pooling) run exactly as under DDP.

--fsdp-hybrid (or --fsdp-replicate-degree R) shards within groups of world/R ranks and replicates across
the R groups (HSDP): all-gathers stay inside a node, only one all-reduce of gradient shards crosses nodes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from bigclip.dist import World
from bigclip.engine.base import TorchOptimizerEngine
from bigclip.engine.config import EngineConfig
from bigclip.engine.ema import update_scratch_bytes as ema_update_bytes
from bigclip.engine.memory import tensor_bytes
from bigclip.engine.sharded_init import build_for_sharding, is_meta, materialise, wants_sharded_init
from bigclip.engine.single import ensure_process_group
from bigclip.errors import UserError
from bigclip.flag_fields import DIST, flag
from bigclip.memory import MemorySetup, ModelSize, StateRecipe, WorkingBytes


@dataclass(frozen=True)
class FSDPFlags:
    fsdp: bool = flag(False, "Use the FSDP2 engine (OpenCLIP main's spelling of --engine fsdp).", DIST)
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


def replicate_degree(cfg: EngineConfig, world: World) -> int:
    """How many replica groups HSDP keeps (1: plain sharding over every rank); --fsdp-hybrid: one per node."""
    if cfg.engine_flags.fsdp_hybrid:
        return max(1, world.world_size // max(1, world.local_world_size))
    return cfg.engine_flags.fsdp_replicate_degree or 1


def build_mesh(cfg: EngineConfig, world: World):
    replicate = replicate_degree(cfg, world)
    if world.world_size % replicate:
        raise UserError(f"--fsdp-replicate-degree {replicate}: must divide the world size {world.world_size}")
    device_type = world.device.type
    if replicate == 1:
        return init_device_mesh(device_type, (world.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (replicate, world.world_size // replicate), mesh_dim_names=("replicate", "shard")
    )


def mixed_precision_policy(precision):
    if precision.autocast_dtype is None:  # fp32, or pure bf16/fp16 weights: compute in the stored dtype
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)


def shard_frozen(
    module: nn.Module,
    mesh,
    device: torch.device,
    seed: int,
    rank: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    dtype: torch.dtype | None = None,
    offload: OffloadPolicy | None = None,
) -> nn.Module:
    """A forward-only module (a distillation teacher) sharded like FSDP2's model: fully_shard per block, then the
    root, every unit resharded after its forward (no backward follows); a meta module gets its weights shard by
    shard (a pretrained file streams only the local rows), so no rank holds it whole; stored in `dtype` if
    given. Eval mode, no gradients."""
    module.requires_grad_(False)
    on_meta = is_meta(module)
    if not on_meta:
        module.to(device=device)
    kwargs = dict(
        mesh=mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload or OffloadPolicy(),
        reshard_after_forward=True,
    )
    for block in module.transformer_blocks():
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    if on_meta:
        materialise(module, device, seed, rank)
    if dtype is not None:
        module.to(dtype=dtype)
    return module.eval()


class FSDPEngine(TorchOptimizerEngine):
    name = "fsdp"
    help = "FSDP2: parameters, gradients and optimizer state sharded across ranks, one unit per block"
    replicated_state = False  # each rank holds and saves its own shards
    selected_by = ("fsdp",)  # OpenCLIP main's launch lines say --fsdp

    Flags = FSDPFlags

    @classmethod
    def check_config(cls, cfg: EngineConfig) -> None:
        degree = cfg.engine_flags.fsdp_replicate_degree
        if not isinstance(degree, int) or degree < 1:
            raise UserError(f"--fsdp-replicate-degree {degree!r}: must be a positive integer")
        if cfg.engine_flags.fsdp_hybrid and degree != 1:
            # --fsdp-hybrid sets the degree itself (one replica per node)
            raise UserError(
                f"--fsdp-replicate-degree {degree}: --fsdp-hybrid already replicates once per node; drop one of the two"
            )

    @classmethod
    def build_model(cls, cfg: EngineConfig, world: World, factory) -> nn.Module:
        return build_for_sharding(cfg, factory, shards_params=True)

    @classmethod
    def state_ranks(cls, cfg: EngineConfig, world: World) -> int:
        return world.world_size // replicate_degree(cfg, world)  # HSDP: each replica group holds one copy

    @classmethod
    def frozen_bytes(cls, cfg: EngineConfig, world: World, num_params: int) -> float:
        return super().frozen_bytes(cfg, world, num_params) / world.world_size  # sharded like the model

    @classmethod
    def memory_setups(cls) -> dict[str, MemorySetup]:
        def fsdp(psi: int, n: int, recipe: StateRecipe, size: ModelSize | None) -> float:
            state = recipe.per_param * psi / n  # shards of weights, gradients and optimizer state
            if size is not None:
                # all-gathered weights (amp: MixedPrecisionPolicy gathers in bf16): two blocks in flight, and the
                # root stays gathered
                gathered = 2 if recipe.mixed else recipe.weight_bytes
                state += gathered * (2 * size.block_params + size.root_params)
            if recipe.in_backward and size is not None:  # one block's gradient shards until they are stepped
                state += recipe.weight_bytes * size.block_params / n
            return state

        def locked(frozen: int, n: int, recipe: StateRecipe) -> float:
            return recipe.weight_bytes * frozen / n  # locked towers are sharded like the rest of the model

        return {
            cls.name: MemorySetup(
                fsdp,
                cls._working,
                flags={"engine": cls.name},
                locked_weights=locked,
                replicas_flag="fsdp_replicate_degree",
            )
        }

    @classmethod
    def memory_notes(cls) -> list[str]:
        return [
            f"{cls.name}'s HSDP row keeps the state sharded within each group of GPUs (a node) and replicated across "
            "the groups: --fsdp-hybrid on nodes of that many GPUs, or --fsdp-replicate-degree with the number of "
            "groups; each GPU holds the state of a run on one group, and the gradients' all-reduce across groups "
            "moves 1/group of them per GPU."
        ]

    @staticmethod
    def _working(psi: int, n: int, recipe: StateRecipe, size: ModelSize, device_type: str) -> WorkingBytes:
        # the 16-bit all-gathers are in the state (above); each rank steps its own shards
        step = recipe.step_scratch_bytes(psi / n, size.largest_tensor / n, device_type, size.unit_params / n)
        # the largest tensor's unsharded gradient and its reduce-scattered shard; the text tower's gradient shards
        text_end = recipe.weight_bytes * size.largest_tensor * (1 + 1 / n)
        # --accum-freq: the shards accumulate from the first micro-batch on (no_sync), so the last micro-batch's
        # backward starts with all of them, as where gradients persist between steps
        accumulating = recipe.accum_freq > 1
        if not accumulating:
            text_end += recipe.grad_bytes * size.text_params / n
        ema = ema_update_bytes(recipe.weight_bytes, psi / n, size.largest_tensor / n) if recipe.ema else 0
        return WorkingBytes(step=step, gradients_persist=accumulating, text_end=text_end, ema_update=ema)

    @classmethod
    def describe_plan(cls, cfg: EngineConfig, world: World, num_params: int) -> tuple[str, str]:
        replicas = replicate_degree(cfg, world)
        layout = f"sharded over {world.world_size} rank(s)"
        if replicas > 1:
            layout = f"HSDP: {replicas} replicas, each sharded over {world.world_size // replicas} rank(s)"
        init = "on meta, initialised shard by shard" if wants_sharded_init(cfg, num_params) else "whole, then sharded"
        extra = ", shards offloaded to host memory" if cfg.engine_flags.fsdp_offload_cpu else ""
        if cfg.optimizer_in_backward:
            extra += ", each shard stepped after its reduce-scatter (no gradients kept)"
        return cls.name, f"fsdp2: fully_shard per transformer block, then the root; {layout}; model built {init}{extra}"

    def __init__(self, cfg: EngineConfig, model: nn.Module, world: World):
        super().__init__(cfg, model, world)

        ensure_process_group(world)
        self.mesh = build_mesh(cfg, world)
        on_meta = is_meta(model)
        if not on_meta:
            model.to(device=world.device)
        if self.precision.autocast_dtype is None and self.precision.param_dtype != torch.float32:
            model.to(dtype=self.precision.param_dtype)

        kwargs = dict(
            mesh=self.mesh, mp_policy=mixed_precision_policy(self.precision), offload_policy=self._offload_policy()
        )
        reshard = not cfg.engine_flags.fsdp_no_reshard_after_forward
        for block in model.transformer_blocks():
            fully_shard(block, reshard_after_forward=reshard, **kwargs)
        # The root's parameters (embeddings, projections, logit scale) are needed again right at the start of
        # backward, so resharding them after forward would only add an all-gather.
        fully_shard(model, reshard_after_forward=False, **kwargs)
        if on_meta:
            materialise(
                model,
                world.device if not cfg.engine_flags.fsdp_offload_cpu else torch.device("cpu"),
                cfg.seed,
                self.mesh.get_local_rank("shard"),
            )

        self.model = self.module = model  # FSDP2 shards the model in place: no wrapper
        # --optimizer-in-backward: FSDP2 runs a shard's hooks after its reduce-scatter; the shards of a gradient
        # are summed over the shard group for the norm.
        self._build_optimizer(model, norm_group=self.mesh.get_group("shard"))
        self.scaler = None
        if self.precision.loss_scaling:
            # Shards overflow independently; the sharded scaler agrees on "found inf" across ranks.
            self.scaler = ShardedGradScaler(world.device.type)

    def _offload_policy(self) -> OffloadPolicy:
        if self.cfg.engine_flags.fsdp_offload_cpu:
            # Pinned host memory needs CUDA; on a CPU-only run the shards already live in host memory.
            return CPUOffloadPolicy(pin_memory=self.world.device.type == "cuda")
        return OffloadPolicy()

    def frozen(self, module: nn.Module) -> nn.Module:
        # Sharded over the ranks that shard the model; in host memory with --fsdp-offload-cpu.
        device = self.world.device if not self.cfg.engine_flags.fsdp_offload_cpu else torch.device("cpu")
        stored = self.precision.param_dtype if self.precision.autocast_dtype is None else None  # as the model's
        return shard_frozen(
            module,
            self.mesh,
            device,
            self.cfg.seed,
            self.mesh.get_local_rank("shard"),
            mixed_precision_policy(self.precision),
            stored if stored != torch.float32 else None,
            self._offload_policy(),
        )

    # -- accumulation: reduce-scatter every micro-batch, so gradients accumulate in their shards
    @contextlib.contextmanager
    def no_sync(self):
        """Each micro-batch's backward reduce-scatters as the last one does, and the shards accumulate: what FSDP2
        keeps per rank stays 1/N of the gradients. Skipping the reduce-scatter (set_requires_gradient_sync(False),
        DDP's no_sync) would keep every block's unsharded gradient on every rank across the micro-batches (in
        float32 under amp: measured, ViT-B-32 --accum-freq 2 peaked 490 MiB above the sharded plan; ViT-bigG-14's
        would be 10 GB) for one collective less per micro-batch. Under HSDP only the replicas' all-reduce waits for
        the last micro-batch, which FSDP2 adds to the shards reduce-scattered before it."""
        if self.mesh.ndim > 1:
            self.model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.model.set_requires_all_reduce(True)

    def state_bytes(self) -> dict[str, int]:
        self._release_gathered()  # the root stays gathered after forward; count the shards only
        return tensor_bytes(self.model, self.optimizer)

    def _release_gathered(self) -> None:
        """Reshard every unit: the root stays gathered after a forward without a backward (an evaluation's), and
        meanwhile the registered parameters are the gathered ones and the next forward reuses their values."""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
