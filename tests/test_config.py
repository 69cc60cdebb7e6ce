"""Config precedence (defaults < demo preset < YAML < flags) and every user-facing error message."""

import pytest

from bigclip import cli
from bigclip.config import DEMO_PRESET, TrainConfig, resolve
from bigclip.errors import UserError


def parse(*argv):
    cfg, _ = cli.parse_train_args(list(argv))
    return cfg


def test_openclip_defaults_when_data_is_given(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("filepath\ttitle\n")
    cfg = parse("--train-data", str(csv), "--model", "test-tiny")
    assert not cfg.demo
    defaults = TrainConfig()
    for name in (
        "batch_size",
        "epochs",
        "warmup",
        "wd",
        "precision",
        "workers",
        "lr_scheduler",
        "save_frequency",
        "zeroshot_frequency",
        "log_every_n_steps",
        "csv_separator",
        "logs",
    ):
        assert getattr(cfg, name) == getattr(defaults, name), name
    assert (defaults.batch_size, defaults.epochs, defaults.warmup, defaults.precision) == (64, 32, 10000, "amp")
    assert defaults.model == "RN50" and defaults.csv_img_key == "filepath" and defaults.csv_caption_key == "title"


def test_no_flags_is_the_demo():
    cfg = parse()
    assert cfg.demo and cfg.model == DEMO_PRESET["model"] and cfg.epochs == DEMO_PRESET["epochs"]


def test_precedence_defaults_yaml_flags(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("batch-size: 16\nepochs: 3\nlr: 0.01\nmodel: test-tiny\n")
    cfg = parse("--config", str(yaml_file), "--epochs", "5", "--dataset-type", "synthetic")
    assert cfg.batch_size == 16  # YAML over default
    assert cfg.epochs == 5  # flag over YAML
    assert cfg.lr == 0.01
    assert cfg.warmup == 10000  # untouched default
    # The demo preset applies only where neither YAML nor flags spoke.
    cfg = parse("--config", str(yaml_file))
    assert cfg.demo and cfg.batch_size == 16 and cfg.epochs == 3 and cfg.warmup == DEMO_PRESET["warmup"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "EVA02-E14"], "--model 'EVA02-E14': unknown architecture; did you mean EVA02-E-14"),
        (["--batch-size", "-4"], "--batch-size -4: must be a positive integer"),
        (["--precision", "fp8"], "--precision 'fp8': choose one of amp"),
        (
            ["--model", "test-tiny", "--train-data", "s3://b/{a,b}-0.tar", "--train-data-upsampling-factors", "1::2"],
            "--train-data-upsampling-factors: only applies when sampling with replacement; add --dataset-resampled",
        ),
        (
            ["--model", "test-tiny", "--train-data", "/nonexistent/train.csv"],
            "--train-data '/nonexistent/train.csv': '/nonexistent/train.csv' does not exist",
        ),
        (["--pretrained", "/nonexistent/w.pt"], "--pretrained '/nonexistent/w.pt': file not found"),
        (["--resume", "/nonexistent/ckpt"], "--resume '/nonexistent/ckpt': not found"),
        (["--lr-scheduler", "linear"], "--lr-scheduler 'linear': choose one of cosine"),
        (["--lr-scheduler", "const-cooldown"], "--lr-scheduler const-cooldown needs --epochs-cooldown"),
        (["--opt", "sgd"], "--opt 'sgd': choose adamw or timm/<optimizer name>"),
        (["--report-to", "mlflow"], "--report-to 'mlflow': use tensorboard, wandb"),
        (["--horovod"], "--horovod: not supported yet"),
        (["--coca-caption-loss-weight", "-1"], "--coca-caption-loss-weight -1.0: must be"),
        (
            ["--model", "test-tiny-coca", "--siglip"],
            "--model: CoCa's loss adds its caption term to the CLIP loss, not to the SigLIP loss",
        ),
        (["--imagenet-val", "/nonexistent/imagenet"], "--imagenet-val /nonexistent/imagenet: not a directory"),
        (["--batch-size", "abc"], "argument --batch-size: invalid int value: 'abc'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--force-patch-dropout", "1.5"], "--force-patch-dropout 1.5: must be in [0, 1)"),
        (["--loss-impl", "magic"], "--loss-impl 'magic': choose one of"),
        (["--aug-cfg", "scale=0.5::1.0", "sharpness=2"], "--aug-cfg"),
        # OpenCLIP main's families of models bigclip does not train: refused by name, not "unrecognized"
        (["--use-naflex"], "--use-naflex: NaFlex (variable image resolution and text length) is not supported"),
        (["--naflex-seq-lens", "256", "576"], "--naflex-seq-lens: NaFlex"),
        (["--bucket-pool=4"], "--bucket-pool: NaFlex"),
        (["--audio-fusion"], "--audio-fusion: audio towers (CLAP) are not supported"),
        (["--pretrained-audio", "x"], "--pretrained-audio: audio towers"),
        (
            ["--dataset-type", "synthetic-audio"],
            "--dataset-type synthetic-audio: audio towers (CLAP) are not supported",
        ),
        (["--fsdp-checkpoint", "whole"], "--fsdp-checkpoint 'whole': choose one of sharded, full"),
        (["--fsdp", "--ds_config", "ds_configs/zero2.json"], "--fsdp selects the fsdp engine but --ds_config"),
        (["--fsdp", "--engine", "ddp"], "--fsdp selects the fsdp engine but --engine is ddp"),
        (["--text-layer-decay", "1.2"], "--text-layer-decay 1.2: must be in (0, 1]"),
        (["--torchcompile", "--torchcompile-backend", "nope"], "--torchcompile-backend nope: torch.compile has no"),
        # a flag of bigclip's own where it does nothing (OpenCLIP's warn instead: tests/test_flag_matrix.py)
        (["--storage-timeout", "5"], "--storage-timeout: only applies with a remote store"),
        (["--torchcompile", "--torchcompile-mode", "bogus"], "--torchcompile-mode bogus: Unrecognized mode"),
        (["--torchcompile-strategy", "task"], "--torchcompile-strategy: not supported yet"),
        (["--log-metric-every-n-steps", "0"], "--log-metric-every-n-steps 0: must be a positive integer"),
        (["--ema-decay", "1.5"], "--ema-decay 1.5: must be between 0 and 1"),
        (["--eval-ema"], "--eval-ema: there is no moving average to evaluate without --ema-decay"),
        (["--ema-warmup"], "--ema-warmup: only applies with --ema-decay"),
    ],
)
def test_bad_values_fail_with_one_line(argv, expected, capsys, tmp_path):
    logs = tmp_path / "logs"
    code = cli.main([*argv, "--logs", str(logs)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err  # exactly one line
    assert expected in err, err
    assert not logs.exists()  # refused before anything was written


def test_yaml_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 3\nbatch-size: [1\n")
    with pytest.raises(UserError, match=r"--config .*bad.yaml: not valid YAML \(line \d+\)"):
        resolve({"config": str(bad)})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("epochz: 3\n")
    with pytest.raises(UserError, match="unknown option 'epochz'"):
        resolve({"config": str(unknown)})
    with pytest.raises(UserError, match="--config .*missing.yaml: file not found"):
        resolve({"config": str(tmp_path / "missing.yaml")})


def test_yaml_values_are_validated_too(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("precision: fp9\n")
    with pytest.raises(UserError, match="--precision 'fp9'"):
        resolve({"config": str(f)})


def test_help_is_grouped(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for group in (
        "data:",
        "model:",
        "training:",
        "precision and memory:",
        "loss:",
        "checkpoints:",
        "logging:",
        "evaluation:",
        "distributed:",
    ):
        assert group in out
    assert "--accum-freq" in out and "--local-loss" in out and "not supported yet" in out
    # defaults as values (--aug-cfg's, a factory's, had shown as "<dataclasses._MISSING_TYPE object at 0x...>")
    flat = " ".join(out.split())  # argparse wraps lines
    assert "object at 0x" not in flat and "(default: 'filepath')" in flat


def test_every_openclip_flag_of_the_reference_exists():
    # The flag reference users know; each must parse (supported ones) or be rejected by name.
    names = (
        "train-data val-data train-num-samples val-num-samples dataset-type dataset-resampled csv-separator "
        "csv-img-key csv-caption-key train-data-upsampling-factors model pretrained pretrained-image "
        "force-image-size force-context-length force-patch-dropout force-quick-gelu force-custom-text "
        "batch-size epochs accum-freq lr warmup lr-scheduler epochs-cooldown lr-cooldown-end "
        "lr-cooldown-power opt beta1 beta2 eps wd momentum grad-clip-norm precision grad-checkpointing "
        "local-loss gather-with-grad workers image-mean image-std image-interpolation image-resize-mode "
        "aug-cfg lock-image lock-image-unlocked-groups lock-image-freeze-bn-stats lock-text "
        "lock-text-unlocked-layers lock-text-freeze-layer-norm save-frequency save-most-recent "
        "delete-previous-checkpoint resume logs name report-to log-every-n-steps wandb-project-name "
        "wandb-notes imagenet-val imagenet-v2 zeroshot-frequency val-frequency "
        "coca-contrastive-loss-weight coca-caption-loss-weight dist-url dist-backend horovod "
        "ddp-static-graph use-bn-sync torchcompile torchscript trace distill-model distill-pretrained "
        "siglip loss-dist-impl remote-sync remote-sync-frequency remote-sync-protocol use-bnb-linear "
        "seed device cache-dir debug log-local copy-codebase"
    ).split()
    parser = cli.build_train_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    missing = [n for n in names if f"--{n}" not in known]
    assert not missing


def test_openclip_mains_engine_flags_are_bigclips(tmp_path):
    """An OpenCLIP-main launch line's FSDP flags run unchanged: --fsdp is --engine fsdp."""
    cfg = parse("--fsdp", "--fsdp-offload-cpu", "--fsdp-no-reshard-after-forward", "--fsdp-checkpoint", "sharded")
    assert cfg.sections.engine.engine == "fsdp" and cfg.sections.engine.engine_flags.fsdp_offload_cpu
    assert parse("--fsdp-checkpoint", "full").sections.checkpoint.fsdp_checkpoint == "full"  # any engine
    assert parse("--fsdp", "--engine", "fsdp").sections.engine.engine == "fsdp"
    assert parse("--visual-layer-decay", "0.5").sections.optimizer.image_layer_decay == 0.5
    yaml = tmp_path / "run.yaml"
    yaml.write_text("naflex-max-text-tokens: 64\n")
    with pytest.raises(UserError, match="naflex-max-text-tokens: NaFlex"):
        resolve({"config": str(yaml)})


# Every flag of OpenCLIP main's open_clip_train/params.py (4.2.0.dev, commit 89fb801).
OPENCLIP_MAIN_FLAGS = """
accum-freq audio-ext audio-fill audio-fusion audio-int16-normalize audio-layer-decay audio-multiprocessing-context
audio-trunc audio-zeroshot-audio-key audio-zeroshot-class-key audio-zeroshot-dataset
audio-zeroshot-multiprocessing-context audio-zeroshot-split audio-zeroshot-target-key audio-zeroshot-template
audio-zeroshot-workers aug-cfg batch-size beta1 beta2 bucket-chunk bucket-pool bucket-prefetch-pools cache-dir
coca-caption-loss-weight coca-contrastive-loss-weight copy-codebase csv-caption-key csv-img-key csv-separator
dataset-resampled dataset-type ddp-static-graph debug delete-previous-checkpoint device dist-backend dist-url
distill-model distill-pretrained epochs epochs-cooldown eps force-context-length force-custom-text force-image-size
force-naflex-vision force-patch-dropout force-quick-gelu fsdp fsdp-checkpoint fsdp-no-reshard-after-forward
fsdp-offload-cpu gather-with-grad grad-checkpointing grad-clip-norm image-interpolation image-key image-layer-decay
image-mean image-resize-mode image-std imagenet-v2 imagenet-val json-text-key json-text-key-probs length-bucketing
local-loss lock-image lock-image-freeze-bn-stats lock-image-unlocked-groups lock-text lock-text-freeze-layer-norm
lock-text-unlocked-layers log-every-n-steps log-local log-metric-every-n-steps logs loss-dist-impl lr lr-cooldown-end
lr-cooldown-power lr-scheduler max-image-pixels model momentum naflex-batch-divisor naflex-loss-scale
naflex-max-text-tokens naflex-max-tokens-per-batch naflex-num-train-image-tokens naflex-pad-multiple
naflex-patch-size-probs naflex-patch-sizes naflex-seq-len-probs naflex-seq-lens name no-set-device-rank opt
opt-fallback-list opt-kwargs precision pretrained pretrained-audio pretrained-image remote-sync remote-sync-frequency
remote-sync-protocol report-to resume save-frequency save-most-recent seed siglip skip-scheduler text-key
text-layer-decay text-pad-multiple text-pooler-own-group torchcompile torchcompile-backend torchcompile-mode
torchcompile-strategy train-data train-data-upsampling-factors train-loss-ema-samples train-num-samples use-bn-sync
use-bnb-linear use-naflex val-data val-frequency val-num-samples val-retrieval-chunk-size val-retrieval-precision
visual-layer-decay wandb-notes wandb-project-name warmup wd wd-exclude workers zeroshot-frequency
""".split()


def test_every_flag_of_openclip_main_exists_or_is_refused_by_name():
    """An OpenCLIP-main launch line either runs or stops with a line naming the flag and why (never argparse's
    bare "unrecognized arguments")."""
    from bigclip.config import refused_family

    parser = cli.build_train_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert [f for f in OPENCLIP_MAIN_FLAGS if f"--{f}" not in known and not refused_family(f"--{f}")] == []
