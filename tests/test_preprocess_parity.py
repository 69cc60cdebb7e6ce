"""Image preprocessing per model family: bigclip's transforms for a model name (as build_transforms makes them from
the model's preprocess_cfg) give OpenCLIP 3.3's pixels, bit for bit, on sample images of every shape and mode.

OpenCLIP's side is OpenCLIP's own code: its PreprocessCfg for the name, settled as open_clip.create_model settles
it (its defaults, the tag's entry in its pretrained registry merged by its merge_preprocess_dict, the tower's
image size), handed to its image_transform_v2. Building OpenCLIP's model only to read that size takes seconds a
name even on meta, so the size is read from OpenCLIP's config of the name, and one test checks on three cheap names
that create_model_and_transforms(name, pretrained=None, device="meta") settles the same config and pixels.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import open_clip
import pytest
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict
from open_clip.utils import to_2tuple
from PIL import Image

from bigclip.build import build_transforms
from bigclip.data import DataConfig
from bigclip.model.config import ModelConfig

# One name of each family OpenCLIP lists, with the pretrained tag whose preprocessing is the family's own (SigLIP's
# squash and 0.5 mean/std, CLIPA's and PE's bilinear squash, MobileCLIP's 0/1 normalisation and bilinear resize).
FAMILIES = {
    "classic ViT": ("ViT-B-32", "laion2b_s34b_b79k"),
    "classic RN": ("RN50x4", "openai"),
    "quickgelu": ("ViT-B-32-quickgelu", "metaclip_400m"),
    "SigLIP": ("ViT-B-16-SigLIP", "webli"),
    "SigLIP2": ("ViT-SO400M-16-SigLIP2-384", "webli"),
    "CLIPA": ("ViT-L-14-CLIPA", "datacomp1b"),
    "EVA01": ("EVA01-g-14", "laion400m_s11b_b41k"),
    "EVA02": ("EVA02-B-16", "merged2b_s8b_b131k"),
    "ViTamin": ("ViTamin-L-256", "datacomp1b"),
    "MobileCLIP": ("MobileCLIP-S1", "datacompdr"),
    "MobileCLIP2": ("MobileCLIP2-S0", "dfndr2b"),
    "PE-Core": ("PE-Core-B-16", "meta"),
    "convnext": ("convnext_base_w", "laion2b_s13b_b82k"),
    "timm tower (swin)": ("swin_base_patch4_window7_224", None),
    "timm tower (vit gap)": ("vit_medium_patch16_gap_256", None),
    "CoCa": ("coca_ViT-B-32", "laion2b_s13b_b90k"),
    "ViT plus (240)": ("ViT-B-16-plus-240", "laion400m_e32"),
}


def sample_images() -> dict[str, Image.Image]:
    """Non-square, tiny (upsampled), large, a transparent RGBA, grayscale and a palette image."""
    rng = np.random.default_rng(0)

    def pixels(height, width, channels):
        # smooth gradients plus noise: resampling filters differ visibly on both
        y, x = np.mgrid[0:height, 0:width]
        base = (x * 255 // max(width - 1, 1) + y * 128 // max(height - 1, 1))[..., None] % 256
        noise = rng.integers(0, 64, (height, width, channels))
        return ((base + noise) % 256).astype(np.uint8)

    rgba = pixels(200, 300, 4)
    rgba[..., 3] = np.where(np.arange(300)[None, :] < 150, 0, rng.integers(0, 256, (200, 300)))  # half transparent
    return {
        "4:3 RGB": Image.fromarray(pixels(375, 500, 3)),
        "portrait RGB": Image.fromarray(pixels(501, 333, 3)),
        "tiny RGB": Image.fromarray(pixels(37, 61, 3)),
        "large RGB": Image.fromarray(pixels(1080, 1440, 3)),
        "RGBA": Image.fromarray(rgba, "RGBA"),
        "grayscale": Image.fromarray(pixels(150, 220, 1)[..., 0], "L"),
        "palette": Image.fromarray(pixels(120, 90, 3)).quantize(64),
    }


IMAGES = sample_images()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Normalising one small image on several threads costs more in their handoffs than it saves (tens of ms an
    image on a loaded machine, against one): the hundreds of transforms here run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def openclip_cfg(name: str, tag: str | None, **force) -> PreprocessCfg:
    """OpenCLIP's PreprocessCfg for `name` with pretrained `tag`, settled as its create_model settles it."""
    cfg = asdict(PreprocessCfg())
    if tag:
        cfg = merge_preprocess_dict(cfg, open_clip.get_pretrained_cfg(name, tag))
    cfg["size"] = open_clip.get_model_config(name)["vision_cfg"].get("image_size", 224)
    return PreprocessCfg(**merge_preprocess_dict(cfg, force))


