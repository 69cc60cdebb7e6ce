"""CLIP: a vision tower and a text tower projected into one embedding space."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bigclip.model.convert import plan_bigclip_to_openclip
from bigclip.model.layer_groups import depths
from bigclip.model.towers import text_tower, vision_tower
from bigclip.model.weights import WeightsFile, load_pretrained, plan_for

# OpenAI CLIP's initial temperature (1/0.07); loss families may start elsewhere (SigLIP: log 10, bias -10).
DEFAULT_INIT_LOGIT_SCALE = math.log(1 / 0.07)
MAX_LOGIT_SCALE = math.log(100.0)

__all__ = ["CLIP", "vision_tower"]


class CLIP(nn.Module):
    # Whether OpenCLIP keeps this architecture's text tower under `text.` (CustomTextCLIP): its export layout.
    # create_model sets it from the config (registry.openclip_separate_text).
    openclip_separate_text: bool = False

    def __init__(
        self,
        embed_dim: int,
        vision_cfg: dict,
        text_cfg: dict,
        *,
        quick_gelu: bool = False,
        init_logit_scale: float = DEFAULT_INIT_LOGIT_SCALE,
        init_logit_bias: float | None = None,
        image_size: int | tuple[int, int] | None = None,
    ):
        """init_logit_scale / init_logit_bias (OpenCLIP's names): where the learned temperature starts, and
        whether there is a learned logit bias (the loss family decides: SigLIP's has one). image_size: forced
        image size (--force-image-size), else the vision_cfg's."""
        super().__init__()
        self.embed_dim = embed_dim
        self.visual = vision_tower(embed_dim, vision_cfg, quick_gelu=quick_gelu, image_size=image_size)
        self.text = text_tower(embed_dim, text_cfg, quick_gelu=quick_gelu)
        # Shape (1,), not 0-d: sharding engines split parameters along dim 0.
        self.init_logit_scale, self.init_logit_bias = init_logit_scale, init_logit_bias
        self.logit_scale = nn.Parameter(torch.empty(1))
        self.logit_bias = nn.Parameter(torch.empty(1)) if init_logit_bias is not None else None
        # Pretrained weights `init_weights()` loads instead of a random init (see init_from).
        self.pretrained_path: str | None = None

    def init_from(self, path: str) -> None:
        """Make `init_weights()` load the pretrained weights at `path` rather than draw random ones.

        For a model built on the meta device and initialised later, possibly shard by shard: the file is
        checked against the model now (names and shapes, nothing read), and streamed in by `init_weights()`."""
        plan_for(self, WeightsFile(path))
        self.pretrained_path = str(path)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place, on whatever device the model sits.

        Engines build large models on the meta device, move them with `to_empty()` and then
        call this; nothing here depends on how the model was constructed. Parameters may be
        sharded (DTensors): a pretrained file (`init_from`) is then read into each rank's shards.
        """
        if self.pretrained_path is not None:
            load_pretrained(self, self.pretrained_path)
            return
        self.visual.init_weights()
        self.text.init_weights()
        self.logit_scale.fill_(self.init_logit_scale)
        if self.logit_bias is not None:
            self.logit_bias.fill_(self.init_logit_bias)

    def buffers_set_by_init(self) -> set[str]:
        """The buffers `init_weights()` fills (after a meta build they hold garbage until then): a timm image
        tower's (its trunk's), a Hugging Face text tower's (its position ids); bigclip's own towers hold none."""
        return {
            f"{prefix}.{name}"
            for prefix, tower in (("visual", self.visual), ("text", self.text))
            for name in getattr(tower, "buffers_set_by_init", set)()
        }

    def reset_buffers(self) -> None:
        """Restore the buffers no weights file holds (after to_empty()), in the towers that have some."""
        for tower in (self.visual, self.text):
            getattr(tower, "reset_buffers", lambda: None)()

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.visual(images)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.text(tokens)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, images: torch.Tensor | None = None, texts: torch.Tensor | None = None) -> dict:
        out = {
            "image_features": None if images is None else self.encode_image(images, normalize=True),
            "text_features": None if texts is None else self.encode_text(texts, normalize=True),
            "logit_scale": self.logit_scale.exp(),
        }
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out

    @torch.no_grad()
    def clamp_logit_scale_(self, max_scale: float = 100.0) -> None:
        """Keep the learned temperature in [1, max_scale] (call after each optimizer step)."""
        self.logit_scale.clamp_(0, math.log(max_scale))

    def parameter_constraints(self) -> list[tuple[nn.Parameter, Callable[[torch.Tensor], object]]]:
        """What must hold for parameters after every optimizer step, as (parameter, in-place elementwise fix).

        CLIP clamps its temperature so the logits never exceed 100x the cosine similarity (OpenCLIP does the
        same). The fix is elementwise so it can be applied to any copy or shard of the parameter: the loop
        hands it to the engine, which applies it to the copy its optimizer updates (an fp32 master under
        DeepSpeed) as well as to the weights the forward sees."""
        return [(self.logit_scale, _clamp_to_max_logit_scale)]

    def set_grad_checkpointing(self, enable: bool = True, every: int = 1) -> None:
        """Recompute every `every`-th transformer block of both towers in backward."""
        if enable and every < 1:
            raise ValueError(f"grad checkpointing interval must be >= 1, got {every}")
        interval = every if enable else 0
        self.visual.set_grad_checkpointing(interval)
        self.text.set_grad_checkpointing(interval)

    def transformer_blocks(self) -> list[nn.Module]:
        """Every transformer block of both towers: the units engines shard and checkpoint."""
        return [*self.visual.blocks, *self.text.blocks]

    def layer_depths(self, pooler_in_head: bool = True) -> dict[str, dict[int, int]]:
        """By the tower its flags name (image, text): id(parameter) -> the depth of its layer group below the
        tower's head (model/layer_groups.py), what layer-wise lr decay scales by. pooler_in_head=False: a Hugging
        Face text tower's pooler layer is a group of its own (--text-pooler-own-group)."""
        return {"image": depths(self.visual.layer_groups()), "text": depths(self.text.layer_groups(pooler_in_head))}

    def no_weight_decay(self) -> set[str]:
        """Parameters never decayed although their shape would be (timm's convention), as state-dict names."""
        spared = getattr(self.visual, "no_weight_decay", set)()
        return {f"visual.{name}" for name in spared}

    def openclip_names(self) -> dict[str, str]:
        """Each parameter's name in OpenCLIP's layout of this architecture (what OpenCLIP users' name patterns
        match), where it differs from bigclip's; none for a tower kind OpenCLIP does not have."""
        names = [name for name, _ in self.named_parameters()]
        try:
            plan = plan_bigclip_to_openclip(names, self.openclip_separate_text)
        except KeyError:  # a vision tower without an OpenCLIP layout
            return {}
        ours = set(names)
        return {source: target for target, (sources, _) in plan.items() for source in sources if source in ours}

    def lock_image_tower(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        self.visual.lock(unlocked_groups, freeze_bn_stats)

    def lock_text_tower(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
        self.text.lock(unlocked_layers, freeze_layer_norm)


def _clamp_to_max_logit_scale(t: torch.Tensor) -> None:
    t.clamp_(0, MAX_LOGIT_SCALE)
