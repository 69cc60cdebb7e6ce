#!/usr/bin/env bash
# The GPU acceptance kit, one command (see bench/gpu/suite.py for the parts):
#
#   bash bench/gpu/run.sh OUTDIR                  # on a GPU machine, with bench/gpu/wheels/ carried there
#   bash bench/gpu/run.sh --smoke OUTDIR          # on CPU at toy sizes (CI runs this)
#   bash bench/gpu/run.sh --parts engines OUTDIR  # a subset
#   bash bench/gpu/run.sh tune-losses [--budget-s S]   # bench/gpu/tune_losses.py: the fused loss's plans
#
# On a GPU machine the wheels from bench/gpu/prepare.sh are installed into a temporary folder first, with no
# network and without touching the machine's own packages. Exit status: 0 when every part passed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
smoke=0
for a in "$@"; do [ "$a" = --smoke ] && smoke=1; done
if [ "$smoke" = 0 ]; then
    shopt -s nullglob
    wheels=("$here"/wheels/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "run.sh: no wheels in $here/wheels: run bench/gpu/prepare.sh where the package registry is reachable and carry that folder (or use --smoke)" >&2
        exit 2
    fi
    site=$(mktemp -d /tmp/bigclip-gpu-site.XXXXXX)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$site/bin:$PATH"  # deepspeed's own scripts (ds_report)
fi
if [ "${1:-}" = tune-losses ]; then
    shift
    export PYTHONPATH="$(dirname "$(dirname "$here")"):$(dirname "$here"):$here${PYTHONPATH:+:$PYTHONPATH}"
    exec "$py" "$here/tune_losses.py" "$@"
fi
exec "$py" "$here/suite.py" "$@"
