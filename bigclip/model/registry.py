"""Where architectures come from: bigclip's JSON files in `configs/`, OpenCLIP's own config files (every
architecture open_clip_torch lists that bigclip has no file of, read from the installed package; then the ones only
OpenCLIP's main branch has, kept verbatim in `configs/openclip_main/`, whose README names their commit), and
OpenCLIP's two schemas.

    ViT-B-32                a built-in config (`configs/ViT-B-32.json`, else open_clip's
                            `model_configs/ViT-B-32.json`); a `-quickgelu` suffix names the same
                            architecture with QuickGELU
    local-dir:DIR           DIR/open_clip_config.json, as OpenCLIP writes it ({"model_cfg": …, "preprocess_cfg":
                            …}); the weights OpenCLIP keeps beside it are the model's weights (model/pretrained.py)
    hf-hub:ORG/NAME         the same file of a Hugging Face hub repository, read from --cache-dir (the hub's
                            cache layout; also offline, HF_HUB_OFFLINE=1). Flag validation only reads that cache;
                            the file is fetched into it where the model is built (build.py: once per node) or
                            ahead of a run by `bigclip fetch`

A model's image preprocessing is OpenCLIP's defaults (OpenAI mean/std, bicubic, shortest-side resize) with a
schema's preprocess_cfg, or a --pretrained tag's entry in OpenCLIP's registry, on top, as open_clip.create_model
merges them (preprocess_cfg).
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import os
from functools import cache
from pathlib import Path

from bigclip.errors import UserError

CONFIG_DIR = Path(__file__).parent / "configs"
# OpenCLIP main's configs that open_clip_torch 3.3 lacks (copied from the repository; not on PyPI)
MAIN_CONFIG_DIR = CONFIG_DIR / "openclip_main"
QUICKGELU_SUFFIX = "-quickgelu"
LOCAL_DIR_PREFIX, HF_HUB_PREFIX = "local-dir:", "hf-hub:"
CONFIG_NAME = "open_clip_config.json"  # OpenCLIP's name for it, in a directory and in a hub repository
# Keys of a built-in vision_cfg that describe preprocessing, not the network.
PREPROCESS_KEYS = ("image_mean", "image_std")
# OpenCLIP's PreprocessCfg defaults: what a schema's preprocess_cfg is merged onto.
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_PREPROCESS_DEFAULTS = {
    "mean": OPENAI_MEAN,
    "std": OPENAI_STD,
    "interpolation": "bicubic",
    "resize_mode": "shortest",
    "fill_color": 0,
}


@cache
def _load_configs() -> dict[str, dict]:
    """bigclip's own configs, then every OpenCLIP architecture bigclip has no file of: OpenCLIP's own config
    files, read from the installed open_clip_torch (found without importing it, which takes seconds), then those only
    OpenCLIP's main branch has (configs/openclip_main/)."""
    configs = {path.stem: json.loads(path.read_text()) for path in sorted(CONFIG_DIR.glob("*.json"))}
    for folder in (openclip_config_dir(), MAIN_CONFIG_DIR):
        for path in sorted(folder.glob("*.json")) if folder else ():
            configs.setdefault(path.stem, json.loads(path.read_text()))
    return configs


def config_source(name: str) -> str:
    """Where built-in architecture `name`'s file comes from: "bigclip" (configs/), "open_clip_torch" (the installed
    package) or "OpenCLIP main" (configs/openclip_main/)."""
    base = name.removesuffix(QUICKGELU_SUFFIX)
    if (CONFIG_DIR / f"{base}.json").exists():
        return "bigclip"
    installed = openclip_config_dir()
    return "open_clip_torch" if installed and (installed / f"{base}.json").exists() else "OpenCLIP main"


