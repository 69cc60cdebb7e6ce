"""timm vision towers: OpenCLIP's `TimmModel` (a timm trunk plus OpenCLIP's pooling/projection head).

An OpenCLIP architecture whose vision_cfg names `timm_model_name` (convnext_*, swin_*, vit_*_gap_*, …) builds
its image tower from timm. This module builds exactly what open_clip/timm_model.py builds, under the same
names (`visual.trunk.*`: the timm model; `visual.head.*`: OpenCLIP's head), so OpenCLIP's state dicts load
without conversion:

    timm_pool      the trunk's global pooling ('avg', '', …; '' keeps the model's default), or an attention
                   pool in the head ('abs_attn', 'rot_attn')
    timm_proj      'linear' (dropout + Linear), 'mlp' (timm Mlp, hidden 2 x embed_dim), 'none' (the trunk's
                   features as they are) or '' (the trunk's own classifier, sized embed_dim, projects)
    timm_proj_bias, timm_drop, timm_drop_path, patch_dropout (timm's patch_drop_rate, ViT-family trunks)

Initialisation is timm's and OpenCLIP's own: `init_weights()` builds a fresh tower on the CPU the way the
constructor did (timm's init of every parameter and buffer, BatchNorm statistics and position-index buffers
included; OpenCLIP's head as torch initialises it) and copies it in place, shard by shard when the parameters
are sharded DTensors. With `--pretrained-image` the fresh trunk is timm's pretrained one, loaded by timm
itself (its checkpoint filter, classifier removal and input-conv adaptation) from the file bigclip fetched.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import timm
import torch
from timm.layers import AttentionPool2d as AbsAttentionPool2d
from timm.layers import Mlp, RotAttentionPool2d, to_2tuple
from timm.models import group_modules, group_parameters, reparameterize_model
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchvision.ops.misc import FrozenBatchNorm2d

from bigclip.errors import UserError
from bigclip.model.layer_groups import LayerGroups
from bigclip.model.rename import Plan, TowerNames, renamed

PROJECTIONS = ("linear", "mlp", "none", "")
# OpenCLIP's CLIPVisionCfg fields that only its own ViT/ResNet towers read: accepted (OpenCLIP's configs may
# carry them) and ignored for a timm tower, as OpenCLIP does.
_NON_TIMM_FIELDS = frozenset(
    {
        "layers", "width", "head_width", "mlp_ratio", "patch_size", "ls_init_value", "attentional_pool",
        "attn_pooler_queries", "attn_pooler_heads", "no_ln_pre", "pos_embed_type", "final_ln_after_pool",
        "pool_type", "output_tokens", "act_kwargs", "norm_kwargs", "block_type", "qk_norm", "scaled_cosine_attn",
        "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc", "timm_model_pretrained",
    }
)  # fmt: skip


class TimmVisionTower(nn.Module):
    """OpenCLIP's TimmModel with bigclip's tower contract (see clip.vision_tower)."""

    def __init__(
        self,
        *,
        embed_dim: int,
        timm_model_name: str,
        image_size: int | tuple[int, int] = 224,
        timm_pool: str = "avg",
        timm_proj: str = "linear",
        timm_proj_bias: bool = False,
        timm_drop: float = 0.0,
        timm_drop_path: float | None = None,
        patch_dropout: float = 0.0,
        quick_gelu: bool = False,  # timm trunks keep their own activations, as in OpenCLIP
        **openclip_fields,
    ):
        super().__init__()
        unknown = sorted(set(openclip_fields) - _NON_TIMM_FIELDS)
        if unknown:
            raise UserError(f"vision_cfg of timm model {timm_model_name}: unknown key(s) {', '.join(unknown)}")
        if ":" not in timm_model_name and not timm.is_model(timm_model_name):  # timm resolves hf-hub: names itself
            raise UserError(
                f"vision_cfg timm_model_name {timm_model_name!r}: timm {timm.__version__} has no such model"
            )
        if timm_proj is None:
            timm_proj = ""  # OpenCLIP's EVA configs write null: falsy, as '' (the trunk's classifier projects)
        if timm_proj not in PROJECTIONS:
            raise UserError(f"vision_cfg timm_proj {timm_proj!r}: choose one of linear, mlp, none")
        self.model_name = timm_model_name
        self.embed_dim = embed_dim
        self.pool, self.proj, self.proj_bias, self.drop = timm_pool, timm_proj, timm_proj_bias, timm_drop
        # As OpenCLIP: only what is set reaches timm (not every timm model takes these keywords).
        self.timm_kwargs = {}
        if timm_drop_path is not None:
            self.timm_kwargs["drop_path_rate"] = timm_drop_path
        if patch_dropout > 0:
            self.timm_kwargs["patch_drop_rate"] = patch_dropout
        # OpenCLIP does not pass the image size to timm: the trunk keeps its native input size unless the size is
        # forced (set_input_size, after construction, as open_clip.create_model does).
        self.image_size = to_2tuple(image_size)
        self._input_size: tuple[int, int] | None = None
        self.trunk, self.head = self._build()
        self.width = self.trunk.num_features  # the widest activation the DeepSpeed engine sizes its buckets by
        self._block_names = _block_names(self.trunk)
        # timm weights (--pretrained-image) that init_weights() loads into the trunk instead of a random init.
        self.pretrained_file: str | None = None

    def _build(self, pretrained_file: str | None = None) -> tuple[nn.Module, nn.Sequential]:
        """Trunk and head exactly as OpenCLIP's TimmModel.__init__ makes them."""
        kwargs = dict(self.timm_kwargs)
        if pretrained_file is not None:
            # timm's own loading path (filter, classifier removal, input-conv adaptation), from this file.
            kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": pretrained_file})
        pool, proj, embed_dim = self.pool, self.proj, self.embed_dim
        custom_pool = pool in ("abs_attn", "rot_attn")
        feat_size = None
        if proj not in ("linear", "mlp") and not custom_pool:
            # No extra projection: the trunk's classifier projects (proj ''), or nothing does (proj 'none').
            trunk = timm.create_model(
                self.model_name, num_classes=0 if proj == "none" else embed_dim, global_pool=pool, **kwargs
            )
            prev_chs = embed_dim
        else:
            trunk = timm.create_model(self.model_name, **kwargs)
            feat_size = trunk.default_cfg.get("pool_size", None)
            if custom_pool:
                if not feat_size:
                    raise UserError(f"vision_cfg timm_pool {pool}: timm model {self.model_name} has no 2-d features")
                trunk.reset_classifier(0, global_pool="")
            else:
                trunk.reset_classifier(0, **(dict(global_pool=pool) if pool else {}))
            prev_chs = trunk.num_features
        head_layers: OrderedDict[str, nn.Module] = OrderedDict()
        if pool == "abs_attn":
            head_layers["pool"] = AbsAttentionPool2d(prev_chs, feat_size=feat_size, out_features=embed_dim)
            prev_chs = embed_dim
        elif pool == "rot_attn":
            head_layers["pool"] = RotAttentionPool2d(prev_chs, out_features=embed_dim)
            prev_chs = embed_dim
        if proj == "linear":
            head_layers["drop"] = nn.Dropout(self.drop)
            head_layers["proj"] = nn.Linear(prev_chs, embed_dim, bias=self.proj_bias)
        elif proj == "mlp":
            head_layers["mlp"] = Mlp(
                prev_chs, 2 * embed_dim, embed_dim, drop=(self.drop, 0), bias=(True, self.proj_bias)
            )
        if self._input_size is not None:
            trunk.set_input_size(self._input_size)
        return trunk, nn.Sequential(head_layers)

    def set_input_size(self, image_size: int | tuple[int, int]) -> None:
        """--force-image-size: timm's set_input_size on the trunk (ViT-family models resize their position
        embeddings); trunks without it (convolutional ones) take any size as they are, as in OpenCLIP."""
        self.image_size = to_2tuple(image_size)
        if hasattr(self.trunk, "set_input_size"):
            self._input_size = self.image_size
            self.trunk.set_input_size(self.image_size)

    @property
    def blocks(self) -> list[nn.Module]:
        """The trunk's blocks, from timm's own grouping of the model (group_matcher: ViT blocks.{i}, ConvNeXt
        stages.{i}.blocks.{j}, ResNet layer{i}.{j}, Swin layers.{i}.blocks.{j}, …): the units engines shard
        and compile. Downsampling layers, stems and heads stay with the root. Empty for a model timm does not
        group (the whole tower is then one unit)."""
        return [self.trunk.get_submodule(name) for name in self._block_names]

    @property
    def description(self) -> str:
        """What kind of tower this is, for messages ("ResNet", a timm model's name)."""
        return self.model_name

    def activation_shape(self) -> None:
        """Not a transformer: the memory plan's activation arithmetic does not describe this tower."""
        return None

    def set_grad_checkpointing(self, every: int) -> None:
        """timm's own activation checkpointing (OpenCLIP's TimmModel does the same): every trunk block is
        recomputed in backward for any `every` >= 1; timm's models offer no spacing, so `every` > 1 is not
        honoured for a timm trunk. 0 turns it off."""
        try:
            self.trunk.set_grad_checkpointing(every > 0)
        except (AssertionError, NotImplementedError, AttributeError):
            if every > 0:
                raise UserError(
                    f"--grad-checkpointing: timm model {self.model_name} does not support activation checkpointing"
                ) from None

    def use_pretrained(self, path: str) -> None:
        """Make init_weights() load timm's pretrained trunk weights from `path` (--pretrained-image)."""
        self.pretrained_file = str(path)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer in place: a fresh tower built on the CPU as the constructor
        builds it (timm's and OpenCLIP's init; timm's pretrained trunk with --pretrained-image), copied in."""
        with torch.device("cpu"):
            trunk, head = self._build(self.pretrained_file)
        for mine, fresh in ((self.trunk, trunk), (self.head, head)):
            source = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
            for name, target in [*mine.named_parameters(), *mine.named_buffers()]:
                _copy_into(target, source[name])

    def buffers_set_by_init(self) -> set[str]:
        """Every buffer: init_weights() copies them all from the fresh tower."""
        return {name for name, _ in self.named_buffers()}

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Restore the buffers no weights file holds (non-persistent: an EVA trunk's rotary tables, a Swin's
        position index) after to_empty() and a load: timm's own init_non_persistent_buffers() where the module
        has it, else the values of a fresh tower built on the CPU."""
        kept = set(self.state_dict())
        missing = {name for name, _ in self.named_buffers()} - kept
        for prefix, module in self.named_modules():
            init = getattr(module, "init_non_persistent_buffers", None)
            if init is not None:
                init()
                missing -= {f"{prefix}.{n}" if prefix else n for n, _ in module.named_buffers()}
        if missing:
            with torch.device("cpu"):
                trunk, head = self._build()
            fresh = {
                **{f"trunk.{n}": b for n, b in trunk.named_buffers()},
                **{f"head.{n}": b for n, b in head.named_buffers()},
            }
            for name, target in self.named_buffers():
                if name in missing:
                    _copy_into(target, fresh[name])

    def layer_groups(self) -> LayerGroups:
        """OpenCLIP's groups of its TimmModel (model/layer_groups.py): the trunk's groups by timm's own
        group_matcher (the partition timm's layer decay uses), then the adapter head when it has weights (else
        the trunk's top group is the head)."""
        by_layer = group_parameters(self.trunk, self.trunk.group_matcher())
        groups: LayerGroups = [
            (f"layer.{layer}", [self.trunk.get_parameter(name) for name in by_layer[layer]])
            for layer in sorted(by_layer)
        ]
        if next(self.head.parameters(), None) is not None:
            groups.append(("proj", [self.head]))
        return groups

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """OpenCLIP's TimmModel.lock: freeze the trunk (the head stays trainable) except its last
        `unlocked_groups` groups of timm's group_matcher; BatchNorm layers of frozen groups become
        FrozenBatchNorm2d when `freeze_bn_stats`."""
        if not unlocked_groups:
            for param in self.trunk.parameters():
                param.requires_grad = False
            if freeze_bn_stats:
                freeze_batch_norm_2d(self.trunk)
            return
        matcher = self.trunk.group_matcher()
        gparams = group_parameters(self.trunk, matcher)
        max_layer_id = max(gparams.keys()) - unlocked_groups
        for group_idx in range(max_layer_id + 1):
            for param in gparams[group_idx]:
                self.trunk.get_parameter(param).requires_grad = False
        if freeze_bn_stats:
            gmodules = group_modules(self.trunk, matcher, reverse=True)
            freeze_batch_norm_2d(self.trunk, {k for k, v in gmodules.items() if v <= max_layer_id})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(images))


def _block_names(trunk: nn.Module) -> list[str]:
    """Names of the submodules timm's fine-grained group_matcher makes a block of its own: the text a block
    rule (one whose group id comes from the name's numbers) matches at the start of a parameter name."""
    matcher = getattr(trunk, "group_matcher", None)
    if matcher is None:
        return []
    try:
        rules = matcher(coarse=False).get("blocks")
    except NotImplementedError:
        return []
    if rules is None:
        return []
    rules = [(rules, None)] if isinstance(rules, str) else list(rules)
    compiled = [(re.compile(pattern), fixed) for pattern, fixed in rules]
    modules = dict(trunk.named_modules())
    names: list[str] = []
    for param_name, _ in trunk.named_parameters():
        for pattern, fixed in compiled:
            match = pattern.match(param_name)
            if match is None:
                continue
            name = match.group(0).rstrip(".")
            if fixed is None and name in modules and name != param_name and name not in names:
                if not any(name.startswith(n + ".") or n.startswith(name + ".") for n in names):
                    names.append(name)
            break  # timm's grouping: the first rule that matches decides
    return names


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into `target`, or into the rows a sharded DTensor `target` holds here."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        target.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    else:
        target.copy_(full)


def freeze_batch_norm_2d(module: nn.Module, module_match: set[str] | None = None, name: str = "") -> nn.Module:
    """open_clip.utils.freeze_batch_norm_2d: BatchNorm2d / SyncBatchNorm layers (those named in `module_match`,
    or all) become torchvision's FrozenBatchNorm2d with the same statistics and affine parameters."""
    result = module
    is_match = name in module_match if module_match else True
    if is_match and isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm)):
        result = FrozenBatchNorm2d(module.num_features)
        result.num_features = module.num_features
        result.affine = module.affine
        if module.affine:
            result.weight.data = module.weight.data.clone().detach()
            result.bias.data = module.bias.data.clone().detach()
        result.running_mean.data = module.running_mean.data
        result.running_var.data = module.running_var.data
        result.eps = module.eps
    else:
        for child_name, child in module.named_children():
            full_name = f"{name}.{child_name}" if name else child_name
            new_child = freeze_batch_norm_2d(child, module_match, full_name)
            if new_child is not child:
                result.add_module(child_name, new_child)
    return result


