"""--pretrained: a local state dict, or one of OpenCLIP's pretrained tags fetched through the Hugging Face hub.

A tag (`--pretrained laion2b_s34b_b79k`) is looked up in OpenCLIP's own registry for the model
(open_clip.get_pretrained_cfg); its weights are fetched with huggingface_hub into --cache-dir (the hub's
cache layout; default: the hub's own cache) on first use and read from that cache afterwards, also with
HF_HUB_OFFLINE=1. The hub names every large file's blob by its SHA-256, and that hash is checked against the
bytes on disk before they are loaded, so a truncated or corrupted cache entry is refused, never loaded.

The same hub cache serves the weights of `--model hf-hub:ORG/NAME` (OpenCLIP's file names in that repository;
`local-dir:DIR` keeps them in DIR) and `--pretrained-image`: the ImageNet weights timm publishes for a timm
image tower's trunk (its default tag's repository, e.g. timm/resnet18.a1_in1k, file model.safetensors).
"""

from __future__ import annotations

import hashlib
import os
import re

from timm.models import get_pretrained_cfg
from timm.models._hub import hf_split

from bigclip.errors import UserError
from bigclip.model.registry import (
    get_model_config,
    hub_cache_dir,
    hub_problem,
    is_schema_name,
    is_timm_tower,
    local_dir_weights,
    parse_model_name,
)

# OpenCLIP's file names in a hub repository, preferred first (as open_clip's own download does).
HUB_FILENAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def pretrained_tags(model: str) -> list[str]:
    """OpenCLIP's pretrained tags for `model` (open_clip.list_pretrained_tags_by_model)."""
    import open_clip  # slow to import; only --pretrained TAG needs the registry

    return list(open_clip.list_pretrained_tags_by_model(model))


def is_local_weights(value: str) -> bool:
    return os.path.isfile(value)


def check_pretrained(model: str, value: str, flag: str = "--pretrained", model_flag: str = "--model") -> None:
    """Flag validation: a file that exists, or a tag OpenCLIP has for this model."""
    if is_local_weights(value):
        return
    tags = [] if is_schema_name(model) else pretrained_tags(model)
    if value in tags:
        return
    known = f"OpenCLIP's tags for {model}: {', '.join(tags)}" if tags else f"OpenCLIP has no tags for {model}"
    if os.sep in value or value.endswith((".pt", ".pth", ".bin", ".safetensors")):
        raise UserError(f"{flag} {value!r}: file not found; pass a local .pt/.bin/.safetensors file ({known})")
    raise UserError(f"{flag} {value!r}: not a file, and not a pretrained tag of {model_flag} {model} ({known})")


def resolve_pretrained(
    model: str, value: str, cache_dir: str | None, local_files_only: bool = False, verify: bool = True
) -> str:
    """The local file holding the weights --pretrained names: the file itself, or the tag's file in the hub
    cache (fetched into it unless local_files_only or HF_HUB_OFFLINE=1; its SHA-256 checked when verify).
    UserError naming the tag, the model and the cache when the weights cannot be had."""
    if is_local_weights(value):
        return value
    check_pretrained(model, value)
    import open_clip
    from huggingface_hub import hf_hub_download
    from huggingface_hub.constants import HF_HUB_CACHE

    cfg = open_clip.get_pretrained_cfg(model, value)
    hub = cfg.get("hf_hub", "")
    where = cache_dir or HF_HUB_CACHE
    if not hub:
        raise UserError(
            f"--pretrained {value}: OpenCLIP serves the {model} weights of this tag only from a URL, not the "
            f"Hugging Face hub; download them and pass the file to --pretrained"
        )
    # OpenCLIP's registry writes 'org/repo/' (its default file names) or 'org/repo/file'; a .safetensors twin
    # of a pickled file is preferred, as open_clip's own download does.
    repo_id, filename = os.path.split(hub)
    filenames = HUB_FILENAMES
    if filename:
        stem, ext = os.path.splitext(filename)
        filenames = (stem + ".safetensors", filename) if ext in (".bin", ".pth") else (filename,)
    problem = None
    for name in filenames:
        try:
            path = hf_hub_download(repo_id, name, cache_dir=cache_dir, local_files_only=local_files_only)
        except Exception as e:  # noqa: BLE001 — offline, missing file, network: the next name, then one line
            problem = e
            continue
        if verify:
            verify_hub_blob(path, value)
        return path
    offline = local_files_only or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    how = "the cache holds no copy and downloads are off (HF_HUB_OFFLINE)" if offline else "the download failed"
    raise UserError(
        f"--pretrained {value}: the {model} weights of this tag ({repo_id} on the Hugging Face hub) could not be "
        f"had: {how} ({type(problem).__name__}); cache directory {where}. Fetch them where the hub is reachable "
        f"(`bigclip fetch --model {model} --pretrained {value}`, same --cache-dir), or pass a local file to "
        f"--pretrained"
    )