@cache
def openclip_config_dir() -> Path | None:
    """open_clip_torch's model_configs/ folder, or None where open_clip_torch is not installed."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model_configs"
    return folder if folder.is_dir() else None


def is_openclip_config(name: str) -> bool:
    """Whether architecture `name` comes from OpenCLIP's files rather than bigclip's own configs/."""
    base = name.removesuffix(QUICKGELU_SUFFIX)
    return not (CONFIG_DIR / f"{base}.json").exists() and base in _load_configs()


def list_models() -> list[str]:
    """The built-in architectures (local-dir: and hf-hub: names are accepted besides these)."""
    return list(_load_configs())


def unknown_architecture(flag: str, name: str, quoted: bool = False) -> str:
    """The one line for an architecture name nobody has: the flag, the name (`quoted` as the flag checks quote
    values), a few close names (the zoo holds ~180, too many for one line) and where the whole list is."""
    by_lower = {model.lower(): model for model in list_models()}  # vit-b-32 means ViT-B-32 first
    close = [by_lower[m] for m in difflib.get_close_matches(name.lower(), by_lower, n=3, cutoff=0.6)]
    hint = f"did you mean {', '.join(close)}? " if close else ""
    shown = repr(name) if quoted else name
    where = "`bigclip models` lists them all (or local-dir:DIR / hf-hub:ORG/NAME)"
    return f"{flag} {shown}: unknown architecture; {hint}{where}"


def parse_model_name(name: str) -> tuple[str | None, str]:
    """(schema, identifier): ('local-dir', DIR), ('hf-hub', ORG/NAME) or (None, name), as OpenCLIP parses it."""
    for schema, prefix in (("local-dir", LOCAL_DIR_PREFIX), ("hf-hub", HF_HUB_PREFIX)):
        if name.startswith(prefix):
            identifier = name[len(prefix) :]
            if not identifier:
                what = "a directory" if schema == "local-dir" else "a repository, ORG/NAME"
                raise UserError(f"--model {name}: nothing after '{prefix}'; name {what}")
            return schema, identifier
    return None, name


def is_schema_name(name: str) -> bool:
    """Whether `name` is a local-dir: or hf-hub: source rather than a built-in architecture."""
    return name.startswith((LOCAL_DIR_PREFIX, HF_HUB_PREFIX))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def hub_problem(problem: Exception | None, local_files_only: bool = False) -> str:
    """Why a hub file could not be had, in words, for one-line errors."""
    offline = local_files_only or hub_offline()
    how = "the cache holds no copy and downloads are off (HF_HUB_OFFLINE)" if offline else "the download failed"
    return f"{how} ({type(problem).__name__})"


def hub_cache_dir(cache_dir: str | None) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE  # slow to import; only hub sources need it

    return cache_dir or HF_HUB_CACHE


def check_hub_name(name: str) -> str:
    """The ORG/NAME of an hf-hub: name, its form checked (the hub's own rule for repository names); reads nothing."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    _, repo_id = parse_model_name(name)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserError(
            f"--model {name}: not a Hugging Face hub repository name; pass hf-hub:ORG/NAME (letters, digits, '-', "
            f"'_' and '.')"
        ) from None
    return repo_id


def cached_hub_config(repo_id: str, cache_dir: str | None) -> str | None:
    """The open_clip_config.json of `repo_id` in the hub cache (its main revision), or None where the cache holds
    none: a read of the cache only, no network and nothing written (what flag validation may do)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, CONFIG_NAME, cache_dir=cache_dir)
    return found if isinstance(found, str) else None  # None, or the hub's marker of a file known to be absent


@cache
def fetch_hub_config(repo_id: str, cache_dir: str | None) -> str:
    """Fetch the open_clip_config.json of `repo_id` into the hub cache (or find it there under HF_HUB_OFFLINE=1)
    and return its path; once per process (failures are not remembered). Called where the model is built
    (build.py: one process per node) and by `bigclip fetch`, never by flag validation."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, CONFIG_NAME, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 — offline, missing repo or file, network: one line
        raise UserError(
            f"--model hf-hub:{repo_id}: {CONFIG_NAME} of {repo_id} on the Hugging Face hub could not be had: "
            f"{hub_problem(e)}; cache directory {hub_cache_dir(cache_dir)}. Check the name, and fetch it where the hub "
            f"is reachable (`bigclip fetch --model hf-hub:{repo_id}`, same --cache-dir), or pass --model local-dir:DIR"
        ) from None


