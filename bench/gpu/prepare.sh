#!/usr/bin/env bash
# Run here, on the CPU machine, before a GPU machine is at hand: puts into bench/gpu/wheels/ (ignored by git)
# every wheel the GPU machine lacks (CPython 3.12, manylinux x86-64, --no-deps, one version each), checks that
# every requirement of each is carried or already there and that they fit what a device call carries with the
# tree, and prints the folder's path as its last line.
#
#   bash bench/gpu/prepare.sh            # then, on the GPU machine: bash bench/gpu/run.sh OUTDIR
#
# The GPU machine's image has torch, triton, timm, numpy, pyyaml, pillow, scikit-learn, tensorboard,
# safetensors, huggingface_hub, requests, regex, tqdm, einops, msgpack, psutil, py-cpuinfo, ninja, packaging
# (see docs/benchmarks.md, "GPU"; `present` below). Not carried: `not_carried` below. Every runtime dependency in
# pyproject.toml is in one of the three lists (tests/test_gpu_kit.py checks it).
set -euo pipefail
cd "$(dirname "$0")"
out="$PWD/wheels"
# One version of each, the versions this project's CPU suite runs with.
pinned=(
    webdataset==1.0.2 braceexpand==0.1.7 torchdata==0.11.0  # the training loader
    open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.2.14      # the oracle: open_clip_train, its tokenizer
    deepspeed==0.19.8 hjson==3.1.0                           # the ZeRO engines
    pydantic==2.12.5 pydantic_core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2  # DeepSpeed's config
    torchao==0.18.0                                          # --opt adamw8bit, bf16 stochastic rounding
    simplejpeg==1.9.0                                        # the loaders' JPEG decoder (data/decode.py)
    inf-cl==1.2.1 siglip-kernel==0.1.2                       # the losses part's peers (Inf-CL, siglip-kernel)
)
limit_mib=48  # a device call carries 64 MiB with the tree; the tree itself is a few MiB
rm -rf "$out" && mkdir -p "$out"
py=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
for spec in "${pinned[@]}"; do
    if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$out" "$spec" 2>/dev/null; then
        # Only a source archive on the registry (DeepSpeed): build a pure-Python wheel here, no ops compiled. In
        # pip's isolated build environment (its own setuptools and wheel): a stock python3 has neither `wheel` nor
        # torch, and DeepSpeed's setup builds without torch when no op is compiled.
        DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps -w "$out" "$spec" \
            || { echo "prepare.sh: could not get a wheel for $spec (is the package registry reachable?)" >&2; exit 1; }
    fi
done
n=$(ls "$out"/*.whl | wc -l)
[ "$n" -eq "${#pinned[@]}" ] || { echo "prepare.sh: expected ${#pinned[@]} wheels in $out, found $n" >&2; exit 1; }
# Every requirement of every carried wheel is carried too or already on the GPU machine (its image's list,
# as read off the machine in 2026-11).
present="torch torchvision triton timm numpy pyyaml pillow scikit-learn tensorboard safetensors huggingface-hub
requests urllib3 regex tqdm einops msgpack psutil py-cpuinfo ninja packaging typing-extensions fsspec matplotlib"
not_carried="s3fs wandb"  # imported only for s3:// paths and --report-to wandb, which the kit does not use
"$py" - "$out" $present <<'PY' || exit 1
import re, sys, zipfile, pathlib
out, present = pathlib.Path(sys.argv[1]), {p.lower().replace("_", "-") for p in sys.argv[2:]}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
carried, missing = {}, []
for wheel in out.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = norm(re.search(r"^Name: (.+)$", meta, re.M).group(1))
    carried[name] = [norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0))
                     for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
for name, needs in carried.items():
    missing += [f"{name} needs {n}" for n in needs if n not in carried and n not in present]
if missing:
    sys.exit("prepare.sh: not carried and not on the GPU machine: " + "; ".join(missing))
PY
size_mib=$(( $(du -sk "$out" | cut -f1) / 1024 ))
[ "$size_mib" -le "$limit_mib" ] || { echo "prepare.sh: $out holds $size_mib MiB, over the $limit_mib MiB a device call can carry beside the tree" >&2; exit 1; }
echo "prepare.sh: $n wheels, $size_mib MiB" >&2
echo "$out"