def assert_same_pixels(ours, theirs, what: str, seeds=(0, 1)) -> None:
    for label, image in IMAGES.items():
        for seed in seeds:
            torch.manual_seed(seed)
            mine = ours(image)
            torch.manual_seed(seed)
            reference = theirs(image)
            assert mine.shape == reference.shape, f"{what}, {label}: shape {mine.shape} != {reference.shape}"
            assert torch.equal(mine, reference), (
                f"{what}, {label}: differs by up to {(mine - reference).abs().max():.4g} over "
                f"{(mine != reference).float().mean():.1%} of the values"
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_transforms_equal_openclips_per_family(family):
    """Per family, without weights (OpenCLIP's defaults) and with the family's pretrained tag: the evaluation
    transform and the training transform (its random crop drawn from the same seed) give OpenCLIP's pixels."""
    name, tag = FAMILIES[family]
    for pretrained in (None, tag) if tag else (None,):
        theirs = openclip_cfg(name, pretrained)
        train, val, geometry = build_transforms(
            ModelConfig(model=name, pretrained=pretrained), DataConfig(image_decode="full")
        )
        size = theirs.size if isinstance(theirs.size, tuple | list) else (theirs.size, theirs.size)
        assert geometry == {"size": tuple(size), "mean": tuple(theirs.mean), "std": tuple(theirs.std)}
        what = f"{name} pretrained={pretrained} ({theirs.resize_mode}, {theirs.interpolation}, mean {theirs.mean})"
        assert_same_pixels(val, image_transform_v2(theirs, is_train=False), f"{what}: eval", seeds=(0,))
        assert_same_pixels(train, image_transform_v2(theirs, is_train=True), f"{what}: train")


def test_the_families_preprocessing_is_their_tags():
    """The tags above carry what makes each family's preprocessing its own (else the test above shows little)."""
    cfgs = {family: openclip_cfg(name, tag) for family, (name, tag) in FAMILIES.items() if tag}
    assert (cfgs["SigLIP"].resize_mode, cfgs["SigLIP"].mean) == ("squash", (0.5, 0.5, 0.5))
    assert (cfgs["SigLIP2"].resize_mode, cfgs["SigLIP2"].size) == ("squash", 384)
    assert (cfgs["CLIPA"].interpolation, cfgs["PE-Core"].interpolation) == ("bilinear", "bilinear")
    assert cfgs["MobileCLIP"].std == (1.0, 1.0, 1.0) and cfgs["MobileCLIP"].interpolation == "bilinear"
    assert cfgs["classic RN"].size == 288


@pytest.mark.parametrize(
    "name, flags",
    [
        ("ViT-B-32", {"image_resize_mode": "longest"}),
        ("ViT-B-16-SigLIP", {"image_resize_mode": "shortest", "image_interpolation": "bilinear"}),
        ("MobileCLIP-S1", {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.2, 0.2]}),
    ],
)
def test_image_flags_override_as_openclips_image_arguments(name, flags):
    """--image-resize-mode/-interpolation/-mean/-std: OpenCLIP's create_model_and_transforms image_* arguments."""
    force = {k.removeprefix("image_"): tuple(v) if isinstance(v, list) else v for k, v in flags.items()}
    theirs = openclip_cfg(name, None, **force)
    _, val, _ = build_transforms(ModelConfig(model=name), DataConfig(image_decode="full", **flags))
    assert_same_pixels(val, image_transform_v2(theirs, is_train=False), f"{name} {flags}: eval", seeds=(0,))


