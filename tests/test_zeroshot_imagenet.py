"""--imagenet-val / --imagenet-v2: OpenCLIP's class names, templates and metric names, checked against a direct
computation with open_clip's own zero-shot code (build_zero_shot_classifier, accuracy) on the same weights."""

import json
import os

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from helpers import torchrun
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
from PIL import Image

from bigclip import cli
from bigclip.ckpt.dcp_layout import DCPLayout
from bigclip.data import image_transform
from bigclip.data.imagenet import ImageFolderDataset
from bigclip.model import create_model, get_tokenizer, preprocess_cfg


def imagenet_tree(root, names, extra=(0, 1, 2, 3, 4), seed=0) -> None:
    """One tiny image per class folder, three more in a few classes."""
    rng = np.random.default_rng(seed)
    for i, name in enumerate(names):
        os.makedirs(os.path.join(root, name))
        for j in range(4 if i in extra else 1):
            pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, name, f"img{j}.png"))


@pytest.fixture(scope="module")
def imagenet_val(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("imagenet") / "val")
    imagenet_tree(root, [f"n{1440764 + 17 * i:08d}" for i in range(1000)])  # synset-like ids, sorted = index
    return root


@pytest.mark.slow
def test_imagenet_zero_shot_matches_open_clip(imagenet_val, tmp_path, capsys):
    args = ["--model", "test-tiny", "--dataset-type", "synthetic", "--train-num-samples", "16", "--batch-size", "8",
            "--epochs", "1", "--precision", "fp32", "--workers", "0", "--lr", "1e-3", "--warmup", "1",
            "--imagenet-val", imagenet_val, "--logs", str(tmp_path), "--name", "zs"]  # fmt: skip
    assert cli.main(args) == 0
    run = os.path.join(tmp_path, "zs")
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    logged = next(r for r in records if "eval/imagenet-zeroshot-val-top1" in r)
    assert "Eval Epoch: 1 imagenet-zeroshot-val-top1:" in open(os.path.join(run, "out.log")).read()

    # The same weights (the epoch-1 checkpoint, written right after this evaluation), through open_clip's code.
    model = create_model("test-tiny", init=False).eval()
    model.load_state_dict(DCPLayout.read_model_state(os.path.join(run, "checkpoints", "epoch_1")))
    classifier = open_clip.build_zero_shot_classifier(
        model, get_tokenizer("test-tiny"), IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, num_classes_per_batch=50,
        device="cpu", use_tqdm=False,
    )  # fmt: skip
    pp = preprocess_cfg("test-tiny")
    transform = image_transform(pp["size"], False, pp["mean"], pp["std"], "bicubic", "shortest", None)
    dataset = ImageFolderDataset(imagenet_val, "imagenet_val", transform)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        logits = F.normalize(model.encode_image(images), dim=-1) @ classifier
    # Top-k by rank of the true class (open_clip_train's own accuracy() fails under numpy 2).
    rank_of_truth = (logits > logits.gather(1, labels.view(-1, 1))).sum(dim=1)
    top1, top5 = int((rank_of_truth < 1).sum()), int((rank_of_truth < 5).sum())
    assert len(dataset) == 1015
    assert logged["eval/imagenet-zeroshot-val-top1"] == pytest.approx(top1 / len(dataset), abs=1e-9)
    assert logged["eval/imagenet-zeroshot-val-top5"] == pytest.approx(top5 / len(dataset), abs=1e-9)

    # `bigclip eval` of the same weights (the checkpoint exported) prints the same numbers as JSON.
    weights = str(tmp_path / "w.safetensors")
    assert cli.main(["export", os.path.join(run, "checkpoints", "epoch_1"), weights]) == 0
    capsys.readouterr()
    argv = ["eval", "--model", "test-tiny", "--pretrained", weights, "--imagenet-val", imagenet_val,
            "--batch-size", "32", "--workers", "0", "--precision", "fp32"]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == "test-tiny" and result["images"] == {"imagenet-zeroshot-val": 1015}
    for key in ("imagenet-zeroshot-val-top1", "imagenet-zeroshot-val-top5"):
        assert result["metrics"][key] == pytest.approx(logged[f"eval/{key}"], abs=1e-9), key


def test_imagenet_v2_numbered_folders_are_class_indices(tmp_path):
    root = str(tmp_path / "v2")
    imagenet_tree(root, [str(i) for i in range(1000)], extra=())
    dataset = ImageFolderDataset(root, "imagenet_v2", lambda image: image)
    labels = {os.path.basename(os.path.dirname(path)): label for path, label in dataset.samples}
    assert labels["2"] == 2 and labels["10"] == 10 and labels["999"] == 999  # not the lexicographic order


def test_a_folder_that_is_not_imagenet_stops_with_one_line(tmp_path, capsys):
    root = str(tmp_path / "three")
    imagenet_tree(root, ["cat", "dog", "fish"], extra=())
    code = cli.main(["--model", "test-tiny", "--dataset-type", "synthetic", "--imagenet-val", root,
                     "--logs", str(tmp_path / "logs")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"--imagenet-val {root}: found 3 class folders, expected 1000" in err


@pytest.mark.extended  # 2-4 min; in CI the one-process evaluation against open_clip's (above)
@pytest.mark.slow
def test_two_ranks_split_the_classes_and_agree_with_one_process(imagenet_val, tmp_path):
    """FSDP on 2 ranks: each rank encodes half of the 1000 classes (every forward a collective), the shares are
    gathered, the images split between the ranks; lr 0 keeps the initial weights, so the numbers must be the
    one-process run's."""
    flags = ["--model", "test-tiny", "--dataset-type", "synthetic", "--train-num-samples", "16", "--batch-size",
             "4", "--epochs", "1", "--precision", "fp32", "--workers", "0", "--lr", "0", "--wd", "0",
             "--imagenet-val", imagenet_val, "--logs", str(tmp_path), "--save-frequency", "0"]  # fmt: skip
    assert cli.main([*flags, "--name", "one"]) == 0
    two = torchrun(2, [*flags, "--name", "two", "--engine", "fsdp"], timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]

    def logged(name):
        records = [json.loads(line) for line in open(os.path.join(tmp_path, name, "metrics.jsonl"))]
        return next(r for r in records if "eval/imagenet-zeroshot-val-top1" in r)

    one, two = logged("one"), logged("two")
    assert one["eval/imagenet-zeroshot-val-top5"] > 0  # a comparison of something, not of two zeros
    for key in ("eval/imagenet-zeroshot-val-top1", "eval/imagenet-zeroshot-val-top5"):
        assert two[key] == pytest.approx(one[key], abs=1e-9), key
