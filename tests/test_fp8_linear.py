"""--use-fp8-linear: torchao.float8 on the MLP linears --use-bnb-linear picks, refused in one line where fp8
matmuls cannot run (this CPU; GPUs before compute capability 8.9). Its speed is measured by the GPU kit's
int8 part (bench/gpu/part_int8.py), beside the SwitchBack variants."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_SYNTHETIC

from bigclip import cli
from bigclip.errors import UserError
from bigclip.model import create_model
from bigclip.model.fp8_linear import FP8_RECIPES, check_fp8_device, has_fp8_tensor_cores
from bigclip.model.switchback import MLP_LINEAR_NAMES


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--use-fp8-linear", "tensorwise"], "--use-fp8-linear: fp8 matmuls need a CUDA GPU with fp8 tensor cores"),
        (["--use-fp8-linear", "rowwise", "--use-bnb-linear", "SwitchBackLinearGlobal"], "are int8 already"),
        (["--use-fp8-linear", "e4m3"], "--use-fp8-linear 'e4m3': choose one of tensorwise, rowwise"),
    ],
    ids=["cpu", "with-int8", "unknown"],
)
def test_refused_in_one_line_before_anything_is_written(flags, says, tmp_path, capfd):
    logs = tmp_path / "logs"
    code = cli.main([*TINY_SYNTHETIC, "--logs", str(logs), *flags])
    err = capfd.readouterr().err.strip()
    assert code == 2 and err.startswith("bigclip: error: ") and says in err and "\n" not in err, err
    assert not logs.exists()


def test_capability_rule():
    assert not has_fp8_tensor_cores((8, 0)) and not has_fp8_tensor_cores((8, 6))  # A100, A10/RTX 30
    assert has_fp8_tensor_cores((8, 9)) and has_fp8_tensor_cores((9, 0)) and has_fp8_tensor_cores((10, 0))
    check_fp8_device("meta")  # built on meta: the run's device is checked where the run starts
    with pytest.raises(UserError, match="this run is on cpu"):
        check_fp8_device("cpu")


@pytest.mark.parametrize("recipe", list(FP8_RECIPES.names()))
def test_swaps_the_mlp_linears_and_keeps_the_state_dict(recipe):
    from torchao.float8.float8_linear import Float8Linear

    plain = create_model("test-tiny", device="meta")
    fp8 = create_model("test-tiny", fp8_linear=recipe, device="meta")
    swapped = {n for n, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    mlp = {
        n
        for n, m in plain.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in MLP_LINEAR_NAMES and "blocks" in n
    }
    assert swapped == mlp and len(swapped) == 8  # test-tiny: 2 image + 2 text blocks, fc1/fc2 and c_fc/c_proj
    expected = {k: (v.shape, v.dtype) for k, v in plain.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in fp8.state_dict().items()} == expected
    granularity = {m.config.cast_config_input.scaling_granularity.name for n, m in fp8.named_modules() if n in swapped}
    assert granularity == {"TENSORWISE" if recipe == "tensorwise" else "AXISWISE"}
