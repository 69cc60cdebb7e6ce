"""Every named choice is a registry owned by its component, and docs/architecture.md's "how to add" recipes work:
each test below follows one recipe in a few lines (register a new engine, loss family, image tower kind, data
source, schedule, optimizer) and trains a step with it through the real command line, then removes it.

Also: an unknown name is one line that lists the registered ones, for every registry.
"""

import contextlib
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_SYNTHETIC, read_metrics, step_losses
from torch import nn

from bigclip import cli, optim
from bigclip.commands.plan import render as render_plan
from bigclip.data import DATA_SOURCES
from bigclip.data.sources import DataSource, batch_sampler, map_style_loader
from bigclip.engine import ENGINES
from bigclip.engine.base import TorchOptimizerEngine
from bigclip.errors import UserError
from bigclip.loss import LOSSES, LossFamily
from bigclip.memory import MemorySetup, model_facts
from bigclip.metrics.trackers import REPORT_TARGETS
from bigclip.model import create_model, get_model_config
from bigclip.model.fp8_linear import FP8_RECIPES
from bigclip.model.switchback import SWITCHBACK_VARIANTS
from bigclip.model.towers import IMAGE_TOWERS, ImageTowerKind
from bigclip.optim import OPTIMIZERS, OptimizerKind
from bigclip.precision import PRECISIONS
from bigclip.schedule import SCHEDULES

ONE_STEP = ["--train-num-samples", "8", "--epochs", "1"]  # 8 samples, batch 8: one optimizer step


@contextlib.contextmanager
def registered(registry, name, value, **kwargs):
    registry.register(name, value, **kwargs)
    try:
        yield value
    finally:
        registry.unregister(name)


def train(tmp_path, name, *flags) -> str:
    assert cli.main([*TINY_SYNTHETIC, *ONE_STEP, "--logs", str(tmp_path), "--name", name, *flags]) == 0
    return os.path.join(tmp_path, name)


# ----------------------------------------------------------------------------------------- unknown names
@pytest.mark.parametrize(
    "flags, names",
    [
        (["--engine", "megatron"], "--engine 'megatron': choose one of ddp, fsdp, deepspeed"),
        (["--loss", "triplet"], "--loss 'triplet': choose one of clip, siglip"),
        (["--precision", "fp8"], "--precision 'fp8': choose one of amp, amp_bf16, amp_bfloat16, bf16, pure_bf16"),
        (["--lr-scheduler", "linear"], "--lr-scheduler 'linear': choose one of cosine, const, const-cooldown"),
        (["--opt", "sgd"], "--opt 'sgd': choose adamw or timm/<optimizer name>, or nadamw, stableadamw"),
        (["--report-to", "mlflow"], "--report-to 'mlflow': use tensorboard, wandb or tensorboard,wandb"),
        (["--use-bnb-linear", "Int4"], "--use-bnb-linear 'Int4': choose one of SwitchBackLinearGlobal, "),
        (["--dataset-type", "parquet"], "--dataset-type 'parquet': choose one of auto, csv, synthetic, webdataset"),
    ],
)
def test_an_unknown_name_is_one_line_listing_the_registered_ones(flags, names, capsys):
    assert cli.main(["--model", "test-tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and names in err, err


def test_help_lists_each_registry_with_what_its_names_mean(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help text
    registries = (ENGINES, LOSSES, PRECISIONS, SCHEDULES, OPTIMIZERS, REPORT_TARGETS, SWITCHBACK_VARIANTS, FP8_RECIPES)
    for registry in registries:
        for name in registry.names():
            assert name in out, name
    assert "SigLIP's sigmoid loss" in out and "FSDP2: parameters, gradients and optimizer state sharded" in out


# ------------------------------------------------------------------------------- recipe: a loss family
class OneWayLoss(nn.Module):
    """Only the text-to-image half of CLIP's loss; remembers what it returned."""

    def __init__(self):
        super().__init__()
        self.values = []

    def forward(self, image, text, logit_scale, logit_bias=None):
        logits = logit_scale * text @ image.T
        loss = F.cross_entropy(logits, torch.arange(len(text)))
        self.values.append(loss.item())
        return loss


def test_recipe_a_loss_family(tmp_path, capsys):
    made = []

    def build(cfg, rank, world_size):
        made.append(OneWayLoss())
        return made[-1]

    family = LossFamily(
        build=build,
        dist_impls=("gather",),
        described_as="the one-way loss",
        model_init={"init_logit_scale": math.log(5.0), "init_logit_bias": None},
    )
    with registered(LOSSES, "one_way", family, help="text-to-image only"):
        run_dir = train(tmp_path, "loss", "--loss", "one_way")
        assert cli.main([*TINY_SYNTHETIC, "--loss", "one_way", "--loss-dist-impl", "ring"]) == 2
    assert "--loss-dist-impl 'ring': choose one of gather for the one-way loss" in capsys.readouterr().err
    assert len(made) == 1 and len(made[0].values) == 1  # the run's loss is the family's module
    assert step_losses(run_dir)[1] == pytest.approx(made[0].values[0], rel=1e-6)
    assert "one_way" not in LOSSES


# ------------------------------------------------------------------------------ recipe: an image tower
class PoolTower(nn.Module):
    """The smallest tower of the contract (model/towers.py): mean colour -> embedding; no transformer blocks."""

    def __init__(self, embed_dim: int, image_size: int, width: int):
        super().__init__()
        self.image_size, self.width = (image_size, image_size), width
        self.proj = nn.Linear(3, embed_dim)
        self.blocks = []
        self.description = "pool"

    def forward(self, images):
        return self.proj(images.mean(dim=(2, 3)))

    def activation_shape(self):
        return None

    def set_grad_checkpointing(self, every: int) -> None:
        pass

    def init_weights(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        self.requires_grad_(False)


def test_recipe_an_image_tower_kind(tmp_path):
    arch = get_model_config("test-tiny")
    arch["vision_cfg"] = {"pool_tower": True, "image_size": 16, "width": 3}
    model_dir = tmp_path / "pool-model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": arch, "preprocess_cfg": {}}))
    kind = ImageTowerKind(
        claims=lambda v: "pool_tower" in v,
        build=lambda embed_dim, v, quick_gelu, size: PoolTower(embed_dim, size or v["image_size"], v["width"]),
        described_as="a pooling image tower",
    )
    with registered(IMAGE_TOWERS, "pool", kind):
        run_dir = train(tmp_path, "tower", "--model", f"local-dir:{model_dir}")
        facts = model_facts(f"local-dir:{model_dir}")
        with pytest.raises(UserError, match="has a pooling image tower, which bigclip does not give layer scale"):
            create_model(f"local-dir:{model_dir}", layer_scale_init=0.1)
    # no formula for it, so its forward is traced (memory/traced.py): the Linear keeps its 3-value input per sample
    assert facts.uncounted is None and len(facts.towers) == 1  # the text transformer's
    assert [(t.outside.values, t.outside.fixed, t.blocks) for t in facts.traced] == [(3.0, 0.0, ())]
    assert math.isfinite(step_losses(run_dir)[1])


# ------------------------------------------------------------------------------- recipe: a data source
class SolidColours(torch.utils.data.Dataset):
    def __init__(self, n: int, size, tokenizer):
        self.n, self.size, self.tokens = n, size, tokenizer([f"colour {i}" for i in range(n)])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, *self.size), i / self.n), self.tokens[i]


