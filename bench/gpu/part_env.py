"""GPU kit, environment: the machine and the versions every figure of the report was measured with."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess

import torch
from common import REPO, Recorder, part_args


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commit() -> str:
    if os.environ.get("BIGCLIP_COMMIT"):
        return os.environ["BIGCLIP_COMMIT"]  # a copy of the tree without .git (a device machine) is told it
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    args = part_args(__doc__)
    rec = Recorder(args.out)
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    rec.row(
        "machine",
        date=datetime.date.today().isoformat(),
        bigclip_commit=commit(),
        device=props.name if props else f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        gpu_memory_gib=round(props.total_memory / 2**30, 1) if props else None,
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=version("triton"),
        deepspeed=version("deepspeed"),
        open_clip_torch=version("open_clip_torch"),
        timm=version("timm"),
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
