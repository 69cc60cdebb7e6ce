"""Layer scale (--layer-scale-init, OpenCLIP's ls_init_value): zero-init blocks start as identities and learn,
every init path sets gamma to the value, OpenCLIP's names convert both ways, default models are unchanged."""

from __future__ import annotations

import copy
import json

import open_clip
import pytest
import torch
import torch.distributed as dist
from helpers import fork_ranks, free_port
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

from bigclip.config import resolve
from bigclip.engine.sharded_init import materialise, shard_meta_params
from bigclip.errors import UserError
from bigclip.model import bigclip_to_openclip, create_model, get_model_config, get_tokenizer, openclip_to_bigclip

TINY = "test-tiny"


def gammas(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if name.endswith(".gamma")}


def batch(model, n=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, *model.visual.image_size, generator=gen)
    return images, get_tokenizer(TINY)([f"caption {i}" for i in range(n)])


def test_default_models_have_no_layer_scale():
    model = create_model(TINY)
    assert not gammas(model)
    assert not any(".ls" in name for name in model.state_dict())


def test_every_block_of_both_towers_gets_both_scales():
    model = create_model(TINY, layer_scale_init=0.1)
    blocks = 2 + 2  # test-tiny: 2 vision and 2 text blocks
    assert len(gammas(model)) == 2 * blocks
    assert {name.rsplit(".", 2)[-2] for name in gammas(model)} == {"ls1", "ls2", "ls_1", "ls_2"}
    for name, gamma in gammas(model).items():
        assert torch.equal(gamma, torch.full_like(gamma, 0.1)), name


def test_zero_init_blocks_are_identities_and_gamma_gets_gradients():
    torch.manual_seed(0)
    model = create_model(TINY, layer_scale_init=0.0)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in gammas(model).values())
    for block in model.transformer_blocks():
        x = torch.randn(2, 5, 64)
        assert torch.equal(block(x), x)

    # Both towers compute exactly what they compute with no blocks at all.
    bare = copy.deepcopy(model)
    bare.visual.trunk.blocks = bare.visual.trunk.blocks[:0]
    bare.text.transformer.resblocks = bare.text.transformer.resblocks[:0]
    images, tokens = batch(model)
    assert torch.equal(model.encode_image(images), bare.encode_image(images))
    assert torch.equal(model.encode_text(tokens), bare.encode_text(tokens))

    out = model(images, tokens)
    logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
    nn.functional.cross_entropy(logits, torch.arange(len(images))).backward()
    for name, gamma in gammas(model).items():
        assert gamma.grad is not None and gamma.grad.abs().sum() > 0, name


def test_meta_build_then_init_sets_the_value():
    for value in (0.0, 0.1):
        model = create_model(TINY, device="meta", layer_scale_init=value)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        torch.manual_seed(0)
        model.init_weights()
        for name, gamma in gammas(model).items():
            assert torch.equal(gamma, torch.full_like(gamma, value)), name
        torch.manual_seed(0)
        direct = create_model(TINY, layer_scale_init=value)
        for (name, a), b in zip(model.state_dict().items(), direct.state_dict().values()):
            torch.testing.assert_close(a, b, msg=name)


def _sharded_init_worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for value in (0.0, 0.1):
            model = create_model(TINY, device="meta", layer_scale_init=value)
            shard_meta_params(model, mesh)  # what ZeRO-3's sharded init does; FSDP2's fully_shard is alike
            materialise(model, torch.device("cpu"), seed=0, rank=rank)
            for name, gamma in gammas(model).items():
                assert isinstance(gamma, DTensor) and gamma.to_local().numel() > 0, name
                full = gamma.full_tensor()
                assert torch.equal(full, torch.full_like(full, value)), name
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_init_sets_the_value_on_every_shard():
    fork_ranks(_sharded_init_worker, (2, free_port()), 2)


def openclip_tiny(ls_init_value: float) -> nn.Module:
    """OpenCLIP's own CLIP with test-tiny's dimensions and layer scale in both towers."""
    cfg = get_model_config(TINY)
    vision = {k: v for k, v in cfg["vision_cfg"].items() if k not in ("image_mean", "image_std")}
    return open_clip.model.CLIP(
        cfg["embed_dim"],
        vision_cfg={**vision, "ls_init_value": ls_init_value},
        text_cfg={**cfg["text_cfg"], "ls_init_value": ls_init_value},
    )


def test_openclip_layer_scale_converts_both_ways():
    torch.manual_seed(0)
    reference = openclip_tiny(0.1).eval()
    with torch.no_grad():  # distinct values per gamma, so a swapped or dropped mapping shows
        for gamma in gammas(reference).values():
            gamma.normal_()
    theirs = reference.state_dict()
    assert "visual.transformer.resblocks.1.ls_2.gamma" in theirs and "transformer.resblocks.0.ls_1.gamma" in theirs

    ours = create_model(TINY, layer_scale_init=0.0).eval()
    ours.load_state_dict(openclip_to_bigclip(theirs))  # strict: every entry has its place
    images, tokens = batch(ours)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode_image(images), reference.encode_image(images), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.encode_text(tokens), reference.encode_text(tokens), rtol=1e-5, atol=1e-5)

    back = bigclip_to_openclip(ours.state_dict())
    assert back.keys() == {k for k in theirs if not k.endswith("attn_mask")}
    for name, tensor in back.items():
        assert torch.equal(tensor, theirs[name]), name


def test_architecture_ls_init_value_is_the_default(tmp_path):
    cfg = get_model_config(TINY)
    cfg["vision_cfg"]["ls_init_value"] = cfg["text_cfg"]["ls_init_value"] = 0.25
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    name = f"local-dir:{tmp_path}"
    for flag, expected in ((None, 0.25), (0.0, 0.0)):
        model = create_model(name, load_weights=False, layer_scale_init=flag)
        assert {float(g.detach().unique()) for g in gammas(model).values()} == {expected}


def test_flag_rules():
    assert resolve({"layer_scale_init": 0.0}).layer_scale_init == 0.0
    for bad in (float("nan"), float("inf")):
        with pytest.raises(UserError, match="--layer-scale-init"):
            resolve({"layer_scale_init": bad})
    with pytest.raises(UserError, match="ResNet image tower"):
        create_model("RN50", device="meta", layer_scale_init=0.0)
