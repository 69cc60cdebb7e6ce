#!/usr/bin/env bash
# A second CI leg: the fast tier on another torch, in its own virtual environment beside the main one.
#   bash .ci/torch_leg.sh .ci/constraints-oldest.txt    # pyproject.toml's floor
#   bash .ci/torch_leg.sh .ci/constraints-torch211.txt  # the GPU machines' release
# The constraints file pins torch and torchvision; everything else resolves as in the main leg (newest allowed).
# The venv is .venv-<constraints name>, made afresh when absent; prints install and test seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
constraints=${1:?usage: .ci/torch_leg.sh CONSTRAINTS_FILE}
[ -f "$constraints" ] || { echo "torch_leg.sh: no constraints file $constraints" >&2; exit 2; }
name=$(basename "$constraints" .txt)
venv=".venv-${name#constraints-}"
# DeepSpeed's ops (built by the tests) are cached under torch's extensions folder, named by Python and CUDA only
# (py311_cu130 for torch 2.11 and 2.14 alike): this leg builds its own, never waits on or loads another torch's.
export TORCH_EXTENSIONS_DIR="$PWD/$venv/torch_extensions"
start=$(date +%s)
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -U pip
"$venv/bin/pip" install -q -e '.[test]' -c "$constraints"
installed=$(date +%s)
"$venv/bin/python" -c "import torch, torchvision; print(f'torch leg {torch.__version__}, torchvision {torchvision.__version__}')"
# The fast tier (README); the test process runs from the repository root, so this checkout's bigclip is the one
# imported, exactly as in the main leg.
"$venv/bin/python" -m pytest -q -n 2 --dist loadgroup -m "not slow and not slurm" && rc=0 || rc=$?
echo "torch leg $name: install $((installed - start)) s, fast tier $(($(date +%s) - installed)) s"
exit $rc
