#!/usr/bin/env bash
# One device call: GPU tests, then the all-reduce benchmark in both settings, logs under $OUT.
# Usage (on a machine with 2+ GPUs): bash benchmarks/device_check.sh [tests|bench|all] [extra bench args]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
[[ $what == tests || $what == bench || $what == all ]] || {
    echo "device_check.sh: the first argument is tests, bench or all, got '$what'" >&2; exit 2; }
source "$(dirname "$0")/steps.sh"; gpus_at_least 2  # sets NGPU
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package, and the harness (benchmarks)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv \
    -lms 200 > "$OUT/smi.csv" 2>&1 &
SMI=$!
if [[ $what == tests || $what == all ]]; then
    python3 -m pytest -q -x tests/gpu 2>&1 | tee "$OUT/gpu-tests.log"; exited tests "${PIPESTATUS[0]}"
fi
if [[ $what == bench || $what == all ]]; then
    for setting in nvlink pcie-like; do
        p2p=""; [[ $setting == pcie-like ]] && p2p="NCCL_P2P_DISABLE=1"
        cmd="$p2p torchrun --nproc-per-node $NGPU -m benchmarks.ops $*"
        echo "== $cmd"
        env $p2p FLASHOVERLAP_COMMAND="$cmd" torchrun --nproc-per-node "$NGPU" -m benchmarks.ops "$@" \
            2>&1 | tee "$OUT/bench-$setting.log"; exited "bench $setting" "${PIPESTATUS[0]}"
    done
    cp benchmarks/results/*.json "$OUT/" 2>/dev/null
fi
kill $SMI 2>/dev/null
exit_failed
