"""Layer-wise lr decay against OpenCLIP main itself (not on PyPI: pass a checkout of its sources).

    python bench/openclip_main_parity.py --openclip-main /path/to/open_clip/src

For each model, OpenCLIP main's `layer_decay_param_groups` (text decay 0.5, image decay 0.7; the pooler in the head
and, for the Hugging Face towers, its own group) and bigclip's `optim.param_groups` with the same flags give every
parameter a learning-rate scale; the script prints, per model, how many parameters differ (by OpenCLIP's names)
and the first differences. Models: ViT-B-32, ViT-L-14, RN50, RN50x4, coca_ViT-B-32, coca_base (built on meta) and
tiny Hugging Face towers made locally (RoBERTa with mean and cls poolers, mT5, NLLB's M2M100), so no hub access.
The test suite holds what this found (tests/test_layer_groups.py); this script is how it was found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lr_scales_openclip_main(model, text_decay: float, image_decay: float, pooler_in_head: bool) -> dict[str, float]:
    from open_clip_train.optim import layer_decay_param_groups

    groups = layer_decay_param_groups(
        model, 0.1, text_layer_decay=text_decay, image_layer_decay=image_decay, pooler_in_head=pooler_in_head
    )
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: round(g["lr_scale"], 10) for g in groups for p in g["params"]}


def lr_scales_bigclip(model, text_decay: float, image_decay: float, pooler_in_head: bool) -> dict[str, float]:
    from bigclip import optim

    cfg = optim.OptimizerConfig(
        text_layer_decay=text_decay, image_layer_decay=image_decay, text_pooler_own_group=not pooler_in_head
    )
    names, openclip = {id(p): n for n, p in model.named_parameters()}, model.openclip_names()
    return {
        openclip.get(names[id(p)], names[id(p)]): round(g.get("lr_scale", 1.0), 10)
        for g in optim.param_groups(model, cfg)
        for p in g["params"]
    }


def compare(label: str, theirs, ours, pooler_in_head: bool = True) -> int:
    a = lr_scales_openclip_main(theirs, 0.5, 0.7, pooler_in_head)
    b = lr_scales_bigclip(ours, 0.5, 0.7, pooler_in_head)
    differ = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    print(f"{label}: {len(a)} parameters, {len(differ)} differ")
    for name in differ[:10]:
        print(f"    {name}: OpenCLIP main {a.get(name)}, bigclip {b.get(name)}")
    return len(differ)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--openclip-main", required=True, help="OpenCLIP main's src/ folder (open_clip, open_clip_train)")
    args = p.parse_args()
    sys.path[:0] = [args.openclip_main, ROOT, os.path.join(ROOT, "tests")]
    import open_clip
    from helpers import tiny_hf_clip

    from bigclip.model import create_model

    print(f"OpenCLIP {open_clip.__version__} from {os.path.dirname(open_clip.__file__)}")
    differ = 0
    for name in ("ViT-B-32", "ViT-L-14", "RN50", "RN50x4", "coca_ViT-B-32", "coca_base"):
        differ += compare(name, open_clip.create_model(name, device="meta"), create_model(name, device="meta"))
    for kind in ("roberta", "roberta-cls", "mt5", "m2m_100"):
        folder = tempfile.mkdtemp()
        name = tiny_hf_clip(folder, kind.split("-")[0])
        if kind.endswith("-cls"):
            path = os.path.join(folder, "open_clip_config.json")
            with open(path) as f:
                config = json.load(f)
            config["model_cfg"]["text_cfg"]["hf_pooler_type"] = "cls_pooler"
            with open(path, "w") as f:
                json.dump(config, f)
        theirs, ours = open_clip.create_model(name), create_model(name)
        differ += compare(f"tiny {kind}", theirs, ours) + compare(f"tiny {kind}, pooler own group", theirs, ours, False)
    print("every scale equal" if not differ else f"{differ} differences")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
