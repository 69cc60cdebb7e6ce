"""Round trips with OpenCLIP itself (open_clip_torch is the oracle), fp32 on CPU, embeddings within 1e-5.

- OpenCLIP -> bigclip: a randomly initialised OpenCLIP model, saved as OpenCLIP saves state dicts, loads
  into bigclip with --pretrained FILE and gives the same normalised image and text embeddings.
- bigclip -> OpenCLIP: `bigclip export` of a bigclip training checkpoint loads into
  open_clip.create_model(name, pretrained=OUT) (strict keys) and gives bigclip's embeddings; so does the
  consolidated file that --fsdp-checkpoint full adds to the checkpoint.
"""

import os

import open_clip
import pytest
import torch
from helpers import python_train

from bigclip import cli
from bigclip.ckpt.dcp_layout import DCPLayout
from bigclip.model import create_model
from bigclip.model.convert import bigclip_to_openclip

TOL = 1e-5


def embeddings(model, name: str, seed: int = 1):
    """Normalised image and text embeddings (OpenCLIP's and bigclip's models share encode_image/encode_text)."""
    torch.manual_seed(seed)
    images = torch.randn(3, 3, 224, 224)
    texts = open_clip.get_tokenizer(name)(["a photo of a cat", "", "two dogs playing on a beach at sunset!"])
    with torch.no_grad():
        return model.encode_image(images, normalize=True), model.encode_text(texts, normalize=True)


def assert_close(ours, theirs):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= TOL


@pytest.mark.slow
# In CI a ViT and a timm tower (EVA02); the quickgelu ViT and ConvNeXt (another timm tower) in the extended tier.
@pytest.mark.parametrize(
    "name",
    ["ViT-B-32", pytest.param("ViT-B-16-quickgelu", marks=pytest.mark.extended), "EVA02-B-16",
     pytest.param("convnext_base", marks=pytest.mark.extended)],
)  # fmt: skip
def test_openclip_weights_load_into_bigclip_with_the_same_embeddings(name, tmp_path):
    torch.manual_seed(0)
    reference = open_clip.create_model(name).eval()
    path = str(tmp_path / "openclip.pt")
    torch.save(reference.state_dict(), path)  # what OpenCLIP users hold: a plain state dict
    ours = create_model(name, pretrained=path).eval()
    assert_close(embeddings(ours, name), embeddings(reference, name))


@pytest.mark.slow
def test_bigclip_export_loads_into_open_clip_with_the_same_embeddings(tmp_path):
    """One training step of ViT-B-32 (so the weights are bigclip's own, not an init), checkpoint, export; the
    checkpoint also holds the consolidated weights (--fsdp-checkpoint full)."""
    name = "ViT-B-32"
    args = ["--model", name, "--dataset-type", "synthetic", "--train-num-samples", "2", "--batch-size", "2",
            "--epochs", "1", "--precision", "fp32", "--workers", "0", "--lr", "1e-3", "--warmup", "1",
            "--logs", str(tmp_path), "--name", "run", "--fsdp-checkpoint", "full"]  # fmt: skip
    trained = python_train(args)  # its own process: training ViT-B-32 takes GBs this one would keep
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "epoch_1")
    out = str(tmp_path / "exported.safetensors")
    assert cli.main(["export", ckpt, out]) == 0

    ours = create_model(name, init=False).eval()
    ours.load_state_dict(DCPLayout.read_model_state(ckpt))  # the checkpoint's weights, bigclip's names
    for path in (out, os.path.join(ckpt, "openclip_state_dict.pt")):
        theirs = open_clip.create_model(name, pretrained=path).eval()  # strict: every key of OpenCLIP's model
        assert_close(embeddings(ours, name), embeddings(theirs, name))
        assert theirs.logit_scale.item() == pytest.approx(ours.logit_scale.item())


@pytest.mark.slow
# In CI the forced custom-text ViT; ViTamin (custom text by its config, 2 min here) in the extended tier.
@pytest.mark.parametrize(
    "name, force_custom_text", [pytest.param("ViTamin-S", False, marks=pytest.mark.extended), ("ViT-B-32", True)]
)
def test_custom_text_architectures_export_in_openclips_custom_text_layout(name, force_custom_text, tmp_path):
    """OpenCLIP builds a config with custom_text (ViTamin) or --force-custom-text as CustomTextCLIP, its text
    tower under `text.`: bigclip's export of it loads there strictly, with bigclip's embeddings; and OpenCLIP's
    weights of it load into bigclip."""
    torch.manual_seed(0)
    ours = create_model(name, custom_text=force_custom_text).eval()
    assert ours.openclip_separate_text
    exported = bigclip_to_openclip(ours.state_dict(), ours.openclip_separate_text)
    assert "text.ln_final.weight" in exported and "ln_final.weight" not in exported
    theirs = open_clip.create_model(name, force_custom_text=force_custom_text).eval()
    theirs.load_state_dict(exported, strict=True)
    assert_close(embeddings(ours, name), embeddings(theirs, name))
    path = str(tmp_path / "openclip.pt")
    torch.save(theirs.state_dict(), path)
    again = create_model(name, pretrained=path, custom_text=force_custom_text).eval()
    assert_close(embeddings(again, name), embeddings(theirs, name))
