"""The fp8 arm beside SwitchBack: the MLP linears that `--use-bnb-linear` swaps (switchback.MLP_LINEAR_NAMES),
trained through torchao.float8 (`--use-fp8-linear RECIPE`) on GPUs with fp8 tensor cores (Hopper, Ada:
compute capability 8.9 and up).

torchao's Float8Linear casts X, W and the output gradient to float8 with dynamic scales (one per tensor:
`tensorwise`; one per row of each operand: `rowwise`) and runs all three matmuls of a linear layer as
`torch._scaled_mm`; the parameters stay nn.Linear's (same names, dtype and state dict), so checkpoints and
exports do not change. The swap is a module swap on the model before any engine wraps it (it works on meta:
Float8Linear keeps the Parameter objects). Layers whose widths are not multiples of 16 (what _scaled_mm
takes) are left as they are.

Refused in one line where it cannot run: on CPU and on GPUs older than compute capability 8.9.
"""

from __future__ import annotations

import torch
from torch import nn

from bigclip.errors import UserError
from bigclip.model.switchback import MLP_LINEAR_NAMES
from bigclip.registry import Registry

FP8_RECIPES: Registry[str] = Registry("--use-fp8-linear")
FP8_RECIPES.register("tensorwise", "tensorwise", help="one dynamic scale per tensor (torchao's fastest recipe)")
FP8_RECIPES.register("rowwise", "rowwise", help="one dynamic scale per row of each operand (more accurate)")
FP8_MIN_CAPABILITY = (8, 9)


def has_fp8_tensor_cores(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of this compute capability multiplies in fp8 (torch._scaled_mm): Ada (8.9) and later."""
    return tuple(capability) >= FP8_MIN_CAPABILITY


def check_fp8_device(device: torch.device | str) -> None:
    """One line, naming the flag, where fp8 matmuls cannot run."""
    device = torch.device(device)
    if device.type == "meta":
        return  # built on meta, materialised on the run's device, which build.py checks
    if device.type != "cuda":
        raise UserError(
            f"--use-fp8-linear: fp8 matmuls need a CUDA GPU with fp8 tensor cores (compute capability 8.9+: "
            f"Ada, Hopper, Blackwell); this run is on {device.type}; use --use-bnb-linear for int8 or omit it"
        )
    capability = torch.cuda.get_device_capability(device)
    if not has_fp8_tensor_cores(capability):
        name = torch.cuda.get_device_name(device)
        raise UserError(
            f"--use-fp8-linear: {name} (compute capability {capability[0]}.{capability[1]}) has no fp8 tensor "
            f"cores (8.9+ needed); use --use-bnb-linear for int8 or omit it"
        )


def _fp8_eligible(module: nn.Module, qualified: str) -> bool:
    return (
        isinstance(module, nn.Linear)
        and qualified.rpartition(".")[2] in MLP_LINEAR_NAMES
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def replace_linears_fp8(model: nn.Module, recipe: str) -> int:
    """Swap model's MLP linears (MLP_LINEAR_NAMES, widths multiples of 16) for torchao's Float8Linear with
    `recipe`'s config; returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # torchao's import is slow

    FP8_RECIPES.entry(recipe)
    eligible = [name for name, m in model.named_modules() if _fp8_eligible(m, name)]
    if eligible:
        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=_fp8_eligible)
    return len(eligible)
