"""DeepSpeed engine: ZeRO stages 0-3, CPU offload, bf16 and fp16 with dynamic loss scaling.

DeepSpeed owns the optimizer, loss scaling, clipping and accumulation; this file maps them onto the
engine contract the loop speaks:

    loop                         DeepSpeed
    engine.module(...)           DeepSpeedEngine.forward (ZeRO-3 gathers each block's parameters in hooks)
    with engine.no_sync():       set_gradient_accumulation_boundary(False) for the micro-batches inside
    engine.backward(loss)        ds.backward(loss, scale_wrt_gas=False); ds.step() off the boundary
    engine.step()                ds.step() on the boundary: reduce, unscale, clip, optimizer step
    engine.set_lr(lr)            the lr of every param group of DeepSpeed's optimizer (bigclip's schedule)

Why scale_wrt_gas=False: with OpenCLIP's --accum-freq every micro-batch's loss is already the loss of the
whole accumulated batch (cached features of the other micro-batches stand in as negatives), and the
gradient of the big batch is the *sum* of the micro-batch gradients. DeepSpeed's default would divide by
the accumulation steps. gradient_accumulation_steps is still set to --accum-freq so DeepSpeed's
train_batch_size bookkeeping is right.

The optimizer: without an "optimizer" section in the JSON, bigclip's own torch optimizer (AdamW with its
no-decay groups, or --opt timm/...) is handed to DeepSpeed as the client optimizer: no FusedAdam/CPUAdam
JIT build. With one (ds_configs/zero3_offload.json), DeepSpeed builds its own (DeepSpeedCPUAdam when the
optimizer is offloaded) over bigclip's parameter groups.

Giant models (ZeRO-3, --sharded-init): built on meta, every parameter initialised as a DTensor shard by the
model's own init (sharded_init.py), then handed to DeepSpeed one module at a time: the module's
parameters are gathered whole (one module at a time) and partitioned by deepspeed.zero.Init(module=...).
No rank ever holds more than its shards plus one module's parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from bigclip import optim
from bigclip.ckpt.deepspeed_layout import DeepSpeedLayout
from bigclip.ckpt.layout import CheckpointLayout
from bigclip.dist import World
from bigclip.engine import deepspeed_memory
from bigclip.engine import ds_config as dsc
from bigclip.engine.base import Engine, clip_and_measure
from bigclip.engine.config import EngineConfig
from bigclip.engine.deepspeed_ema import PartitionEMA
from bigclip.engine.fsdp import shard_frozen
from bigclip.engine.memory import tensor_bytes
from bigclip.engine.sharded_init import (
    build_for_sharding,
    is_meta,
    materialise,
    modules_children_first,
    shard_meta_params,
    wants_sharded_init,
)
from bigclip.engine.single import ensure_process_group
from bigclip.errors import UserError
from bigclip.flag_fields import DIST, flag
from bigclip.memory import MemorySetup
from bigclip.optim import optimizer_kind


def _prepare_environment(world: World) -> None:
    # DeepSpeed picks its accelerator at first use; on a CPU run say so up front (silences its probe warning).
    if world.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _skip_inference_collectives()
    os.environ.setdefault("LOCAL_RANK", str(world.local_rank))  # zero.Init reads it
    ensure_process_group(world)


def _skip_inference_collectives() -> None:
    """On a CPU, DeepSpeed's comm layer JIT-compiles its shared-memory all-reduce (the deepspeed_shm_comm op) when it
    starts and maps a 66 MiB /dev/shm buffer per rank that it never removes. The op serves only
    `inference_all_reduce` (tensor-parallel inference layers), never a training step: it cost 25-40 s of compiling
    at a machine's first DeepSpeed launch and left the buffers in RAM until reboot. Marked incompatible for this
    process, DeepSpeed takes its own fallback (no op; torch.distributed's collectives)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def widest_tower(model: nn.Module) -> int | None:
    widths = [getattr(model.visual, "width", None), getattr(model.text, "width", None)]
    widths = [w for w in widths if w]
    return max(widths) if widths else None


def _inputs_cast_to(dtype: torch.dtype):
    """A forward pre-hook: floating-point inputs (images) in the dtype of DeepSpeed's bf16/fp16 weights. DeepSpeed
    leaves that cast to the caller and disables an outer torch.autocast inside its forward on CUDA (torch's
    is_autocast_enabled() reads CUDA's state), so without it a GPU run stops at the first convolution."""

    def cast_one(a):
        return a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a

    def cast(module: nn.Module, args: tuple, kwargs: dict):
        return tuple(cast_one(a) for a in args), {k: cast_one(v) for k, v in kwargs.items()}

    return cast


def _param_dtype(ds: dict[str, Any]) -> torch.dtype:
    if ds.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def _named_groups(model: nn.Module, cfg: optim.OptimizerConfig) -> list[tuple[list[str], dict[str, Any]]]:
    """bigclip's parameter groups (decay / no decay, layer-decay scales) as parameter names and the groups'
    settings (shapes and layer groups are only right before partitioning)."""
    ids = {id(p): n for n, p in model.named_parameters()}
    return [
        ([ids[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
        for g in optim.param_groups(model, cfg)
    ]


def partition_meta_model(model: nn.Module, ds: dict[str, Any], world: World, seed: int) -> None:
    """Initialise a meta model shard by shard and convert it to ZeRO-3 parameters, module by module."""
    import deepspeed

    mesh = init_device_mesh(world.device.type, (world.world_size,))
    shard_meta_params(model, mesh)
    materialise(model, world.device, seed, world.rank)
    dtype = _param_dtype(ds)
    for module in modules_children_first(model):
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        for name, p in own:
            full = p.full_tensor().to(dtype)  # this one parameter, whole, on every rank; its shard is dropped
            setattr(module, name, nn.Parameter(full, requires_grad=p.requires_grad))
        # Partitions exactly this module's (now whole) parameters; its children are ZeRO params already.
        deepspeed.zero.Init(module=module, config_dict_or_path=ds, dtype=dtype)


def mark_blocks_as_leaves(model: nn.Module) -> None:
    """ZeRO-3 gathers parameters in hooks on every submodule by default. Marking each transformer block a
    "leaf" gathers a whole block in one hook before it runs (FSDP2's unit too): fewer, larger all-gathers,
    and a per-block torch.compile traces no DeepSpeed hooks (with hooks inside, every change of a parameter's
    gathered/partitioned state failed a guard and recompiled the block on every call).

    Blocks that are only partly frozen (--lock-text keeps its LayerNorms trainable) stay per-submodule:
    DeepSpeed 0.19 releases a leaf's frozen weights before the backward that still needs them."""
    from deepspeed.utils import set_z3_leaf_module

    for block in model.transformer_blocks():
        if len({p.requires_grad for p in block.parameters()}) == 1:
            set_z3_leaf_module(block, True)


@dataclasses.dataclass(frozen=True)
class DeepSpeedFlags:
    ds_config: str | None = flag(
        None,
        "DeepSpeed JSON config (ds_configs/zero{1,2,3}.json, zero3_offload.json, zero3_nvme.json); "
        '"auto" values are filled from bigclip\'s flags. Selects --engine '
        "deepspeed.",
        DIST,
        aliases=["--ds_config", "--deepspeed_config", "--deepspeed-config"],
        metavar="FILE",
    )
    zero_nvme_path: str | None = flag(
        None,
        "Folder on a local NVMe drive where DeepSpeed ZeRO-Infinity swaps the parameters: fills "
        '"nvme_path": "auto" in --ds_config (ds_configs/zero3_nvme.json); new in bigclip.',
        DIST,
        metavar="DIR",
    )
    deepspeed: bool = flag(
        False, "Use the DeepSpeed engine (DeepSpeed's own flag; ZeRO-2 unless --ds_config says otherwise).", DIST
    )


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    help = "DeepSpeed ZeRO stages 0-3 and offload, as --ds_config says (ZeRO-2 without one)"
    selected_by = ("ds_config", "deepspeed")  # DeepSpeed's launch lines name a config, not an engine
    Flags = DeepSpeedFlags

    @classmethod
    def check_config(cls, cfg: EngineConfig) -> dict[str, Any] | None:
        """Read the --ds_config JSON once and fill what the flags decide; contradictions and bad JSON stop the
        run here, before any work. Returns the result for the engine to complete (EngineConfig.resolved)."""
        ds = dsc.resolve_flags(cfg, cfg.device_type())
        dsc.for_run(ds, cfg, None, None)  # nothing but world- and model-sized "auto" left
        stage = dsc.stage(ds)
        source = cfg.engine_flags.ds_config or "the default config"
        if cfg.sharded_init != "auto" and stage != 3:  # below stage 3 every rank builds the whole model
            raise UserError(
                f"--sharded-init {cfg.sharded_init}: DeepSpeed partitions parameters only at ZeRO stage 3, "
                f"and {source} has stage {stage}; drop the flag or use a stage 3 config"
            )
        if cfg.engine_flags.zero_nvme_path and not dsc.offloads_to_nvme(ds):
            raise UserError(
                f'--zero-nvme-path: only applies when the DeepSpeed config swaps to NVMe (offload_param.device "nvme", '
                f"as ds_configs/zero3_nvme.json), and {source} does not; drop the flag or use such a config"
            )
        if cfg.checkpoint_async == "process":
            raise UserError(
                "--checkpoint-async process: DeepSpeed writes its checkpoints itself, from a thread (DCP's writer "
                "process is DDP's and FSDP's); use thread or auto"
            )
        if cfg.optimizer.bf16_round_to_nearest:
            # the optimizer steps DeepSpeed's float32 master partitions; DeepSpeed copies them into its bf16 weights
            raise UserError(
                "--bf16-round-to-nearest: DeepSpeed keeps float32 master weights and rounds them into its bf16 copy "
                "itself; drop the flag"
            )
        mixed = [name for name in ("bf16", "fp16") if ds.get(name, {}).get("enabled")]
        if optimizer_kind(cfg.optimizer).per_tensor and (stage or mixed):
            # DeepSpeed hands its optimizer flat partitions of many tensors (ZeRO, and its bf16/fp16 wrappers),
            # so per-tensor statistics (StableAdamW's update clipping) would mix arbitrary slices together:
            # refused, not approximated.
            why = ", ".join(([f"ZeRO stage {stage}"] if stage else []) + mixed)
            raise UserError(
                f"--opt {cfg.optimizer.opt}: DeepSpeed ({why}) steps flattened partitions, not whole tensors, so the "
                f"per-tensor update clipping cannot be applied; use --engine fsdp (exact on shards) or ddp"
            )
        if cfg.optimizer_in_backward:
            # ZeRO's optimizer steps flat partitions after its own reduction of every gradient bucket; it has no
            # per-parameter step to run from a hook.
            raise UserError(
                "--optimizer-in-backward: DeepSpeed steps its flattened partitions after the whole backward; "
                "use --engine fsdp (steps each shard after its reduce-scatter) or --engine ddp"
            )
        if dsc.offloads_to_nvme(ds):
            _check_async_io(cfg.engine_flags.ds_config or "the default DeepSpeed config")
        if optimizer_kind(cfg.optimizer).quantized_state:
            # DeepSpeed keeps its own fp32 partitions and saves optimizer state with torch.save of plain tensors;
            # it has no 8-bit Adam of its own (its 1-bit Adam compresses communication, not state).
            raise UserError(
                f"--opt {cfg.optimizer.opt}: DeepSpeed cannot keep or checkpoint 8-bit optimizer state; "
                f"use --engine fsdp (each rank quantizes its own shard) or --engine ddp"
            )
        return ds

    @staticmethod
    def _flag_values(cfg: EngineConfig) -> dict[str, Any]:
        # An EngineConfig built by hand (not through the config's sections) has not been resolved yet.
        return cfg.resolved if cfg.resolved is not None else dsc.resolve_flags(cfg, cfg.device_type())

    @classmethod
    def frozen_bytes(cls, cfg: EngineConfig, world: World, num_params: int) -> float:
        ds = cls._flag_values(cfg)  # the weights' dtype DeepSpeed stores; sharded at ZeRO-3 only
        return num_params * _param_dtype(ds).itemsize / (world.world_size if dsc.stage(ds) == 3 else 1)

    @classmethod
    def describe_plan(cls, cfg: EngineConfig, world: World, num_params: int) -> tuple[str, str]:
        ds = cls._flag_values(cfg)
        stage = dsc.stage(ds)
        offload = [
            what
            for what, on in (("optimizer", dsc.offloads_optimizer(ds)), ("parameters", dsc.offloads_params(ds)))
            if on
        ]
        nvme = dsc.offloads_to_nvme(ds)
        setup = ("zero3_nvme" if nvme else "zero3_offload") if stage == 3 and offload else f"zero{stage}"
        source = cfg.engine_flags.ds_config or "the default config"
        line = f"deepspeed: ZeRO stage {stage} over {world.world_size} rank(s) ({source})"
        if offload:
            line += f", {' and '.join(offload)} offloaded to " + ("NVMe (ZeRO-Infinity)" if nvme else "host memory")
        if stage == 3:
            built = (
                "on meta, initialised shard by shard"
                if wants_sharded_init(cfg, num_params)
                else "whole, then partitioned"
            )
            line += f"; model built {built}"
        return setup, line

    @classmethod
    def memory_setups(cls) -> dict[str, MemorySetup]:
        return deepspeed_memory.memory_setups()

    @classmethod
    def memory_notes(cls) -> list[str]:
        return deepspeed_memory.MEMORY_NOTES

    @classmethod
    def build_model(cls, cfg: EngineConfig, world: World, factory) -> nn.Module:
        return build_for_sharding(cfg, factory, shards_params=dsc.stage(cls._flag_values(cfg)) == 3)

    def __init__(self, cfg: EngineConfig, model: nn.Module, world: World):
        super().__init__(cfg, model, world)
        _prepare_environment(world)
        import deepspeed

        # DeepSpeed's comm layer wraps the group bigclip opened (its config reads the world size from it).
        backend = world.backend or ("nccl" if world.device.type == "cuda" else "gloo")
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)

        self.ds_config = dsc.for_run(self._flag_values(cfg), cfg, world.world_size, widest_tower(model))
        self.stage = dsc.stage(self.ds_config)
        groups_by_name = _named_groups(model, cfg.optimizer)
        if is_meta(model):
            partition_meta_model(model, self.ds_config, world, cfg.seed)
        else:
            model.to(world.device)
        if self.stage == 3:
            mark_blocks_as_leaves(model)
        params = dict(model.named_parameters())
        groups = [{"params": [params[n] for n in names], **settings} for names, settings in groups_by_name]

        client_optimizer = None
        if "optimizer" not in self.ds_config:
            client_optimizer = optim.create_optimizer(cfg.optimizer, groups)
            if dsc.offloads_optimizer(self.ds_config):
                # A torch optimizer over offloaded fp32 partitions runs on the CPU, just slower than
                # DeepSpeedCPUAdam; DeepSpeed refuses it unless told this is intended.
                self.ds_config.setdefault("zero_force_ds_cpu_optimizer", False)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=client_optimizer,
            model_parameters=groups if client_optimizer is None else None,
            config=self.ds_config,
        )
        self.model, self.module = model, self.ds
        self._mixed = self.ds.bfloat16_enabled() or self.ds.fp16_enabled()
        self._in_no_sync = False
        self._autocast_dtype = _param_dtype(self.ds_config) if self._mixed else None
        if self._mixed:
            model.register_forward_pre_hook(_inputs_cast_to(self._autocast_dtype), with_kwargs=True)
        if cfg.ema_decay is not None:  # of each rank's fp32 master partition, never gathered for training
            self.ema = PartitionEMA(model, world, cfg.ema_decay, cfg.ema_warmup)

    # -- precision and accumulation
    def frozen(self, module: nn.Module) -> nn.Module:
        """A forward-only module (a distillation teacher) in the dtype DeepSpeed stores weights in: whole under
        ZeRO-0/1/2 (which replicate the weights), sharded under ZeRO-3 by FSDP2's fully_shard over the same ranks
        (it needs no optimizer, and ZeRO-3's parameter hooks belong to DeepSpeed's training engine)."""
        dtype = _param_dtype(self.ds_config)
        if self.stage != 3:
            return self._frozen_whole(module, dtype)
        mesh = init_device_mesh(self.world.device.type, (self.world.world_size,))
        return shard_frozen(module, mesh, self.world.device, self.cfg.seed, self.world.rank, dtype=dtype)

    def autocast(self):
        # DeepSpeed stores bf16/fp16 weights, and its forward turns an outer CUDA autocast off (unless its config
        # has a torch_autocast section): the inputs are cast by the model's pre-hook (_inputs_cast_to). Autocast
        # still covers what runs outside DeepSpeed's forward (the loss), as under DDP's amp.
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=self._autocast_dtype)

    @contextlib.contextmanager
    def no_sync(self):
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # -- optimisation
    def backward(self, loss: torch.Tensor) -> None:
        boundary = not self._in_no_sync
        self.ds.set_gradient_accumulation_boundary(boundary)
        self.ds.backward(loss, scale_wrt_gas=False)
        if not boundary:
            self.ds.step()  # off the boundary DeepSpeed only counts the micro-step

    def step(self) -> float:
        fallback = None
        if self.stage == 0 and not self._mixed:  # plain torch optimizer underneath: DeepSpeed keeps no norm
            fallback = clip_and_measure([p for p in self.model.parameters() if p.requires_grad], None)
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.step()
        applied = self.ds.was_step_applied()
        self._clear_stage3_gradient_partitions()
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            norm = fallback if fallback is not None else float("nan")
        norm = float(norm)
        if not applied:  # fp16 overflow: DeepSpeed skipped the update and lowered the loss scale
            return float("inf")
        return norm

    def _clear_stage3_gradient_partitions(self) -> None:
        """ZeRO-3 copies a parameter's gradient into its partition buffer in the first micro-batch of a step
        and adds it in later ones. A parameter whose first gradient of the step arrives in a later
        micro-batch (the logit scale: detached in all but the last micro-batch under --accum-freq) would be
        added onto the previous step's leftovers. Zeroing the buffer after each step makes add == copy."""
        buffer = getattr(self.ds.optimizer, "grad_partitions_flat_buffer", None) if self.stage == 3 else None
        if buffer is not None:
            buffer.zero_()

    @torch.no_grad()
    def update_parameter_(self, param: nn.Parameter, fix) -> None:
        """`fix` applied to the copy DeepSpeed updates (its fp32 master, or this rank's partition of it) as well
        as to the working copy; fixing only the working copy would be undone by the next step."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        if hasattr(param, "ds_id"):  # ZeRO-3: local partitions of the master and of the working copy
            local = safe_get_local_fp32_param(param) if param.requires_grad else None
            if local is not None and local.numel():
                fix(local)
                safe_set_local_fp32_param(param, local)
            fix(param.ds_tensor)
        else:  # ZeRO-1/2 with bf16/fp16: the fragment of the fp32 master this rank owns
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                fix(mapping.get_hp_fragment())
        if param.data.numel():
            fix(param.data)

    def zero_grad(self) -> None:
        self.ds.zero_grad()
        if hasattr(self.ds.optimizer, "zero_grad"):
            self.ds.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        optim.set_lr(self.ds.optimizer.param_groups, lr)

    def get_lr(self) -> float:
        return optim.base_lr(self.ds.optimizer.param_groups)

    # -- checkpoints and memory
    def checkpoint_layout(self, group, mode: str, participants=None) -> CheckpointLayout:
        # DeepSpeed writes from a thread whatever `mode` says; --checkpoint-async process is refused (check_config)
        return DeepSpeedLayout(self.ds, self.world, group, participants)

    def state_bytes(self) -> dict[str, int]:
        return tensor_bytes(self.model, self.ds.optimizer)


def _check_async_io(path: str) -> None:
    """ZeRO-Infinity reads and writes its swap files through DeepSpeed's async_io op, built (JIT, on first use)
    against libaio: without libaio's headers and library DeepSpeed would fail deep inside its first swap."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise UserError(
            f"{path}: offloads to NVMe, which needs DeepSpeed's async_io op and so libaio "
            f"(Debian/Ubuntu: apt-get install libaio-dev; RHEL: yum install libaio-devel)"
        )
