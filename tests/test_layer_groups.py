"""Layer groups, weight-decay groups and layer-wise lr decay, against the installed OpenCLIP.

OpenCLIP's main branch scales a tower's learning rate by decay**depth over the same layer groups its --lock
flags freeze (3.3's lock groups, main's `layer_groups()`; main's docstring: "offset by one from layer-wise LR
decay, which keeps the head at lr_scale 1.0"). The oracle is therefore the installed OpenCLIP 3.3: a parameter
that its lock leaves trainable first at `unlocked_groups = k` sits at depth k - 1, and must get lr * decay**(k-1)
from bigclip. Names are compared in OpenCLIP's layout (bigclip's model maps its own names to OpenCLIP's).
"""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest
import torch
from helpers import REPO, launch
from open_clip.model import CLIP as OpenCLIPModel
from test_model_sources import TIMM_CFG, VIT_CFG

from bigclip import optim
from bigclip.errors import UserError
from bigclip.model import CLIP

RN_CFG = {**VIT_CFG, "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 64, "head_width": 64}}
CFGS = {"vit": VIT_CFG, "resnet": RN_CFG, "timm": TIMM_CFG}


def ours_and_theirs(which: str) -> tuple[CLIP, OpenCLIPModel]:
    cfg = CFGS[which]
    return CLIP(**cfg), OpenCLIPModel(**cfg)


def openclip_name(model: CLIP):
    mapping = model.openclip_names()
    return lambda name: mapping.get(name, name)


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def openclip_33_rule(name: str, p: torch.Tensor) -> bool:
    """open_clip_train.main's no-weight-decay rule (3.3)."""
    return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def no_decay_names(model: CLIP, cfg: optim.OptimizerConfig) -> set[str]:
    rename, names = openclip_name(model), {id(p): n for n, p in model.named_parameters()}
    return {rename(names[id(p)]) for g in optim.param_groups(model, cfg) if g["weight_decay"] == 0 for p in g["params"]}


def scales_of(model: CLIP, cfg: optim.OptimizerConfig) -> dict[str, float]:
    rename, names = openclip_name(model), {id(p): n for n, p in model.named_parameters()}
    return {rename(names[id(p)]): g.get("lr_scale", 1.0) for g in optim.param_groups(model, cfg) for p in g["params"]}


@pytest.mark.parametrize("which", CFGS)
def test_weight_decay_groups_match_openclip(which):
    ours, theirs = ours_and_theirs(which)
    cfg = optim.OptimizerConfig(wd=0.1)
    assert no_decay_names(ours, cfg) == {n for n, p in theirs.named_parameters() if openclip_33_rule(n, p)}
    # --wd-exclude: a pattern in OpenCLIP's names (what OpenCLIP users type) and one in bigclip's
    patterns = ["*positional_embedding*", "visual.trunk.blocks.0.*"]
    cfg = dataclasses.replace(cfg, wd_exclude=patterns)
    matches = lambda name: any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)  # noqa: E731
    spared = {n for n, p in theirs.named_parameters() if openclip_33_rule(n, p) or matches(n)}
    rename = openclip_name(ours)
    by_bigclip_name = {rename(n) for n, _ in ours.named_parameters() if matches(n)}
    assert no_decay_names(ours, cfg) == spared | by_bigclip_name
    assert "positional_embedding" in spared
    assert (which == "vit") == bool(by_bigclip_name - spared)


def depth_by_locking(theirs: OpenCLIPModel, tower: str) -> dict[str, int]:
    """Each parameter of the tower -> its depth below the head, by OpenCLIP 3.3's lock: first left trainable at
    unlocked k -> depth k - 1 (a timm tower's adapter head is never locked: its trunk's top group, unlocked at
    k = 1, sits one below it)."""
    lock = {"image": theirs.lock_image_tower, "text": theirs.lock_text_tower}[tower]
    timm = tower == "image" and hasattr(theirs.visual, "trunk")
    names = [n for n, _ in theirs.named_parameters() if n.startswith("visual.") == (tower == "image")]
    names = [n for n in names if n not in ("logit_scale", "logit_bias")]
    depth: dict[str, int] = {}
    for k in range(100):
        for p in theirs.parameters():
            p.requires_grad_(True)
        lock(k)
        for name in names:
            if name not in depth and theirs.get_parameter(name).requires_grad:
                depth[name] = k if timm else k - 1
        if len(depth) == len(names):
            return depth
    raise AssertionError("some parameters never unlocked")


