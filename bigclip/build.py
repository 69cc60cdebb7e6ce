"""Building what a run trains with, from the typed slices of its config: the model (where the engine wants it
built, with the weights the flags name), its image transforms and tokenizer, the data, the loss and the engine.

`bigclip train` (train.py), `bigclip eval` (commands/eval.py) and the benchmarks in bench/ all build through here,
so a model or loader is made the same way everywhere.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
from torch import nn

from bigclip.config.sections import Sections, recheck_model
from bigclip.data import DataConfig, get_data, image_transform
from bigclip.data.aug_cfg import validate_aug_cfg
from bigclip.data.decode_choice import DecodeChoice, choose_image_decode, loading_cores
from bigclip.data.device_decode import device_decodes_jpegs
from bigclip.dist import World, raise_together
from bigclip.engine import EngineConfig, build_engine
from bigclip.engine import build_model as engine_build_model
from bigclip.loss import LossConfig, build_loss
from bigclip.model import create_model, get_model_config, get_tokenizer, preprocess_cfg
from bigclip.model.config import ModelConfig, check_model
from bigclip.model.fp8_linear import check_fp8_device
from bigclip.model.pretrained import model_weights, resolve_pretrained, resolve_pretrained_image, timm_model_name
from bigclip.model.registry import CONFIG_NAME, HF_HUB_PREFIX, check_hub_name, fetch_hub_config, is_schema_name
from bigclip.model.switchback import speed_note as int8_speed_note
from bigclip.model.tokenizer import variable_text_pad_id

logger = logging.getLogger("bigclip")

__all__ = [
    "build_data",
    "build_engine",  # engine/__init__.py's: parallelism applied in its documented order, then the engine
    "build_loss_fn",
    "build_model",
    "build_tokenizer",
    "build_transforms",
    "fetch_model_configs",
    "model_factory",
    "run_sections",
    "seed_everything",
    "training_normalize_at",
]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- model
def _hub_models(cfg: ModelConfig) -> list[str]:
    return [name for name in (cfg.model, cfg.distill_model) if name is not None and name.startswith(HF_HUB_PREFIX)]


def fetch_model_configs(cfg: ModelConfig, world: World) -> None:
    """The open_clip_config.json of an hf-hub: --model or --distill-model, fetched into the hub cache where the
    model is built (flag validation only reads that cache): by local rank 0 of each node while the others wait,
    then read from its cache by all; then the model flags' checks run on it on every rank (validation checked
    only the name's form of a config the cache lacked), before any weights are fetched. Collective."""
    names = _hub_models(cfg)
    if not names:
        return

    def fetch() -> None:
        for name in names:
            fetch_hub_config(check_hub_name(name), cfg.cache_dir)

    raise_together(world, fetch, runs_here=world.local_rank == 0)
    raise_together(world, lambda: check_model(cfg), runs_here=True)


def run_sections(sections: Sections, world: World) -> Sections:
    """A run's sections, its hf-hub: model configs fetched (fetch_model_configs) and what validation could not
    check or decide without them done now (config/sections.py's recheck_model: whether the model captions, so the
    loss adds a caption term). What a run builds from; the first thing it does after joining the world."""
    if not _hub_models(sections.model):
        return sections
    fetch_model_configs(sections.model, world)
    return raise_together(world, lambda: recheck_model(sections), runs_here=True)


def model_factory(cfg: ModelConfig, world: World):
    """create_model with the run's model flags bound; `factory(device="meta")` for sharding engines. An hf-hub:
    config is fetched and checked first (fetch_model_configs); the weights are resolved here, once per node; on
    meta they are checked now and streamed into each rank's shards later."""
    if cfg.use_fp8_linear is not None:
        check_fp8_device(world.device)  # also where sharding engines build on meta
    if cfg.use_bnb_linear is not None and (note := int8_speed_note(cfg.use_bnb_linear, world.device)):
        logger.info(note)
    fetch_model_configs(cfg, world)
    weights = pretrained_weights(cfg, world)
    image_weights = pretrained_image_weights(cfg, world, weights)

    def factory(**overrides):
        return create_model(
            cfg.model,
            image_size=cfg.image_size,
            context_length=cfg.force_context_length,
            patch_dropout=cfg.force_patch_dropout,
            quick_gelu=cfg.force_quick_gelu,
            custom_text=cfg.force_custom_text,
            layer_scale_init=cfg.layer_scale_init,
            int8_linear=cfg.use_bnb_linear,
            fp8_linear=cfg.use_fp8_linear,
            pretrained=weights,
            pretrained_image=image_weights or False,
            load_weights=False,  # a local-dir:/hf-hub: model's own weights are resolved here, once per node
            cache_dir=cfg.cache_dir,
            **cfg.init,  # where the loss family starts the logit scale (and bias)
            **overrides,
        )

    return factory


