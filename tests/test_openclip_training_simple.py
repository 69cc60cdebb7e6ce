"""OpenCLIP's own training tests (tests/test_training_simple.py of its main branch): every `main([...])` flag list,
as written there, through bigclip's command line on CPU (only --logs added, to keep the run in the test's folder).

RN50, CoCa ViT-B-32 and ViT-B-32 (locked image tower, 5 groups unlocked, --accum-freq 2) train and commit their
epoch-1 checkpoint. The mT5 text tower is not built by bigclip yet: its list stops with one line saying so (issue
25 part 4), which this test holds until it is.
"""

from __future__ import annotations

import glob
import os

import pytest

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

TRAINED = {
    "test_training": [*COMMON, '--model', 'RN50'],
    "test_training_coca": [*COMMON, '--model', 'coca_ViT-B-32'],
    "test_training_unfreezing_vit": [
        *COMMON, '--model', 'ViT-B-32', '--lock-image', '--lock-image-unlocked-groups', '5', '--accum-freq', '2'
    ],
}  # fmt: skip
NOT_BUILT_YET = {
    "test_training_mt5": [*COMMON, '--model', 'mt5-base-ViT-B-32', '--lock-text', '--lock-text-unlocked-layers', '2'],
}  # fmt: skip


@pytest.mark.parametrize("name", TRAINED)
def test_openclips_flag_list_trains_and_saves_its_epoch_1_checkpoint(name, tmp_path):
    assert cli.main([*TRAINED[name], "--logs", str(tmp_path)]) == 0
    (run,) = glob.glob(str(tmp_path / "*"))
    checkpoint = os.path.join(run, "checkpoints", "epoch_1")
    assert os.path.isfile(os.path.join(checkpoint, "manifest.json"))
    verify(checkpoint)


@pytest.mark.parametrize("name", NOT_BUILT_YET)
def test_openclips_flag_lists_of_models_not_built_yet_stop_in_one_line(name, tmp_path, capfd):
    assert cli.main([*NOT_BUILT_YET[name], "--logs", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and "not supported yet" in err, err
    assert os.listdir(tmp_path) == []