def test_non_square_size_and_letterbox_fill_colour(tmp_path):
    """A non-square tower (--force-image-size 160 224) resized by the shortest side, and a local-dir: model whose
    preprocess_cfg letterboxes ('longest') with a grey fill: OpenCLIP's pixels (its own create_model_and_transforms
    reading the same directory)."""
    import json

    size = (160, 224)
    _, val, _ = build_transforms(
        ModelConfig(model="ViT-B-32", force_image_size=list(size)), DataConfig(image_decode="full")
    )
    theirs = openclip_cfg("ViT-B-32", None, size=size)
    assert_same_pixels(val, image_transform_v2(theirs, is_train=False), "ViT-B-32 at 160x224: eval", seeds=(0,))

    cfg = open_clip.get_model_config("ViT-B-32")
    preprocess = {"resize_mode": "longest", "fill_color": 128, "interpolation": "bilinear", "mean": [0.5] * 3}
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": preprocess}))
    name = f"local-dir:{tmp_path}"
    _, _, their_val = open_clip.create_model_and_transforms(name, device="meta")
    _, val, _ = build_transforms(ModelConfig(model=name), DataConfig(image_decode="full"))
    assert_same_pixels(val, their_val, f"{name} (longest, fill 128): eval", seeds=(0,))
    black = build_transforms(
        ModelConfig(model="ViT-B-32"), DataConfig(image_decode="full", image_resize_mode="longest")
    )
    assert not torch.equal(black[1](IMAGES["4:3 RGB"]), val(IMAGES["4:3 RGB"]))  # the fill shows


@pytest.mark.parametrize("name", ["ViT-B-32", "RN50", "ViT-B-16-plus-240"])
def test_openclips_model_settles_the_same_config(name):
    """The oracle's shortcut (size from OpenCLIP's config, no model) is what OpenCLIP's create_model_and_transforms
    itself settles, pixels included."""
    model, their_train, their_val = open_clip.create_model_and_transforms(name, pretrained=None, device="meta")
    settled, shortcut = PreprocessCfg(**model.visual.preprocess_cfg), openclip_cfg(name, None)
    pair = to_2tuple(shortcut.size)  # the config's int, the tower's (224, 224): the same transform
    assert asdict(settled) == {**asdict(shortcut), "size": pair if isinstance(settled.size, tuple) else shortcut.size}
    train, val, _ = build_transforms(ModelConfig(model=name), DataConfig(image_decode="full"))
    assert_same_pixels(val, their_val, f"{name}: eval", seeds=(0,))
    assert_same_pixels(train, their_train, f"{name}: train")


def test_default_reduced_decoding_evaluates_in_memory_images_as_openclip():
    """--image-decode reduced (the default) only changes JPEG decoding: an image that is not a JPEG (here, every
    sample: made in memory) is evaluated with OpenCLIP's pixels, its mode kept until after the resize."""
    _, val, _ = build_transforms(ModelConfig(model="ViT-B-16-SigLIP", pretrained="webli"), DataConfig())
    _, square_val, _ = build_transforms(ModelConfig(model="EVA02-B-16"), DataConfig())
    assert_same_pixels(val, image_transform_v2(openclip_cfg("ViT-B-16-SigLIP", "webli"), is_train=False), "SigLIP")
    assert_same_pixels(square_val, image_transform_v2(openclip_cfg("EVA02-B-16", None), is_train=False), "EVA02")