def build_model(cfg: ModelConfig, engine: EngineConfig, world: World, factory=None) -> nn.Module:
    """The model, built where the engine wants it: whole, or on meta for sharding engines to initialise shard by
    shard. `factory` replaces model_factory (tests and benchmarks build bare architectures)."""
    return engine_build_model(engine, world, factory or model_factory(cfg, world))


def build_teacher(cfg: ModelConfig, engine_cfg: EngineConfig, world: World, engine) -> nn.Module | None:
    """--distill-model with --distill-pretrained: the frozen teacher, built as OpenCLIP builds it (the
    architecture's defaults, none of the student's overrides), where the engine builds models (on meta for a
    large one under a sharding engine, its weights then streamed into each rank's shards) and placed by
    engine.frozen (FSDP2 / ZeRO-3: sharded). It is not part of the engine's model, so never saved or stepped."""
    if cfg.distill_model is None:
        return None
    teacher_cfg = ModelConfig(model=cfg.distill_model, pretrained=cfg.distill_pretrained, cache_dir=cfg.cache_dir)
    teacher = engine.frozen(engine_build_model(engine_cfg, world, model_factory(teacher_cfg, world)))
    logger.info(f"distillation: teacher {cfg.distill_model} with weights {cfg.distill_pretrained} (frozen, eval mode)")
    return teacher


def pretrained_weights(cfg: ModelConfig, world: World) -> str | None:
    """The local file of the whole model's weights: what --pretrained names, else the weights a local-dir: or
    hf-hub: --model brings (OpenCLIP loads them by default; --pretrained wins). Hub files are fetched once per
    node (local rank 0, which also checks their hash) while the other ranks wait; then every rank reads them
    from the cache."""
    if cfg.pretrained:
        raise_together(
            world,
            lambda: resolve_pretrained(cfg.model, cfg.pretrained, cfg.cache_dir),
            runs_here=world.local_rank == 0,
        )
        return resolve_pretrained(cfg.model, cfg.pretrained, cfg.cache_dir, local_files_only=True, verify=False)
    if not is_schema_name(cfg.model):
        return None
    raise_together(world, lambda: model_weights(cfg.model, cfg.cache_dir), runs_here=world.local_rank == 0)
    path = model_weights(cfg.model, cfg.cache_dir, local_files_only=True, verify=False)
    if path is None:
        logger.warning(f"--model {cfg.model}: no weights beside its {CONFIG_NAME}; starting from a random init")
    else:
        logger.info(f"--model {cfg.model}: weights from {path}")
    return path


def pretrained_image_weights(cfg: ModelConfig, world: World, clip_weights: str | None) -> str | None:
    """The local file of timm's pretrained trunk weights (--pretrained-image), fetched once per node like
    pretrained_weights; None when whole-model weights are loaded instead (as in OpenCLIP)."""
    if not cfg.pretrained_image:
        return None
    if clip_weights is not None:
        logger.info(f"--pretrained-image: timm's trunk weights are not loaded; {clip_weights} sets the whole model")
        return None
    timm_name = timm_model_name(cfg.model, cfg.cache_dir)
    raise_together(world, lambda: resolve_pretrained_image(timm_name, cfg.cache_dir), runs_here=world.local_rank == 0)
    path, repo = resolve_pretrained_image(timm_name, cfg.cache_dir, local_files_only=True, verify=False)
    logger.info(f"--pretrained-image: image tower trunk {timm_name} from timm's weights {repo} ({path})")
    return path


# ----------------------------------------------------------------------------------------------- data
def build_tokenizer(cfg: ModelConfig):
    return get_tokenizer(cfg.model, context_length=cfg.force_context_length, cache_dir=cfg.cache_dir)


