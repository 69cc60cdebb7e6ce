"""model/meta_build.py: constructing on meta without the constructors' initialisation math changes nothing a meta
model has (names, shapes, dtypes, strides, requires_grad), keeps shape errors, and leaves real tensors alone."""

import pytest
import torch
from torch import nn

from bigclip.model import create_model
from bigclip.model.meta_build import _VALUE_ONLY, meta_construction
from bigclip.model.registry import get_model_config


def _described(model: nn.Module) -> dict:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: (t.device.type, tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for n, t in tensors.items()}


@pytest.mark.parametrize("name", ["test-tiny", "test-tiny-coca", "RN50", "convnext_base", "ViT-B-16-SigLIP"])
def test_a_model_constructed_so_equals_one_constructed_on_plain_meta(name, monkeypatch):
    import bigclip.model.factory as factory

    skipped = create_model(name, device="meta")
    monkeypatch.setattr(factory, "meta_construction", lambda: torch.device("meta"))  # every initialiser runs
    plain = create_model(name, device="meta")
    assert _described(skipped) == _described(plain) and len(_described(plain)) > 10
    assert get_model_config(name)  # (a name the registry knows: the test compares real architectures)


def test_initialisers_are_skipped_on_meta_only_and_shape_errors_still_raise():
    counted = []

    class Counting(torch.Tensor):  # a subclass sees the calls that reach torch after the mode
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            counted.append(getattr(func, "__name__", ""))
            return super().__torch_function__(func, types, args, kwargs or {})

    with meta_construction():
        weight = nn.Parameter(torch.empty(8, 4))
        assert weight.is_meta
        nn.init.trunc_normal_(weight, std=0.02)
        weight.data.uniform_(-1, 1).clamp_(-0.5, 0.5)
        with pytest.raises(RuntimeError):  # (3,) does not broadcast to (8, 4): the skipped copy_ still says so
            weight.data.copy_(torch.empty(3))
        weight.requires_grad_(False)  # changes metadata: never skipped
        real = torch.zeros(2, device="cpu")
        real.add_(1.0)  # a real tensor's values are computed as ever
        probe = torch.empty(2, 2).as_subclass(Counting)
        probe.mul_(2.0)  # skipped: the subclass never sees it
    assert not weight.requires_grad
    assert real.tolist() == [1.0, 1.0]
    assert "mul_" not in counted
    assert torch.Tensor.uniform_ in _VALUE_ONLY and nn.init.kaiming_uniform_ in _VALUE_ONLY
    assert torch.Tensor.resize_ not in _VALUE_ONLY and torch.Tensor.transpose_ not in _VALUE_ONLY
