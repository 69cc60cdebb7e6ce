"""--pretrained FILE into a model: bigclip's or OpenCLIP's layout, checked whole, then streamed tensor by tensor.

The file is never loaded whole. Names and shapes come from its header (safetensors) or a memory map (torch
files); every check (missing, unexpected and mis-shaped entries) passes before the first tensor is copied.
Then each of the model's entries is read, converted (convert.py's plan), and copied into the parameter:

- a plain tensor takes the whole entry;
- a sharded parameter (a DTensor, as FSDP2 and bigclip's sharded init make them) takes only the rows its
  rank owns, so a rank of a model built on the meta device never holds more than its shards plus the one
  tensor being read: a ViT-bigG-14 can start from pretrained weights without any rank holding it whole.

safetensors files are reopened per tensor: a long-lived memory map keeps every page it has touched resident
(RSS would grow to the whole file), while a map closed after each tensor releases them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from timm.layers import resample_abs_pos_embed
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from bigclip.errors import UserError
from bigclip.model.convert import is_openclip_state_dict, plan_openclip_to_bigclip
from bigclip.model.rename import Plan, renamed

_POS_EMBED = "visual.trunk.pos_embed"


class WeightsFile:
    """The tensors of a .safetensors or torch-saved state dict, read one at a time.

    OpenCLIP training checkpoints ({"state_dict": {"module.…": …}}) are unwrapped. Torch files are memory
    mapped (zip format) so that only what is read becomes resident; older pickles are loaded whole."""

    def __init__(self, path: str | os.PathLike, flag: str = "--pretrained"):
        self.path = Path(path)
        self.flag = flag
        if not self.path.is_file():
            raise UserError(f"{flag} {self.path}: no such file; pass a local .pt, .bin or .safetensors state dict")
        self._torch: dict[str, torch.Tensor] | None = None
        try:
            if self.path.suffix == ".safetensors":
                with safe_open(str(self.path), framework="pt") as f:
                    self._shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            else:
                self._torch = self._load_torch()
                self._shapes = {k: tuple(v.shape) for k, v in self._torch.items()}
        except UserError:
            raise
        except Exception as err:  # torch and safetensors raise many different types here
            raise UserError(
                f"{flag} {self.path}: unreadable ({type(err).__name__}: {err}); pass a .pt or .safetensors state dict"
            ) from None
        self._prefix = "module." if self._shapes and all(k.startswith("module.") for k in self._shapes) else ""
        self.shapes = {k[len(self._prefix) :]: s for k, s in self._shapes.items()}

    def _load_torch(self) -> dict[str, torch.Tensor]:
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            state = torch.load(self.path, map_location="cpu", weights_only=True)  # a legacy (non-zip) pickle
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise UserError(f"{self.flag} {self.path}: not a state dict of tensors; pass a model state dict")
        return state

    def names(self) -> list[str]:
        return list(self.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._torch is not None:
            return self._torch[self._prefix + name]
        with safe_open(str(self.path), framework="pt") as f:  # closed right away: see the module docstring
            return f.get_tensor(self._prefix + name)

    def close(self) -> None:
        self._torch = None


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a weights file, in memory (small models, tests, tools)."""
    weights = WeightsFile(path)
    return {name: weights[name] for name in weights.names()}


def _sample(names, limit: int = 5) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _shape_after(rule, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    sources, fn = rule
    return tuple(fn(*(torch.empty(shapes[s], device="meta") for s in sources)).shape)


def _pos_embed_resampler(model: nn.Module, shape: tuple[int, ...]):
    """A square checkpoint grid of patch positions resampled (bicubic, as OpenCLIP does) to the model's grid
    (--force-image-size), or None when the entry is not that."""
    target = model.state_dict(keep_vars=True).get(_POS_EMBED)
    if target is None or len(shape) != 3 or shape[2] != target.shape[2] or shape == tuple(target.shape):
        return None
    old_grid = math.isqrt(shape[1] - 1)
    if old_grid * old_grid != shape[1] - 1:
        return None  # not a square grid: left to the shape check, which names the mismatch
    new_grid = list(model.visual.trunk.patch_embed.grid_size)

    def resample(pos: torch.Tensor) -> torch.Tensor:
        return resample_abs_pos_embed(pos.float(), new_grid, [old_grid, old_grid]).to(pos.dtype)

    return resample


def plan_for(model: nn.Module, weights: WeightsFile) -> Plan:
    """How each of the model's entries is made from the file, checked against the model's names and shapes
    before anything is read. UserError names the file and what does not match."""
    names = weights.names()
    if is_openclip_state_dict(names, weights.shapes.get("logit_scale")):
        try:
            plan = plan_openclip_to_bigclip(names)
        except KeyError as err:
            raise UserError(f"--pretrained {weights.path}: {err.args[0]}; is this a CLIP checkpoint?") from None
    else:
        plan = {name: renamed(name) for name in names}
    expected = model.state_dict(keep_vars=True)
    missing = expected.keys() - plan.keys()
    unexpected = plan.keys() - expected.keys()
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_sample(missing)}")
        if unexpected:
            parts.append(f"unexpected {_sample(unexpected)}")
        raise UserError(
            f"--pretrained {weights.path}: keys do not match the model ({'; '.join(parts)}); "
            "check that --model names the checkpoint's architecture"
        )
    mismatched = []
    for name, value in expected.items():
        shape = _shape_after(plan[name], weights.shapes)
        if shape == tuple(value.shape):
            continue
        resample = _pos_embed_resampler(model, shape) if name == _POS_EMBED else None
        if resample is not None:
            sources, fn = plan[name]
            plan[name] = (sources, lambda *tensors, fn=fn, resample=resample: resample(fn(*tensors)))
            continue
        mismatched.append(f"{name} {shape} vs model {tuple(value.shape)}")
    if mismatched:
        raise UserError(
            f"--pretrained {weights.path}: shape mismatch for {_sample(mismatched, 3)}; check --model, "
            "--force-image-size and --force-context-length against the checkpoint"
        )
    return plan


def _local_region(target: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(where to write, what to write): the rank's own block of a DTensor, or the whole of a plain tensor."""
    if not isinstance(target, DTensor):
        return target, full
    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    return target.to_local(), full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor `full` into `target`: all of it, or a DTensor's own block."""
    into, region = _local_region(target, full)
    into.copy_(region)


def _entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.state_dict(keep_vars=True).items()


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill every parameter and buffer of `model` from the file at `path` (see the module docstring).

    The model may be whole or sharded (DTensor parameters, already allocated); the one tolerated difference
    from the file is the image size, for which positional embeddings are resampled."""
    weights = WeightsFile(path)
    try:
        plan = plan_for(model, weights)
        for name, target in _entries(model):
            sources, fn = plan[name]
            full = fn(*(weights[s] for s in sources))
            into, region = _local_region(target, full)
            into.copy_(region)
            del full, region
    finally:
        weights.close()
    # buffers no file holds (non-persistent: a Hugging Face tower's position ids) are the model's to restore
    getattr(model, "reset_buffers", lambda: None)()
