#!/usr/bin/env bash
# The second CI leg: the fast tier on the oldest torch this project claims, in its own virtual environment.
#   bash .ci/torch_leg.sh install .ci/constraints-oldest.txt   # make the venv (.ci/run: in the background)
#   bash .ci/torch_leg.sh test .ci/constraints-oldest.txt      # the fast tier on it
# The constraints file pins torch and torchvision; everything else resolves as in the main leg (newest allowed).
# The venv is .venv-<constraints name without "constraints-">; `install` prints its seconds, `test` the tier's.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
phase=${1:?usage: .ci/torch_leg.sh install|test CONSTRAINTS_FILE}
constraints=${2:?usage: .ci/torch_leg.sh install|test CONSTRAINTS_FILE}
[ -f "$constraints" ] || { echo "torch_leg.sh: no constraints file $constraints" >&2; exit 2; }
name=$(basename "$constraints" .txt)
venv=".venv-${name#constraints-}"
start=$(date +%s)
case $phase in
install)
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q uv  # the install in ~45 s where pip took 5.4 min here (both without a cache)
    # bigclip's requirements only, not bigclip: the main leg's editable install builds in this checkout at the
    # same time. The tests run from the repository root (and give subprocesses PYTHONPATH), so this checkout's
    # bigclip is the one imported, as in the main leg.
    "$venv/bin/python" -c "
import tomllib
project = tomllib.load(open('pyproject.toml', 'rb'))['project']
print('\\n'.join(project['dependencies'] + project['optional-dependencies']['test']))" > "$venv/requirements.txt"
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" -r "$venv/requirements.txt" -c "$constraints"
    echo "torch leg $name: installed in $(($(date +%s) - start)) s"
    ;;
test)
    # DeepSpeed's ops (built by the tests) are cached under torch's extensions folder, named by Python and CUDA
    # only (py311_cu130 for two torch releases alike): this leg builds its own, never loads another torch's.
    export TORCH_EXTENSIONS_DIR="$PWD/$venv/torch_extensions"
    "$venv/bin/python" -c "import torch, torchvision; print(f'torch leg: torch {torch.__version__}, torchvision {torchvision.__version__}')"
    "$venv/bin/python" -m pytest -q -n 2 --dist loadgroup -m "not slow and not slurm" && rc=0 || rc=$?
    echo "torch leg $name: fast tier in $(($(date +%s) - start)) s"
    exit $rc
    ;;
*)
    echo "torch_leg.sh: unknown phase $phase (install or test)" >&2
    exit 2
    ;;
esac