@pytest.mark.parametrize(("which", "tower"), [("vit", "image"), ("vit", "text"), ("timm", "image")])
def test_layer_decay_scales_follow_openclips_lock_groups(which, tower):
    ours, theirs = ours_and_theirs(which)
    depth = depth_by_locking(theirs, tower)
    decay = 0.6
    flags = {"image_layer_decay": decay} if tower == "image" else {"text_layer_decay": decay}
    scales = scales_of(ours, optim.OptimizerConfig(**flags))
    assert len(set(depth.values())) >= 3  # several groups: embeddings, blocks, head
    for name, d in depth.items():
        assert scales[name] == pytest.approx(decay**d), name
    # everything else (the other tower, the logit scale) trains at the full lr
    assert all(scale == 1.0 for name, scale in scales.items() if name not in depth)


def test_resnet_layer_decay_follows_openclip_mains_groups():
    """OpenCLIP 3.3 locks a ModifiedResNet whole, so its groups come from main's ModifiedResNet.layer_groups:
    the stem, layer1..layer4, the attention pool."""
    ours, _ = ours_and_theirs("resnet")
    scales = scales_of(ours, optim.OptimizerConfig(image_layer_decay=0.5))
    depth_of_prefix = {"visual.attnpool.": 0, "visual.layer4.": 1, "visual.layer3.": 2, "visual.layer2.": 3}
    depth_of_prefix |= {"visual.layer1.": 4, "visual.conv": 5, "visual.bn": 5}
    visual = [n for n in scales if n.startswith("visual.")]
    for name in visual:
        (depth,) = [d for prefix, d in depth_of_prefix.items() if name.startswith(prefix)]
        assert scales[name] == pytest.approx(0.5**depth), name


@pytest.mark.parametrize("which", ["vit", "timm"])
def test_lock_leaves_openclips_groups_trainable(which):
    """--lock-image-unlocked-groups k / --lock-text-unlocked-layers k free the same parameters as OpenCLIP's
    lock for every k (bigclip's ViT and text towers once kept ln_post / ln_final with the projection)."""
    for k in range(0, 6):
        ours, theirs = ours_and_theirs(which)
        rename = openclip_name(ours)
        ours.lock_image_tower(k)
        theirs.lock_image_tower(k)
        ours.lock_text_tower(k)
        theirs.lock_text_tower(k)
        assert {rename(n) for n in trainable(ours)} == trainable(theirs), k


def test_groups_and_lr_under_an_engine_and_the_flags():
    """The flags reach the optimizer: NAdam with decoupled decay, --opt-kwargs, and every group's lr is the
    schedule's lr times its scale (set_lr / get_lr)."""
    model = CLIP(**VIT_CFG)
    cfg = optim.OptimizerConfig(opt="nadamw", opt_kwargs=["momentum_decay=0.005"], image_layer_decay=0.5)
    optim.check_optimizer(cfg)
    groups = optim.param_groups(model, cfg)
    optimizer = optim.create_optimizer(cfg, groups)
    assert isinstance(optimizer, torch.optim.NAdam)
    assert all(g["decoupled_weight_decay"] and g["momentum_decay"] == 0.005 for g in optimizer.param_groups)
    optim.set_lr(optimizer.param_groups, 0.01)
    assert optim.base_lr(optimizer.param_groups) == pytest.approx(0.01)
    assert sorted({round(g["lr"], 12) for g in optimizer.param_groups}) == sorted(
        {round(0.01 * 0.5**d, 12) for d in range(len(model.visual.layer_groups()))}
    )


@pytest.mark.parametrize("opt", ["adamw", "nadamw", "stableadamw", "adamw8bit", "timm/lamb"])
def test_opt_kwargs_betas_eps_and_lr_override_the_flags_as_in_openclip_main(opt):
    """OpenCLIP main merges --opt-kwargs last: betas/eps/lr given there win over --beta1/--beta2/--eps/--lr."""
    model = CLIP(**VIT_CFG)
    kwargs = ["betas=(0.85,0.95)", "eps=1e-8", "lr=0.002"]
    cfg = optim.OptimizerConfig(opt=opt, beta1=0.5, beta2=0.6, eps=1e-3, lr=0.1, opt_kwargs=kwargs)
    optim.check_optimizer(cfg)
    assert optim.hyperparameters(cfg) == {"lr": 0.002, "beta1": 0.85, "beta2": 0.95, "eps": 1e-8, "wd": cfg.wd}
    optimizer = optim.create_optimizer(cfg, optim.param_groups(model, cfg))
    for group in optimizer.param_groups:
        assert tuple(group["betas"]) == (0.85, 0.95) and group["eps"] == 1e-8, group
        assert float(group["lr"]) == pytest.approx(0.002)


