"""`bigclip fetch --model M [--pretrained TAG] [--pretrained-image] [--cache-dir DIR]`: fetch into the Hugging Face
hub cache what a run with these flags reads from the hub, ahead of the run.

For a cluster whose jobs reach no network: run it where the hub is reachable (a login node), with the --cache-dir
the job will use, then start the job with HF_HUB_OFFLINE=1. It fetches what the run would fetch, with the run's own
code (build.py): an hf-hub:ORG/NAME --model's open_clip_config.json, then the weights the run loads (a --pretrained
tag's file, else the hf-hub: repository's own weights) and, for --pretrained-image, timm's trunk weights where no
whole-model weights replace them, and the Hugging Face tokenizer the architecture's text_cfg names
(hf_tokenizer_name: SigLIP's, CLIPA's, the worldwide models'), or the tiktoken encoding it names (OpenCLIP main's
modern text models: tiktoken_name, into --cache-dir's `tiktoken/` folder, where the job's tokenizer looks unless
TIKTOKEN_CACHE_DIR says otherwise). Every large file's SHA-256 is checked. With HF_HUB_OFFLINE=1 it fetches nothing
from the hub and checks that the cache holds all of it. A Hugging Face text tower's model
files (text_cfg hf_model_name) are not fetched: transformers keeps them in its own cache
(`huggingface-cli download NAME`).
"""

from __future__ import annotations

from bigclip.build import fetch_model_configs, pretrained_image_weights, pretrained_weights
from bigclip.commands import COMMANDS, Command
from bigclip.dist import World
from bigclip.errors import OneLineErrorParser, UserError
from bigclip.model.config import ModelConfig, check_model
from bigclip.model.factory import get_tokenizer
from bigclip.model.pretrained import is_local_weights
from bigclip.model.registry import CONFIG_NAME, HF_HUB_PREFIX, config_file, get_model_config, hub_cache_dir
from bigclip.model.tiktoken_tokenizer import cache_path
from bigclip.model.tokenizer import hub_tokenizer, tiktoken_encoding


def _parser() -> OneLineErrorParser:
    p = OneLineErrorParser(prog="bigclip fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the run's --model (hf-hub:ORG/NAME: its config and weights)")
    p.add_argument("--pretrained", default=None, help="the run's --pretrained: a pretrained tag of --model")
    p.add_argument("--pretrained-image", action="store_true", help="the run's --pretrained-image: timm's trunk weights")
    p.add_argument("--cache-dir", default=None, help="the run's --cache-dir (default: the hub's own, HF_HUB_CACHE)")
    return p


def fetch(cfg: ModelConfig) -> list[str]:
    """Fetch what a run with these model flags reads from the hub into its cache; one line per file (its path)."""
    hub_model = cfg.model.startswith(HF_HUB_PREFIX)
    tag = cfg.pretrained is not None and not is_local_weights(cfg.pretrained)
    # (a built-in architecture's config is at hand: whether its tokenizer comes from the hub is known now)
    config = None if hub_model else get_model_config(cfg.model, cfg.cache_dir)
    tokenizer = config and (hub_tokenizer(cfg.model, config) or tiktoken_encoding(cfg.model, config))
    if not (hub_model or tag or cfg.pretrained_image or tokenizer):
        raise UserError(
            f"bigclip fetch: --model {cfg.model} reads nothing from the Hugging Face hub; name an hf-hub:ORG/NAME "
            f"--model, a --pretrained tag of it, --pretrained-image, or an architecture whose tokenizer the hub holds"
        )
    world = World()  # one process: what a run's local rank 0 fetches for its node
    check_model(cfg)  # the flags as a run validates them (an hf-hub: name's form; a tag --model has)
    fetch_model_configs(cfg, world)  # an hf-hub: config, then every check on it
    lines = [f"--model {cfg.model}: {CONFIG_NAME} {config_file(cfg.model, cfg.cache_dir, True)}"] if hub_model else []
    config = get_model_config(cfg.model, cfg.cache_dir, local_files_only=True)
    tokenizer, encoding = hub_tokenizer(cfg.model, config), tiktoken_encoding(cfg.model, config)
    if tokenizer is not None or encoding is not None:
        get_tokenizer(cfg.model, cache_dir=cfg.cache_dir)  # what the run's data pipeline loads, the same way
    if tokenizer is not None:
        lines.append(f"--model {cfg.model}: tokenizer {tokenizer} (text_cfg hf_tokenizer_name)")
    if encoding is not None:
        lines.append(f"--model {cfg.model}: tiktoken encoding {encoding} {cache_path(encoding, cfg.cache_dir)}")
    weights = pretrained_weights(cfg, world)
    if weights is not None and weights != cfg.pretrained:
        lines.append(f"--{'pretrained' if cfg.pretrained else 'model'} weights {weights}")
    elif hub_model and cfg.pretrained is None:
        lines.append(f"--model {cfg.model}: the repository holds no weights (a run starts from a random init)")
    image_weights = pretrained_image_weights(cfg, world, weights)
    if image_weights is not None:
        lines.append(f"--pretrained-image weights {image_weights}")
    return [*lines, f"cache directory {hub_cache_dir(cfg.cache_dir)}"]


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = ModelConfig(
        model=args.model, pretrained=args.pretrained, pretrained_image=args.pretrained_image, cache_dir=args.cache_dir
    )
    for line in fetch(cfg):
        print(line, flush=True)
    return 0


COMMANDS.register(
    "fetch",
    Command(main, "bigclip fetch --model M [--pretrained TAG]"),
    help="fetch an hf-hub: --model's config and weights, or a --pretrained tag, into --cache-dir ahead of a run",
)
