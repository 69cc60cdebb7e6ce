"""`bigclip export CKPT OUT.pt|OUT.safetensors`: one consolidated model state dict from a checkpoint.

CKPT is a checkpoint directory or URL (…/checkpoints/<tag>) of any engine and any world size; it is verified
against its manifest first. The output holds the model weights only (no optimizer), in OpenCLIP's parameter
names by default, so `open_clip.create_model(..., pretrained=OUT)` or bigclip's --pretrained can load it.
--reparameterize writes a MobileCLIP/MobileCLIP2 model's inference form (its branches folded, the model built on
the CPU from the architecture the checkpoint records): what timm's reparameterize_model makes of OpenCLIP's model,
which loads into OpenCLIP's model reparameterized the same way.
One process, no GPUs, no process group: DCP checkpoints are read with their metadata, DeepSpeed checkpoints
with DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from bigclip.ckpt.layouts import read_model_state
from bigclip.ckpt.manifest import TRAIN_STATE
from bigclip.ckpt.storage import is_url, parse_storage_options, redact_url
from bigclip.ckpt.verify import fetch_verified, verify_local
from bigclip.commands import COMMANDS, Command
from bigclip.errors import OneLineErrorParser, UserError
from bigclip.model.convert import bigclip_to_openclip
from bigclip.model.factory import create_model
from bigclip.model.registry import HF_HUB_PREFIX, get_model_config, openclip_separate_text
from bigclip.model.timm_tower import reparameterizable, reparameterize


def _openclip_separate_text(directory: str) -> bool:
    """Whether OpenCLIP keeps the checkpoint's architecture's text tower under `text.` (registry's rule), from
    the config its train_state.json records; False (the names decide) where that config cannot be read."""
    try:
        with open(os.path.join(directory, TRAIN_STATE)) as f:
            config = json.load(f).get("config") or {}
        if config["model"].startswith(HF_HUB_PREFIX):
            return False  # reading its config could mean a download; export stays offline
        model_cfg = get_model_config(config["model"], config.get("cache_dir"))
    except (OSError, ValueError, KeyError, UserError):
        return False
    return openclip_separate_text(model_cfg, bool(config.get("force_custom_text")))


def _reparameterized(directory: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (bigclip's names) in the inference form (model/timm_tower.py's reparameterize): the architecture
    the checkpoint's train_state.json records, built whole on the CPU, loaded strictly, folded."""
    try:
        with open(os.path.join(directory, TRAIN_STATE)) as f:
            config = json.load(f)["config"]
        name = config["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"bigclip export --reparameterize: {directory}: no model config in its {TRAIN_STATE} ({e}); "
            "export without --reparameterize, then apply timm's reparameterize_model to the loaded model"
        ) from e
    size = config.get("force_image_size")
    model = create_model(
        name,
        image_size=(size[0] if len(size) == 1 else tuple(size)) if size else None,
        context_length=config.get("force_context_length"),
        quick_gelu=bool(config.get("force_quick_gelu")),
        custom_text=bool(config.get("force_custom_text")),
        layer_scale_init=config.get("layer_scale_init"),
        cache_dir=config.get("cache_dir"),
        init=False,  # every weight comes from the checkpoint
    )
    if not reparameterizable(model):
        raise UserError(
            f"bigclip export --reparameterize: {name} has no branches to fold (MobileOne/FastViT blocks: "
            "MobileCLIP, MobileCLIP2); export it without --reparameterize"
        )
    model.load_state_dict(state, strict=True)
    return reparameterize(model).state_dict()


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="bigclip export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="checkpoint directory or URL (s3://, gs://, az://, https://)")
    p.add_argument("output", help="OUT.pt (torch.save) or OUT.safetensors")
    p.add_argument(
        "--names",
        choices=("openclip", "bigclip"),
        default="openclip",
        help="parameter names of the output (default: openclip)",
    )
    p.add_argument(
        "--ema", action="store_true", help="export the moving average of the weights (runs with --ema-decay)"
    )
    p.add_argument(
        "--reparameterize",
        action="store_true",
        help="the inference form of a MobileCLIP/MobileCLIP2 model: its MobileOne/FastViT branches folded, as "
        "timm's reparameterize_model does to OpenCLIP's model (checkpoints keep the training form)",
    )
    p.add_argument("--storage-options", default=None, help="JSON of fsspec options for a URL checkpoint")
    p.add_argument(
        "--storage-timeout",
        type=float,
        default=60.0,
        help="seconds a URL checkpoint's store may go unanswered before export stops (default: 60)",
    )
    return p


def export(
    checkpoint: str,
    output: str,
    names: str = "openclip",
    storage_options: dict | None = None,
    storage_timeout: float = 60.0,
    ema: bool = False,
    reparameterize: bool = False,
) -> int:
    if not output.endswith((".pt", ".pth", ".bin", ".safetensors")):
        raise UserError(f"bigclip export: output {output}: name it .pt or .safetensors")
    tmp = None
    try:
        if is_url(checkpoint):
            tmp = tempfile.mkdtemp(prefix="bigclip-export-")
            manifest = fetch_verified(checkpoint, os.path.join(tmp, "ckpt"), storage_options, timeout=storage_timeout)
            directory = os.path.join(tmp, "ckpt")
        else:
            manifest = verify_local(checkpoint)
            directory = checkpoint
        state = read_model_state(manifest.layout, directory, ema=ema)
        separate_text = _openclip_separate_text(directory)
        if reparameterize:
            state = _reparameterized(directory, state)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if names == "openclip":
        state = bigclip_to_openclip(state, separate_text)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if output.endswith(".safetensors"):
        save_file(
            state, output, metadata={"format": "pt", "source": redact_url(checkpoint) or "", "step": str(manifest.step)}
        )
    else:
        torch.save(state, output)
    params = sum(v.numel() for v in state.values())
    print(
        f"exported {len(state)} tensors ({params / 1e6:.1f}M parameters{', moving average' if ema else ''}"
        f"{', reparameterized' if reparameterize else ''}, "
        f"step {manifest.step}, "
        f"{names} names) from {redact_url(checkpoint)} to {output}"
    )
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not args.storage_timeout > 0:
        raise UserError(f"bigclip export: --storage-timeout {args.storage_timeout}: give a positive number of seconds")
    options = parse_storage_options(args.storage_options)
    return export(
        args.checkpoint, args.output, args.names, options, args.storage_timeout, args.ema, args.reparameterize
    )


COMMANDS.register(
    "export",
    Command(main, "bigclip export CKPT OUT"),
    help="a checkpoint (directory or URL, any engine) -> OUT.pt / OUT.safetensors",
)