def test_layer_decay_places_poolers_and_final_norms_as_openclip_main(tmp_path):
    """Where OpenCLIP 3.3 has no lock group to go by, main's layer_decay_param_groups (bench/openclip_main_parity.py
    compares every parameter's scale with main's own code, given its sources): a Hugging Face pooler layer rides in
    the projection's group (scale 1), or with --text-pooler-own-group is its own group below it (the layers one
    deeper); what follows
    a Hugging Face model's layers (mT5's final norm) and CoCa's attentional pooler are in no group (scale 1); CoCa's
    ln_post, after its pooler, is in the last block's group."""
    import json

    from helpers import tiny_hf_clip

    from bigclip.model import create_model

    def scales(name: str, **flags) -> dict[str, float]:
        model = create_model(name, device="meta")
        cfg = optim.OptimizerConfig(text_layer_decay=0.5, image_layer_decay=0.5, **flags)
        names = {id(p): n for n, p in model.named_parameters()}
        return {names[id(p)]: g["lr_scale"] for g in optim.param_groups(model, cfg) for p in g["params"]}

    roberta = tiny_hf_clip(tmp_path / "roberta", "roberta")
    config_file = tmp_path / "roberta" / "open_clip_config.json"
    config = json.loads(config_file.read_text())
    config["model_cfg"]["text_cfg"]["hf_pooler_type"] = "cls_pooler"  # BERT-like: the model's pooler.dense
    config_file.write_text(json.dumps(config))
    head, own = scales(roberta), scales(roberta, text_pooler_own_group=True)
    pooler, last = "text.transformer.pooler.dense.weight", "text.transformer.encoder.layer.1.output.dense.weight"
    assert (head[pooler], head[last], head["text.proj.0.weight"]) == (1.0, 0.5, 1.0)
    assert (own[pooler], own[last], own["text.proj.0.weight"]) == (0.5, 0.25, 1.0)
    mt5 = scales(tiny_hf_clip(tmp_path / "mt5", "mt5"))
    assert mt5["text.transformer.final_layer_norm.weight"] == 1.0
    assert mt5["text.transformer.block.1.layer.0.layer_norm.weight"] == 0.5
    coca = scales("test-tiny-coca")
    assert coca["visual.ln_post.weight"] == coca["visual.trunk.blocks.1.norm1.weight"] == 0.5
    assert coca["visual.attn_pool.query"] == coca["visual.proj"] == 1.0


def test_bad_optimizer_flags_are_one_line():
    with pytest.raises(UserError, match=r"--opt-kwargs nonsense=1: --opt adamw refused them"):
        optim.check_optimizer(optim.OptimizerConfig(opt_kwargs=["nonsense=1"]))
    with pytest.raises(UserError, match=r"--opt-kwargs oops: expected key=value"):
        optim.check_optimizer(optim.OptimizerConfig(opt_kwargs=["oops"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--image-layer-decay", "1.5"], "--image-layer-decay 1.5: must be in (0, 1]"),
        (["--visual-layer-decay", "0"], "--image-layer-decay 0.0: must be in (0, 1]"),
        (["--opt-kwargs", "betas=1"], "--opt-kwargs betas=1: expected two numbers, e.g. betas=(0.9,0.95)"),
        (["--opt-kwargs", "nonsense=1"], "--opt-kwargs nonsense=1: --opt adamw refused them"),
    ],
)
def test_bad_flags_stop_the_run_in_one_line(tmp_path, flags, message):
    args = ["--dataset-type", "synthetic", "--model", "test-tiny", "--logs", str(tmp_path), *flags]
    proc = launch("-m bigclip", args, 300, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())


def test_opt_fallback_list_routes_parameters_to_muons_adamw():
    """--opt-fallback-list: the matched parameters' groups carry use_fallback, which timm's Muon reads; Muon then
    steps them with its AdamW fallback, orthogonalising the others; refused for optimizers without a fallback."""
    model = CLIP(**VIT_CFG)
    cfg = optim.OptimizerConfig(opt="timm/muon", opt_fallback_list=["*token_embedding*", "visual.proj"])
    optim.check_optimizer(cfg)
    groups = optim.param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    fallback = {names[id(p)] for g in groups if g.get("use_fallback") for p in g["params"]}
    assert fallback == {"text.token_embedding.weight", "visual.proj"}
    optimizer = optim.create_optimizer(cfg, groups)
    images, texts = torch.randn(2, 3, 32, 32), torch.randint(0, 100, (2, 16))
    out = model(images, texts)
    (out["image_features"] * out["text_features"]).sum().backward()
    optimizer.step()
    assert "exp_avg_sq" in optimizer.state[model.visual.proj]  # AdamW's moments
    assert "exp_avg_sq" not in optimizer.state[model.visual.trunk.blocks[0].mlp.fc1.weight]  # Muon's momentum
    # OpenCLIP main's older spelling inside --opt-kwargs
    old = optim.OptimizerConfig(opt="timm/muon", opt_kwargs=["fallback_list=['visual.proj']"])
    assert any(g.get("use_fallback") for g in optim.param_groups(model, old))
    with pytest.raises(UserError, match="--opt-fallback-list: only Muon-family timm optimizers"):
        optim.check_optimizer(optim.OptimizerConfig(opt_fallback_list=["*"]))
