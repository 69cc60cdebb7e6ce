"""Builds every architecture open_clip_torch lists, in bigclip and in OpenCLIP, on the meta device, and prints one
JSON object: name -> [outcome, detail]. Run by tests/test_model_zoo.py in a process of its own, HF_ENDPOINT pointed
at a hub of tiny stand-in configs for the Hugging Face text towers' repositories (huggingface_hub and transformers
read it when imported), HF_HOME at an empty cache."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import open_clip

from bigclip.errors import UserError
from bigclip.model import create_model
from bigclip.model.convert import bigclip_to_openclip
from bigclip.model.meta_build import meta_construction


def walk() -> dict[str, list]:
    out = {}
    for name in open_clip.list_models():
        try:
            # meta_construction: torch.device("meta") without the constructors' initialisation math, which on
            # meta tensors computes nothing (no values) and only costs time; the names and shapes compared are
            # OpenCLIP's own
            with meta_construction():
                # pretrained_text=False: a Hugging Face text tower from its config alone, as bigclip builds it on meta
                # (its weights come at init_weights); transformers refuses from_pretrained on the meta device
                theirs = open_clip.create_model(name, pretrained=None, device="meta", pretrained_text=False)
                theirs = theirs.state_dict()
            theirs = {k: list(v.shape) for k, v in theirs.items()}
        except Exception as e:  # noqa: BLE001 - OpenCLIP itself cannot build it here (a hub download)
            theirs = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            model = create_model(name, device="meta")
        except UserError as e:
            out[name] = ["refused", str(e)]
            continue
        ours = bigclip_to_openclip(model.state_dict(), model.openclip_separate_text)
        ours = {k: list(v.shape) for k, v in ours.items()}
        if isinstance(theirs, str):
            out[name] = ["only bigclip", theirs]
        elif ours == theirs:
            out[name] = ["equal", len(ours)]
        else:
            shapes = {k: [theirs[k], ours[k]] for k in sorted(set(theirs) & set(ours)) if theirs[k] != ours[k]}
            out[name] = ["differ", {"missing": sorted(set(theirs) - set(ours))[:5],
                                    "extra": sorted(set(ours) - set(theirs))[:5],
                                    "shapes": dict(list(shapes.items())[:5])}]  # fmt: skip
    return out


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    json.dump(walk(), sys.stdout)
