"""`bigclip models [NAME ...]`: every architecture --model takes by name (bigclip's own, open_clip_torch's, OpenCLIP
main's), or the ones named, with its parameter count, its tower family (model/zoo.py) and where its config comes
from; a name bigclip does not build says why.

The count is the memory model's (`memory.parameter_count`: the model built on the meta device, as `bigclip plan`
and --dry-run build it, so they say the same number; its activations are not traced). Building all ~200 on meta
takes about 20 s, so counts are kept in
`$XDG_CACHE_HOME/bigclip/model_params.json` (default ~/.cache), keyed by each config's content and stamped with a
digest of the code that builds models (bigclip/model's sources and the torch, timm, transformers and open_clip_torch
versions): any change there rebuilds them all, a new or edited config rebuilds that one. Architectures with a
Hugging Face text tower are never cached (their size is the hub's config, which can change): they are counted when
transformers' cache holds that config, and otherwise say what to download (nothing is fetched).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from bigclip.commands import COMMANDS, Command
from bigclip.errors import OneLineErrorParser, UserError
from bigclip.memory import parameter_count
from bigclip.model import get_model_config, list_models, zoo
from bigclip.model.registry import config_source

MODEL_CODE = Path(__file__).resolve().parent.parent / "model"
CACHE_NAME = "model_params.json"
_LIBRARIES = ("torch", "timm", "transformers", "open_clip_torch")
CANNOT_BUILD = "this architecture config cannot be built by bigclip "  # create_model's words before the reason


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "bigclip" / CACHE_NAME


def code_digest() -> str:
    """What a parameter count depends on besides the config: the model code and the libraries that build towers."""
    digest = hashlib.sha256()
    for path in sorted(MODEL_CODE.rglob("*.py")):
        digest.update(path.relative_to(MODEL_CODE).as_posix().encode() + b"\0" + path.read_bytes())
    for library in _LIBRARIES:
        try:
            digest.update(f"{library}=={metadata.version(library)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{library} absent".encode())
    return digest.hexdigest()


def config_key(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def _hub_config_missing(cfg: dict) -> str | None:
    """For a Hugging Face text tower whose config transformers' cache does not hold: what to download; else None."""
    from huggingface_hub import try_to_load_from_cache  # slow to import; only these names need it

    repo = cfg.get("text_cfg", {}).get("hf_model_name")
    if repo is None or os.path.isdir(repo) or isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return None
    return f"hub config not cached: huggingface-cli download {repo}"


WHY_WIDTH = 72  # the "not built because" column: a refusal's line cut to this (`bigclip --model NAME` says it whole)


def _why(name: str, error: UserError) -> str:
    """A refusal's line without the leading "--model NAME: " (and create_model's preamble before its reason)."""
    line = str(error).removeprefix(f"--model {name}: ")
    if line.startswith(CANNOT_BUILD + "(") and line.endswith(")"):  # the reason alone
        line = line[len(CANNOT_BUILD) + 1 : -1]
    return line


def count(name: str, cfg: dict) -> int | str:
    """The parameter count of architecture `name` built on meta, or why it cannot be built."""
    refused = zoo.not_built(cfg)
    if refused is not None:
        return f"{refused} are not built by bigclip yet"
    missing = _hub_config_missing(cfg)
    if missing is not None:
        return missing
    try:
        return parameter_count(name)
    except UserError as e:
        return _why(name, e)


def entries(names: list[str] | None = None, use_cache: bool = True) -> list[tuple[str, int | str, str, str]]:
    """(name, parameters or why not, family, config source) for `names` (default: every name --model takes, in
    list_models' order)."""
    path = cache_file()
    digest = code_digest()
    cached: dict = {}
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            cached = dict(stored["counts"]) if stored.get("code") == digest else {}
        except (OSError, ValueError, KeyError, TypeError):  # unreadable or another layout: counted again
            cached = {}
    out, kept = [], dict(cached)
    for name in list_models() if names is None else names:
        cfg = get_model_config(name)
        hub_text = "hf_model_name" in cfg.get("text_cfg", {})
        key = config_key(cfg)
        params = cached[key] if use_cache and key in cached and not hub_text else count(name, cfg)
        if not hub_text:
            kept[key] = params
        out.append((name, params, zoo.family(cfg), config_source(name)))
    if kept != cached:
        _write(path, {"code": digest, "counts": kept})
    return out


def _write(path: Path, data: dict) -> None:
    """Write the cache whole or not at all (a concurrent reader sees the old file or the new one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:  # a read-only home: the listing is still right, only slower next time
        pass


def _short(why: str) -> str:
    return why if len(why) <= WHY_WIDTH else why[: WHY_WIDTH - 1] + "…"


def main(argv: list[str]) -> int:
    parser = OneLineErrorParser(prog="bigclip models", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="list only these architectures (default: all)")
    parser.add_argument("--no-cache", action="store_true", help=f"count them again (rewrites {cache_file()})")
    args = parser.parse_args(argv)
    known = list_models()
    unknown = [name for name in args.names if name not in known]
    if unknown:
        raise UserError(f"bigclip models {' '.join(unknown)}: unknown architecture; `bigclip models` lists them all")
    rows = entries(args.names or None, use_cache=not args.no_cache)
    width = max(len(name) for name, *_ in rows)
    family_width = max(len(family) for _, _, family, _ in rows)
    print(f"{'name':{width}s}  {'parameters':>15s}  {'family':{family_width}s}  {'config':15s}  not built because")
    for name, params, family, source in rows:
        shown, why = (f"{params:,}", "") if isinstance(params, int) else ("-", _short(params))
        print(f"{name:{width}s}  {shown:>15s}  {family:{family_width}s}  {source:15s}  {why}".rstrip())
    built = sum(isinstance(p, int) for _, p, _, _ in rows)
    print(f"{len(rows)} names, {built} built by bigclip; parameters counted on the meta device ({cache_file()})")
    return 0


COMMANDS.register(
    "models",
    Command(main, "bigclip models [NAME ...] [--no-cache]"),
    help="list the architectures: parameters, tower family, where the config comes from",
)
