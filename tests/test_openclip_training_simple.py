"""OpenCLIP's own training tests (tests/test_training_simple.py of its main branch): every `main([...])` flag list,
as written there, through bigclip's command line on CPU (only --logs added, to keep the run in the test's folder,
and --precision fp32 on a CPU without bf16 units, below). Their `--zeroshot-frequency 1` names no ImageNet folder,
so it does nothing: OpenCLIP accepts it, and bigclip runs it with one warning line at the start
(test_a_zeroshot_frequency_without_imagenet_is_warned_about_once).

RN50, CoCa ViT-B-32, ViT-B-32 (locked image tower, 5 groups unlocked, --accum-freq 2) and mT5-base-ViT-B-32
(locked text tower, 2 layers unlocked) train and commit their epoch-1 checkpoint. The mT5 model is
mt5-base-ViT-B-32's config with a tiny mT5 created here in place of the hub's google/mt5-base (the tests have no
hub access), given as an OpenCLIP local-dir: model.

The lists leave --precision at its default, amp: bfloat16 autocast on CPU. On a CPU without bf16 units that is
emulated (the four lists took 1278 s under torch's AVX2 paths, against 301 s natively on the same machine), so
there they run with --precision fp32, what the run's own start-up line advises: what is tested here is that the
lists train and save, and bf16 autocast on CPU is tested at sizes that finish there (test_train.py, test_slow_bf16.py).
"""

from __future__ import annotations

import glob
import os

import pytest
from helpers import bf16_emulated

from bigclip import cli
from bigclip.ckpt import verify

pytestmark = pytest.mark.slow

COMMON = [
    '--save-frequency', '1',
    '--zeroshot-frequency', '1',
    '--dataset-type', "synthetic",
    '--train-num-samples', '16',
    '--warmup', '1',
    '--batch-size', '4',
    '--lr', '1e-3',
    '--wd', '0.1',
    '--epochs', '1',
    '--workers', '2',
]  # fmt: skip

MT5 = "mt5-base-ViT-B-32"
TRAINED = {
    "test_training": [*COMMON, '--model', 'RN50'],
    "test_training_coca": [*COMMON, '--model', 'coca_ViT-B-32'],
    "test_training_unfreezing_vit": [
        *COMMON, '--model', 'ViT-B-32', '--lock-image', '--lock-image-unlocked-groups', '5', '--accum-freq', '2'
    ],
    "test_training_mt5": [*COMMON, '--model', MT5, '--lock-text', '--lock-text-unlocked-layers', '2'],
}  # fmt: skip


def local_mt5(directory) -> str:
    """mt5-base-ViT-B-32 as an OpenCLIP local-dir: model, its text tower a tiny mT5 made here."""
    import json

    from helpers import tiny_hf_clip

    from bigclip.model import get_model_config

    tiny_hf_clip(directory, "mt5")
    path = os.path.join(directory, "open_clip_config.json")
    written = json.load(open(path))
    cfg = get_model_config(MT5)
    vision = {k: v for k, v in cfg["vision_cfg"].items() if k not in ("image_mean", "image_std")}
    tiny = written["model_cfg"]["text_cfg"]
    text = {**cfg["text_cfg"], "hf_model_name": tiny["hf_model_name"], "hf_tokenizer_name": tiny["hf_tokenizer_name"]}
    written["model_cfg"] = {"embed_dim": cfg["embed_dim"], "vision_cfg": vision, "text_cfg": text}
    json.dump(written, open(path, "w"))
    return f"local-dir:{directory}"


# Each list is a whole training of a full-size model (1.5-4 min here). In CI: the ViT list (locked groups,
# accumulation); the RN50, CoCa and mT5 lists run the same loop on other towers (extended tier), their towers
# checked against OpenCLIP's in CI (tests/test_resnet.py, test_coca.py, test_hf_text.py).
IN_CI = {"test_training_unfreezing_vit"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in IN_CI else pytest.mark.extended) for n in TRAINED])
def test_openclips_flag_list_trains_and_saves_its_epoch_1_checkpoint(name, tmp_path):
    flags = TRAINED[name]
    if bf16_emulated():
        flags = [*flags, "--precision", "fp32"]
    if MT5 in flags:
        flags = [local_mt5(tmp_path / "mt5") if f == MT5 else f for f in flags]
    assert cli.main([*flags, "--logs", str(tmp_path / "logs")]) == 0
    (run,) = glob.glob(str(tmp_path / "logs" / "*"))
    checkpoint = os.path.join(run, "checkpoints", "epoch_1")
    assert os.path.isfile(os.path.join(checkpoint, "manifest.json"))
    verify(checkpoint)


def test_a_zeroshot_frequency_without_imagenet_is_warned_about_once():
    """OpenCLIP's lists say --zeroshot-frequency 1 without --imagenet-val: no zero-shot evaluation runs, so the run
    says so in one line (flag_fields.idle) rather than refusing the list or ignoring the flag silently."""
    from bigclip.cli_args import parse_train_args

    cfg, _ = parse_train_args([*COMMON, "--model", "RN50"])
    assert cfg.sections.idle_notes == (
        "--zeroshot-frequency: only applies with --imagenet-val or --imagenet-v2; the flag does nothing in this run",
    )
