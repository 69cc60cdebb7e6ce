"""`bigclip export --reparameterize`: a MobileCLIP checkpoint in its inference form equals what timm's
reparameterize_model (what MobileCLIP's users apply to OpenCLIP's model) makes of OpenCLIP's model holding the same
weights: the same names and shapes, the same values, OpenCLIP's features; checkpoints keep the training form."""

from __future__ import annotations

import json
import os

import open_clip
import pytest
import torch
from helpers import python_train
from safetensors.torch import load_file
from timm.utils import reparameterize_model

from bigclip import cli
from bigclip.commands.export import _reparameterized
from bigclip.errors import UserError
from bigclip.model import create_model
from bigclip.model.timm_tower import reparameterizable

NAME = "MobileCLIP2-S0"  # the smallest MobileCLIP: FastViT-MCi0 trunk (MobileOne stem, RepMixer and attention stages)
SIZE = 64  # the folding does not depend on the image size; a small one keeps the training step short
TOL = 1e-5


def features(model, seed: int = 1):
    torch.manual_seed(seed)
    images = torch.randn(3, 3, SIZE, SIZE)
    texts = open_clip.get_tokenizer(NAME)(["a photo of a cat", "", "two dogs playing on a beach at sunset!"])
    with torch.no_grad():
        return model.encode_image(images, normalize=True), model.encode_text(texts, normalize=True)


def max_difference(ours, theirs) -> float:
    assert [a.shape for a in ours] == [b.shape for b in theirs]
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs))


# Extended tier: two full MobileCLIP builds (25 s); in CI the refusal where nothing folds (below)
@pytest.mark.extended
def test_reparameterized_export_equals_timms_reparameterization_of_openclips_model(tmp_path):
    """One training step (BatchNorm statistics of its own, so the folding is not of an init's zeros and ones),
    exported in both forms."""
    args = ["--model", NAME, "--force-image-size", str(SIZE), "--dataset-type", "synthetic",
            "--train-num-samples", "4", "--batch-size", "4", "--epochs", "1", "--precision", "fp32", "--workers", "0",
            "--lr", "1e-3", "--warmup", "1", "--logs", str(tmp_path), "--name", "run",
            "--zeroshot-frequency", "9", "--val-frequency", "9"]  # fmt: skip
    trained = python_train(args)
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = os.path.join(tmp_path, "run", "checkpoints", "epoch_1")
    plain, folded = str(tmp_path / "plain.safetensors"), str(tmp_path / "folded.safetensors")
    assert cli.main(["export", ckpt, plain]) == 0
    assert cli.main(["export", ckpt, folded, "--reparameterize"]) == 0

    # OpenCLIP's model with the training form's weights, reparameterized by timm: the reference
    theirs = open_clip.create_model(NAME, force_image_size=SIZE).eval()
    theirs.load_state_dict(load_file(plain), strict=True)
    before = features(theirs)
    reference = reparameterize_model(theirs).state_dict()
    ours = load_file(folded)
    assert sorted(ours) == sorted(reference)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in reference.items()}
    assert max((ours[k] - reference[k]).abs().max().item() for k in ours) <= 1e-6
    assert len(ours) < len(load_file(plain))  # branches gone: fewer tensors
    assert any(".reparam_conv." in k for k in ours)

    # the file loads strictly into OpenCLIP's model reparameterized the same way, with OpenCLIP's features
    loaded = reparameterize_model(open_clip.create_model(NAME, force_image_size=SIZE).eval())
    loaded.load_state_dict(ours, strict=True)
    assert max_difference(features(loaded), features(reparameterize_model(theirs))) <= TOL
    assert max_difference(features(loaded), before) <= TOL  # and the training form's function


def test_reparameterize_is_refused_in_one_line_where_nothing_folds(tmp_path):
    assert reparameterizable(create_model(NAME, init=False))
    assert not reparameterizable(create_model("test-tiny", init=False))
    (tmp_path / "train_state.json").write_text(json.dumps({"config": {"model": "test-tiny"}}))
    with pytest.raises(UserError, match="test-tiny has no branches to fold"):
        _reparameterized(str(tmp_path), create_model("test-tiny").state_dict())
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(UserError, match="no model config in its train_state.json"):
        _reparameterized(str(tmp_path), {})