def build_transforms(
    model: ModelConfig, data: DataConfig, normalize_at: str = "image", decode: DecodeChoice | None = None
):
    """(train transform, eval transform, geometry {'size', 'mean', 'std'}) for the model and the image flags.
    `normalize_at`: where reduced/device training images are normalised (data/pixels.py's NORMALIZE_AT): by the
    transform, into the loader's batch, or where the training loop moves the 8-bit batch (PixelBatch). `decode`:
    --image-decode as the run resolved it for its device (image_decode_choice); by default the flag's value, auto
    meaning reduced."""
    decode = decode or DecodeChoice(data.image_decode)
    pp = preprocess_cfg(model.model, model.image_size, cache_dir=model.cache_dir, pretrained=model.pretrained)
    mean = tuple(data.image_mean) if data.image_mean else pp["mean"]
    std = tuple(data.image_std) if data.image_std else pp["std"]
    mean, std = (mean * 3 if len(mean) == 1 else mean), (std * 3 if len(std) == 1 else std)
    interpolation = data.image_interpolation or pp["interpolation"]
    resize_mode = data.image_resize_mode or pp["resize_mode"]
    # OpenCLIP's training crop resamples bicubic whatever the model's interpolation (its image_transform passes
    # none to RandomResizedCrop; timm's transforms, use_timm, get it); bigclip does the same unless
    # --image-interpolation asks otherwise.
    uses_timm = bool(validate_aug_cfg(data.aug_cfg).get("use_timm"))
    train_interpolation = data.image_interpolation or (interpolation if uses_timm else "bicubic")
    preprocess_train = image_transform(
        pp["size"], True, mean, std, train_interpolation, resize_mode, data.aug_cfg, decode.mode, normalize_at,
        device_min_pixels=decode.min_pixels,
    )  # fmt: skip
    preprocess_val = image_transform(
        pp["size"], False, mean, std, interpolation, resize_mode, None, decode.mode, fill_color=pp["fill_color"],
        device_min_pixels=decode.min_pixels,
    )  # fmt: skip
    return preprocess_train, preprocess_val, {"size": pp["size"], "mean": mean, "std": std}


def training_normalize_at(device: torch.device) -> str:
    """Where a run on `device` normalises its reduced/device-decoded training images (build_transforms'
    `normalize_at`). On a GPU the batch crosses the loader's shared memory and the host-to-device copy in 8 bits (a
    quarter of the bytes) and is normalised there for free; on a CPU the workers normalise, into the batch they
    hand over, in parallel with the training step."""
    return "batch" if device.type == "cpu" else "device"


def image_decode_choice(data: DataConfig, world: World) -> DecodeChoice:
    """--image-decode for this rank's device and its share of the node's CPUs (auto: data/decode_choice.py)."""
    cores = loading_cores(data.workers, world.local_world_size)
    aug = validate_aug_cfg(data.aug_cfg)
    choice = choose_image_decode(data.image_decode, world.device.type, aug, cores)
    if data.image_decode == "auto" and choice.mode == "device" and not device_decodes_jpegs(world.device):
        logger.warning(f"--image-decode auto: torchvision cannot decode JPEGs on {world.device}; the workers decode")
        choice = choose_image_decode(data.image_decode, world.device.type, aug, cores, device_decodes=False)
    return choice


def build_data(model: ModelConfig, data: DataConfig, world: World, epoch: int):
    """(the run's loaders by name, the tokenizer) for this rank."""
    decode = image_decode_choice(data, world)
    if data.image_decode == "auto" and decode.mode == "device" and world.is_main:  # a CPU run's auto is reduced
        logger.info(f"--image-decode auto: {decode.describe()}")
    normalize_at = training_normalize_at(world.device)
    preprocess_train, preprocess_val, geometry = build_transforms(model, data, normalize_at, decode)
    tokenizer = build_tokenizer(model)
    model_cfg = get_model_config(model.model, model.cache_dir)
    loaders = get_data(
        data,
        preprocess_train,
        preprocess_val,
        tokenizer,
        rank=world.rank,
        world_size=world.world_size,
        epoch=epoch,
        preprocess_cfg=geometry,
        text_pad_id=variable_text_pad_id(model.model, model_cfg, tokenizer),
    )
    return loaders, tokenizer


# ----------------------------------------------------------------------------------------------- loss
def build_loss_fn(cfg: LossConfig, world: World) -> nn.Module:
    return build_loss(cfg, rank=world.rank, world_size=world.world_size)