# OpenCLIP's TimmModel and this tower share every name, so conversion is the identity. Detection: every visual
# entry lies under visual.trunk. or visual.head. (OpenCLIP's own ViT and ResNet towers name visual.conv1,
# visual.class_embedding, visual.layer1, …; bigclip's ViT tower keeps its projection at visual.proj).
_TIMM_PREFIXES = ("visual.trunk.", "visual.head.")


def _is_timm_tower(names: set[str]) -> bool:
    return bool(names) and all(name.startswith(_TIMM_PREFIXES) for name in names)


def _identity(names) -> Plan:
    return {name: renamed(name) for name in names}


TIMM_NAMES = TowerNames(
    kind="timm",
    is_openclip=_is_timm_tower,
    is_bigclip=_is_timm_tower,
    from_openclip=_identity,
    to_openclip=_identity,
)


# What timm's reparameterize_model looks for: a module that folds its training-time branches into one for inference
# (MobileOne/FastViT blocks, RepMixer, reparameterisable large-kernel convs: MobileCLIP's and MobileCLIP2's trunks).
_REPARAMETERIZERS = ("fuse", "reparameterize", "switch_to_deploy")


def reparameterizable(model: nn.Module) -> bool:
    """Whether any of `model`'s modules has branches that reparameterize_model would fold."""
    return any(hasattr(m, name) for m in model.modules() for name in _REPARAMETERIZERS)


def reparameterize(model: nn.Module) -> nn.Module:
    """`model` (whole, not sharded) in its inference form, changed in place: timm's reparameterize_model, what
    MobileCLIP's and MobileCLIP2's users apply to OpenCLIP's model before inference or export (its branches and their
    BatchNorms folded into one convolution each: other parameter names, the same function up to rounding).
    Training keeps the training form; `bigclip export --reparameterize` writes this one."""
    return reparameterize_model(model.eval(), inplace=True)
