"""`bigclip generate --model M --pretrained P IMAGE|DIR ...`: captions of images by a CoCa model.

Prints one JSON object per image on stdout, {"image": path, "caption": text}, in the order given (a directory's
images sorted by name). Decoding is model/captioning.py's: beam search (OpenCLIP's default) or greedy, with
OpenCLIP's generate options --seq-len, --min-seq-len and --num-beams. One process; the weights are any that
--pretrained takes in training (a pretrained tag, an OpenCLIP or bigclip state dict, a local-dir:/hf-hub: model's
own), and `bigclip export`'s output.
"""

from __future__ import annotations

import json
import os

import torch
from PIL import Image, UnidentifiedImageError

from bigclip.build import build_tokenizer, build_transforms, model_factory
from bigclip.commands import COMMANDS, Command
from bigclip.data import DataConfig
from bigclip.data.imagenet import IMAGE_EXTENSIONS
from bigclip.dist import World
from bigclip.errors import OneLineErrorParser, UserError
from bigclip.model.captioning import GENERATION_TYPES, generate
from bigclip.model.config import ModelConfig, captions, check_model


def _parser() -> OneLineErrorParser:
    p = OneLineErrorParser(prog="bigclip generate", description=__doc__.split("\n\n")[0])
    p.add_argument("images", nargs="+", help="image files, or directories of them")
    p.add_argument("--model", required=True, help="a CoCa architecture (coca_ViT-B-32, local-dir:/hf-hub: ...)")
    p.add_argument("--pretrained", default=None, help="a pretrained tag of --model or a state dict file")
    p.add_argument("--cache-dir", default=None, help="Hugging Face hub cache for pretrained tags")
    p.add_argument("--generation-type", default="beam_search", choices=GENERATION_TYPES)
    p.add_argument("--seq-len", type=int, default=30, help="most tokens of a caption, start and end included")
    p.add_argument("--min-seq-len", type=int, default=5, help="tokens before the end of text may come")
    p.add_argument("--num-beams", type=int, default=6, help="beams per image (beam_search)")
    p.add_argument("--batch-size", type=int, default=8, help="images decoded together")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def image_paths(given: list[str]) -> list[str]:
    paths = []
    for path in given:
        if os.path.isdir(path):
            found = sorted(f for f in os.listdir(path) if f.lower().endswith(IMAGE_EXTENSIONS))
            if not found:
                raise UserError(f"{path}: no images ({', '.join(IMAGE_EXTENSIONS)}) in this directory")
            paths += [os.path.join(path, f) for f in found]
        elif os.path.isfile(path):
            paths.append(path)
        else:
            raise UserError(f"{path}: no such image file or directory")
    return paths


def _load(path: str, preprocess) -> torch.Tensor:
    try:
        with Image.open(path) as image:
            return preprocess(image.convert("RGB"))
    except (UnidentifiedImageError, OSError) as err:
        raise UserError(f"{path}: not an image PIL can read ({type(err).__name__})") from None


def caption_text(ids: list[int], tokenizer, sot_id: int, eos_id: int) -> str:
    """The words between the start and the end of text."""
    ids = ids[1:] if ids and ids[0] == sot_id else ids
    ids = ids[: ids.index(eos_id)] if eos_id in ids else ids
    return tokenizer.decode(ids).strip()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = ModelConfig(model=args.model, pretrained=args.pretrained, cache_dir=args.cache_dir)
    check_model(cfg)
    if not captions(cfg):
        raise UserError(f"--model {args.model}: not a captioning model; captions need a CoCa (coca_ViT-B-32, ...)")
    if not 1 <= args.min_seq_len < args.seq_len:
        raise UserError(f"--min-seq-len {args.min_seq_len}: must be at least 1 and less than --seq-len {args.seq_len}")
    if args.num_beams < 1 or args.batch_size < 1:
        raise UserError("--num-beams and --batch-size: must be positive integers")
    paths = image_paths(args.images)
    _, preprocess, _ = build_transforms(cfg, DataConfig())
    tokenizer = build_tokenizer(cfg)
    sot_id, eos_id = tokenizer.sot_token_id, tokenizer.eot_token_id
    model = model_factory(cfg, World())(device=args.device).eval()
    options = {"seq_len": args.seq_len, "min_seq_len": args.min_seq_len, "num_beams": args.num_beams}
    for start in range(0, len(paths), args.batch_size):
        batch = paths[start : start + args.batch_size]
        images = torch.stack([_load(p, preprocess) for p in batch]).to(args.device)
        ids = generate(
            model, images, args.generation_type, sot_id=sot_id, eos_id=eos_id, pad_id=model.pad_id, **options
        )
        for path, row in zip(batch, ids.tolist()):
            print(json.dumps({"image": path, "caption": caption_text(row, tokenizer, sot_id, eos_id)}), flush=True)
    return 0


COMMANDS.register(
    "generate",
    Command(main, "bigclip generate IMAGE ..."),
    help="captions of images by a CoCa model (--model, --pretrained), JSON lines on stdout",
)