def _hub_config_path(repo_id: str, cache_dir: str | None, local_files_only: bool = False) -> str:
    """The cached open_clip_config.json of `repo_id`: the cache's copy when it has one, else fetched into it
    (UserError instead when local_files_only)."""
    path = cached_hub_config(repo_id, cache_dir)
    if path is not None:
        return path
    if local_files_only:
        raise UserError(
            f"--model hf-hub:{repo_id}: the hub cache {hub_cache_dir(cache_dir)} holds no {CONFIG_NAME} of "
            f"{repo_id} yet; the run fetches it when it builds the model, or fetch it ahead with "
            f"`bigclip fetch --model hf-hub:{repo_id}` (same --cache-dir)"
        )
    return fetch_hub_config(repo_id, cache_dir)


def config_file(name: str, cache_dir: str | None = None, local_files_only: bool = False) -> str:
    """The open_clip_config.json a local-dir: or hf-hub: name points at: an hf-hub: one from the hub cache, fetched
    into it first where the cache has none (never when local_files_only)."""
    schema, identifier = parse_model_name(name)
    if schema == "hf-hub":
        return _hub_config_path(check_hub_name(name), cache_dir, local_files_only)
    if not os.path.isdir(identifier):
        raise UserError(f"--model {name}: {identifier} is not a directory; pass local-dir:DIR with {CONFIG_NAME}")
    path = os.path.join(identifier, CONFIG_NAME)
    if not os.path.isfile(path):
        raise UserError(f"--model {name}: no {CONFIG_NAME} in {identifier}; OpenCLIP writes one beside its weights")
    return path


def config_at_hand(name: str, cache_dir: str | None = None) -> bool:
    """Whether `name`'s config can be read without fetching anything: a built-in, a local-dir:, or an hf-hub: name
    whose config the hub cache holds. Flag validation reads only what is at hand (it has no side effects); an
    hf-hub: config that is not is checked where the model is built, which fetches it first (build.py)."""
    return parse_model_name(name)[0] != "hf-hub" or cached_hub_config(check_hub_name(name), cache_dir) is not None


def open_clip_config(name: str, cache_dir: str | None = None, local_files_only: bool = False) -> dict:
    """The whole open_clip_config.json of a local-dir: or hf-hub: name, checked: {"model_cfg", "preprocess_cfg"}."""
    path = config_file(name, cache_dir, local_files_only)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"--model {name}: {path} is not valid JSON (line {e.lineno}: {e.msg}); fix the file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--model {name}: {path} is unreadable ({type(e).__name__}); fix the file") from None
    model_cfg = data.get("model_cfg") if isinstance(data, dict) else None
    keys = model_cfg if isinstance(model_cfg, dict) else {}
    missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if k not in keys]
    if missing:
        raise UserError(
            f"--model {name}: {path} has no model_cfg with embed_dim, vision_cfg and text_cfg "
            f'(missing {", ".join(missing)}); OpenCLIP\'s files hold {{"model_cfg": …, "preprocess_cfg": …}}'
        )
    preprocess = data.get("preprocess_cfg") or {}
    if not isinstance(preprocess, dict):
        raise UserError(f"--model {name}: {path}: preprocess_cfg must be a mapping; fix the file")
    return {"model_cfg": model_cfg, "preprocess_cfg": preprocess}


def get_model_config(name: str, cache_dir: str | None = None, local_files_only: bool = False) -> dict:
    """A copy of the architecture config `name` (OpenCLIP's JSON layout): a built-in, local-dir:DIR or
    hf-hub:ORG/NAME (cache_dir: the hub cache for the latter; read from it, fetched into it first where it holds
    none, UserError instead when local_files_only).

    As in OpenCLIP, a `-quickgelu` suffix names the same built-in architecture with QuickGELU.
    """
    if is_schema_name(name):
        return copy.deepcopy(open_clip_config(name, cache_dir, local_files_only)["model_cfg"])
    configs = _load_configs()
    base = name.removesuffix(QUICKGELU_SUFFIX)
    if base not in configs:
        raise UserError(unknown_architecture("--model", name))
    cfg = copy.deepcopy(configs[base])
    if base != name:
        cfg["quick_gelu"] = True
    return cfg