def verify_hub_blob(path: str, tag: str, flag: str = "--pretrained") -> None:
    """The hub's cache names a large file's blob by the SHA-256 of its content: check the bytes against it."""
    blob = os.path.realpath(path)
    expected = os.path.basename(blob)
    if not _SHA256.fullmatch(expected):
        return  # a small, non-LFS file: the hub names it by a git hash, not a content hash
    digest = hashlib.sha256()
    with open(blob, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise UserError(
            f"{flag} {tag}: the cached file {path} does not match its SHA-256 ({expected[:12]}…); the cache "
            f"entry is corrupt: delete {blob} and fetch it again"
        )


def _hub_file(repo_id: str, filenames, cache_dir: str | None, local_files_only: bool, revision: str | None = None):
    """(path of the first of `filenames` the hub cache has or can fetch, or None; the last problem met)."""
    from huggingface_hub import hf_hub_download

    problem = None
    for name in filenames:
        try:
            path = hf_hub_download(
                repo_id, name, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
            )
        except Exception as e:  # noqa: BLE001 — offline, missing file, network: the next name, then one line
            problem = e
            continue
        return path, None
    return None, problem


def model_weights(model: str, cache_dir: str | None, local_files_only: bool = False, verify: bool = True) -> str | None:
    """The weights a local-dir: or hf-hub: --model brings along (OpenCLIP loads them by default), or None.

    local-dir: the file OpenCLIP picks in DIR (open_clip_model.safetensors first). hf-hub: OpenCLIP's file names
    in the repository, from the hub cache (fetched into it unless offline); a repository that holds no weights
    gives None (OpenCLIP then starts from a random init), weights that cannot be had stop with one line."""
    schema, identifier = parse_model_name(model)
    if schema == "local-dir":
        return local_dir_weights(identifier)
    if schema != "hf-hub":
        return None
    from huggingface_hub.errors import RemoteEntryNotFoundError

    path, problem = _hub_file(identifier, HUB_FILENAMES, cache_dir, local_files_only)
    if path is None and isinstance(problem, RemoteEntryNotFoundError):
        return None  # the repository has a config and no weights
    if path is None:
        raise UserError(
            f"--model {model}: the weights of {identifier} on the Hugging Face hub ({' or '.join(HUB_FILENAMES)}) "
            f"could not be had: {hub_problem(problem, local_files_only)}; cache directory {hub_cache_dir(cache_dir)}. "
            f"Fetch them where the hub is reachable (`bigclip fetch --model {model}`, same --cache-dir), or pass a "
            f"local file to --pretrained"
        )
    if verify:
        verify_hub_blob(path, model, flag="--model")
    return path


def timm_model_name(model: str, cache_dir: str | None = None, local_files_only: bool = False) -> str | None:
    """The timm model of --model's image tower (vision_cfg timm_model_name), or None for other towers."""
    cfg = get_model_config(model, cache_dir, local_files_only)
    return cfg["vision_cfg"]["timm_model_name"] if is_timm_tower(cfg) else None


def timm_weights_repo(timm_name: str) -> tuple[str, str | None, tuple[str, ...]]:
    """(hub repository, revision, file names) where timm keeps the pretrained weights of `timm_name`: its default
    tag's, or the tag the name carries (resnet18 -> timm/resnet18.a1_in1k, model.safetensors first as timm
    prefers it). UserError when timm has no hub weights for the model."""
    cfg = get_pretrained_cfg(timm_name)
    if cfg is None or not cfg.hf_hub_id:
        raise UserError(
            f"--pretrained-image: timm has no pretrained weights on the Hugging Face hub for {timm_name}; "
            "drop the flag, or pass whole-model weights to --pretrained"
        )
    repo_id, revision = hf_split(cfg.hf_hub_id)
    filenames = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else ("model.safetensors", "pytorch_model.bin")
    return repo_id, revision, filenames


def check_pretrained_image(model: str, cache_dir: str | None = None, local_files_only: bool = False) -> None:
    """Flag validation: --pretrained-image needs a timm image tower with weights timm publishes on the hub."""
    timm_name = timm_model_name(model, cache_dir, local_files_only)
    if timm_name is None:
        raise UserError(
            f"--pretrained-image: pretrained image towers currently only supported for timm models "
            f"(vision_cfg timm_model_name); --model {model} has bigclip's own image tower"
        )
    timm_weights_repo(timm_name)


def resolve_pretrained_image(
    timm_name: str, cache_dir: str | None, local_files_only: bool = False, verify: bool = True
) -> tuple[str, str]:
    """(local file, hub repository) of timm's pretrained weights for `timm_name`, from the hub cache (fetched into
    it unless local_files_only or HF_HUB_OFFLINE=1; SHA-256 checked when verify). One line naming the timm model,
    the repository and the cache directory when they cannot be had."""
    repo_id, revision, filenames = timm_weights_repo(timm_name)
    path, problem = _hub_file(repo_id, filenames, cache_dir, local_files_only, revision)
    if path is None:
        raise UserError(
            f"--pretrained-image: timm's weights for {timm_name} ({repo_id} on the Hugging Face hub, "
            f"{' or '.join(filenames)}) could not be had: {hub_problem(problem, local_files_only)}; cache directory "
            f"{hub_cache_dir(cache_dir)}. Fetch them where the hub is reachable (`bigclip fetch --model M "
            f"--pretrained-image`, same --cache-dir)"
        )
    if verify:
        verify_hub_blob(path, timm_name, flag="--pretrained-image")
    return path, repo_id