def build_solid(cfg, split, ctx):
    dataset = SolidColours(split.num_samples or 16, ctx.geometry["size"], ctx.tokenizer)
    sampler = batch_sampler(cfg, len(dataset), split.train, ctx)
    return map_style_loader(dataset, sampler, cfg.workers, None, "--train-num-samples", cfg, ctx)


def test_recipe_a_data_source(tmp_path):
    # it reads --train-num-samples and --workers, which not every kind does
    solid = DataSource(build_solid, needs_path=False, flags=("train_num_samples", "workers"))
    with registered(DATA_SOURCES, "solid", solid):
        run_dir = train(tmp_path, "data", "--dataset-type", "solid")
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["samples_seen"] for r in records] == [8]
    assert json.load(open(os.path.join(run_dir, "checkpoints", "epoch_1", "manifest.json")))["step"] == 1


# ------------------------------------------------------------------------------------ recipe: an engine
class PlainEngine(TorchOptimizerEngine):
    """The bare model in one process (no wrapper): the smallest engine of the contract."""

    name = "plain"
    help = "the bare model, one process"

    @classmethod
    def memory_setups(cls):
        return {cls.name: MemorySetup(lambda psi, n, recipe, size: 16 * psi, flags={"engine": cls.name})}

    def __init__(self, cfg, model, world):
        super().__init__(cfg, model, world)
        self.model = self.module = model.to(world.device)
        self.optimizer = optim.create_optimizer(cfg.optimizer, optim.param_groups(model, cfg.optimizer))
        self.scaler = None
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]


def test_recipe_an_engine(tmp_path, capsys):
    with registered(ENGINES, PlainEngine.name, PlainEngine, help=PlainEngine.help):
        run_dir = train(tmp_path, "engine", "--engine", "plain")
        resumed = train(
            tmp_path, "engine2", "--engine", "plain", "--resume", os.path.join(run_dir, "checkpoints", "epoch_1")
        )
        assert cli.main(["--model", "test-tiny", "--engine", "plain", "--dry-run"]) == 0
        table = render_plan(["test-tiny"], [2], [1.0], 4, "amp")
    assert "engine plain" in capsys.readouterr().out
    assert "| plain |" in table and "| ddp |" in table
    assert json.load(open(os.path.join(run_dir, "checkpoints", "epoch_1", "manifest.json")))["engine"] == "plain"
    assert os.path.isdir(resumed)


# ------------------------------------------------------------------------- recipe: schedule and optimizer
def test_recipe_a_schedule_and_an_optimizer(tmp_path):
    sgd = OptimizerKind(lambda cfg, groups: torch.optim.SGD(groups, lr=optim.hyperparameters(cfg)["lr"]))
    halved = lambda cfg, steps_per_epoch: lambda step: 0.5 * (cfg.lr or optim.DEFAULT_LR)  # noqa: E731
    with registered(OPTIMIZERS, "plain_sgd", sgd), registered(SCHEDULES, "half", halved):
        run_dir = train(tmp_path, "opt", "--opt", "plain_sgd", "--lr-scheduler", "half", "--lr", "0.01")
    record = next(r for r in read_metrics(run_dir) if "loss" in r)
    assert record["lr"] == pytest.approx(0.005)
    assert "plain_sgd" not in OPTIMIZERS and "half" not in SCHEDULES


def test_help_lists_exactly_the_subcommands_the_dispatch_runs(capsys, tmp_path, monkeypatch):
    """`bigclip --help` and the dispatch both read COMMANDS: no command can be runnable but unlisted."""
    from bigclip.commands import COMMANDS

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    listed = out[out.index("subcommands:") :].splitlines()[1:]
    shown = {line.split()[1].strip("[]") for line in listed if line.startswith("  bigclip ")}
    expected = {"train", "eval", "models", "export", "fetch", "plan", "generate", "report"}
    assert shown == set(COMMANDS.names()) == expected
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its parameter counts' cache (tests/test_models_command.py)
    assert cli.main(["models", "ViT-B-32"]) == 0 and "ViT-B-32" in capsys.readouterr().out