def openclip_separate_text(model_cfg: dict, force_custom_text: bool = False) -> bool:
    """Whether OpenCLIP builds this architecture as CustomTextCLIP, whose text tower's weights are under
    `text.` (its create_model: the config's custom_text, --force-custom-text, a Hugging Face text tower, main's
    modern text tower or variable-length text, or CoCa), rather than at the top level as CLIP keeps them: the
    layout an export must write."""
    text_cfg = model_cfg.get("text_cfg", {})
    return bool(
        model_cfg.get("custom_text")
        or force_custom_text
        or "hf_model_name" in text_cfg
        or text_cfg.get("text_arch") == "modern"
        or text_cfg.get("variable_text")
        or "multimodal_cfg" in model_cfg
    )


def is_timm_tower(model_cfg: dict) -> bool:
    """Whether the architecture's image tower is a timm model (OpenCLIP's TimmModel)."""
    return "timm_model_name" in model_cfg.get("vision_cfg", {})


def _pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    height, width = size
    return (int(height), int(width))


def preprocess_cfg(
    model_name: str,
    image_size: int | tuple[int, int] | None = None,
    cache_dir: str | None = None,
    pretrained: str | None = None,
) -> dict:
    """What the data side needs to build image transforms for `model_name`: size, mean, std, interpolation,
    resize_mode, fill_color, as open_clip.create_model settles them.

    OpenCLIP's PreprocessCfg defaults (OpenAI mean/std, bicubic, shortest-side resize, black fill), then a schema's
    preprocess_cfg or a bigclip config's image_mean/image_std, then a pretrained tag's own preprocessing
    (`pretrained`: OpenCLIP's registry entry for the tag, e.g. SigLIP's squash resize and 0.5 mean/std, CLIPA's and
    PE's bilinear squash, MobileCLIP's 0/1 normalisation: what the weights were trained with; a weights file or
    None adds nothing, as in OpenCLIP). `size` is (height, width): the tower's image size (224 where the config
    names none, OpenCLIP's default); `image_size` overrides it (--force-image-size).
    """
    out = dict(_PREPROCESS_DEFAULTS)
    if is_schema_name(model_name):
        source = open_clip_config(model_name, cache_dir)
        vision = source["model_cfg"]["vision_cfg"]
        out.update({k: v for k, v in source["preprocess_cfg"].items() if k in _PREPROCESS_DEFAULTS and v is not None})
    else:
        vision = get_model_config(model_name)["vision_cfg"]
        out.update(
            {key: vision[name] for key, name in (("mean", "image_mean"), ("std", "image_std")) if name in vision}
        )
        if pretrained and not os.path.isfile(pretrained):
            out.update(_pretrained_preprocess(model_name, pretrained))
    size = image_size if image_size is not None else vision.get("image_size", 224)
    return {**out, "size": _pair(size), "mean": tuple(out["mean"]), "std": tuple(out["std"])}


def _pretrained_preprocess(model_name: str, tag: str) -> dict:
    """The preprocessing OpenCLIP's registry records for a pretrained tag (open_clip.get_pretrained_cfg); {} for a
    tag it does not know (flag validation names those)."""
    import open_clip  # slow to import; only a --pretrained tag needs its registry

    cfg = open_clip.get_pretrained_cfg(model_name, tag) or {}
    return {k: v for k, v in cfg.items() if k in _PREPROCESS_DEFAULTS and v is not None}


# OpenCLIP's preference among the weights files of a local-dir: source (open_clip.factory._find_checkpoint_in_dir).
_PREFERRED_WEIGHTS = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
    "model.safetensors",
    "pytorch_model.bin",
    "pytorch_model.pth",
    "model.pth",
)


def local_dir_weights(directory: str) -> str | None:
    """The weights file OpenCLIP loads from a local-dir: source: a preferred name first, else the first
    .safetensors, then .bin/.pth file by name; None when the directory holds none."""
    found = [p for ext in ("*.safetensors", "*.bin", "*.pth") for p in Path(directory).glob(ext)]
    if not found:
        return None
    preferred = [p for p in found if p.name in _PREFERRED_WEIGHTS]
    if preferred:
        return str(min(preferred, key=lambda p: _PREFERRED_WEIGHTS.index(p.name)))
    return str(sorted(sorted(found), key=lambda p: p.suffix != ".safetensors")[0])
