#!/usr/bin/env bash
# The int8 SwitchBack ablation in small (Wortsman, Dettmers et al. 2023): the same model and data trained with
# nn.Linear in fp32 and bf16, and with each SwitchBack variant, each with AdamW and with StableAdamW; one run
# folder (metrics.jsonl) per arm, then a table of final loss, zero-shot accuracy, samples/s and peak memory, and
# one page of all arms' plots overlaid (OUT_DIR/report.html and .png, by `bigclip report`).
#
#   launch/experiments/int8_switchback.sh [OUT_DIR] [-- TRAINING FLAGS]
#
# With no training flags it trains the embedded digits demo (minutes per arm on a CPU). On a GPU the default
# arms are bf16, each SwitchBack variant and, where the GPU has fp8 tensor cores (compute capability 8.9+),
# torchao's fp8 (`fp8-tensorwise`, `fp8-rowwise`: --use-fp8-linear); on a CPU, fp32, bf16 and the int8
# variants. On a GPU node give the model and data, and a launcher:
#
#   LAUNCH="torchrun --nproc_per_node 8 launch/train.py --" launch/experiments/int8_switchback.sh runs/int8 -- \
#       --model ViT-B-32 --train-data '/data/{00000..01000}.tar' --train-num-samples 10000000 ...
#
# Environment: LAUNCH (default "python launch/train.py"), ARMS (space-separated subset of the arm names below),
# INT8_PRECISION (the SwitchBack arms' --precision, default amp_bf16: int8 layers quantize from bf16, as in
# the paper), OPTS (default "adamw stableadamw"), LAYER_SCALE_INIT (every arm's --layer-scale-init, default 0:
# the paper's zero-initialised layer scale; set it empty for the model's own). Run from the repository root.
set -euo pipefail

out=${1:-logs/int8-switchback}
shift || true
if [ "${1:-}" = "--" ]; then shift; fi
LAUNCH=${LAUNCH:-python launch/train.py}
INT8_PRECISION=${INT8_PRECISION:-amp_bf16}
OPTS=${OPTS:-adamw stableadamw}
INT8_ARMS="SwitchBackLinearGlobal SwitchBackLinearVectorwise SwitchBackLinearGlobalMemEfficient"
ALL_ARMS="linear-fp32 linear-bf16 $INT8_ARMS StandardLinear fp8-tensorwise fp8-rowwise"
# What this machine runs by default: 0 no GPU, 1 a GPU, 2 a GPU with fp8 tensor cores.
gpu=$(python -c 'import torch; print(0 if not torch.cuda.is_available() else 2 if torch.cuda.get_device_capability() >= (8, 9) else 1)')
case "$gpu" in
    0) default_arms="linear-fp32 linear-bf16 $INT8_ARMS" ;;
    1) default_arms="linear-bf16 $INT8_ARMS" ;;
    *) default_arms="linear-bf16 $INT8_ARMS fp8-tensorwise fp8-rowwise" ;;
esac
ARMS=${ARMS:-$default_arms}

mkdir -p "$out"
for opt in $OPTS; do
    for arm in $ARMS; do
        case "$arm" in
            linear-fp32) flags=(--precision fp32) ;;
            linear-bf16) flags=(--precision amp_bf16) ;;
            SwitchBack* | StandardLinear) flags=(--precision "$INT8_PRECISION" --use-bnb-linear "$arm") ;;
            fp8-*) flags=(--precision "$INT8_PRECISION" --use-fp8-linear "${arm#fp8-}") ;;
            *) echo "int8_switchback.sh: unknown arm '$arm'; choose from: $ALL_ARMS" >&2; exit 2 ;;
        esac
        if [ -n "${LAYER_SCALE_INIT-0}" ]; then flags+=(--layer-scale-init "${LAYER_SCALE_INIT-0}"); fi
        name="$arm-$opt"
        if [ -e "$out/$name/metrics.jsonl" ] && grep -q '"eval/' "$out/$name/metrics.jsonl"; then
            echo "== $name: done before, kept"
            continue
        fi
        rm -rf "${out:?}/$name"
        echo "== $name"
        # shellcheck disable=SC2086  # LAUNCH is a command line
        $LAUNCH "${flags[@]}" --opt "$opt" --logs "$out" --name "$name" "$@"
    done
done
python launch/experiments/summarize_runs.py "$out"
# One page of every arm's plots, overlaid on the same axes (bigclip report; needs matplotlib: bigclip[report]).
runs=()
for opt in $OPTS; do
    for arm in $ARMS; do
        if [ -e "$out/$arm-$opt/metrics.jsonl" ]; then runs+=("$out/$arm-$opt"); fi
    done
done
python -m bigclip report "${runs[@]}" -o "$out/report.html" || echo "int8_switchback.sh: no overlaid report (above: why)" >&2
