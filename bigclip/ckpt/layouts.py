"""Every checkpoint layout, by the name its manifests record: how a checkpoint is read without an engine."""

from __future__ import annotations

import torch

from bigclip.ckpt.dcp_layout import DCPLayout
from bigclip.ckpt.deepspeed_layout import DeepSpeedLayout
from bigclip.ckpt.layout import CheckpointLayout
from bigclip.errors import UserError

LAYOUTS: dict[str, type[CheckpointLayout]] = {layout.name: layout for layout in (DCPLayout, DeepSpeedLayout)}


def read_model_state(layout_name: str, directory: str, ema: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights (with `ema`: their moving average) of a verified checkpoint, in one process."""
    if layout_name not in LAYOUTS:
        raise UserError(
            f"checkpoint {directory}: its manifest names layout {layout_name!r}, which this bigclip does not "
            f"know ({', '.join(LAYOUTS)}); export it with the bigclip version that wrote it"
        )
    return LAYOUTS[layout_name].read_model_state(directory, ema=ema)
