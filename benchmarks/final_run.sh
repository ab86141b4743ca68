#!/usr/bin/env bash
# The device call that produced the committed results: GPU tests, the GPU demo, then the all-reduce benchmark in
# both settings (nvlink, pcie-like), with nvidia-smi sampling clocks and power throughout. Logs and JSON in $OUT.
# Usage: FLASHOVERLAP_COMMIT=<sha> [SKIP_TESTS=1] bash benchmarks/final_run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 250 > "$OUT/smi.csv" 2>&1 &
SMI=$!
if [[ -z ${SKIP_TESTS:-} ]]; then
    timeout 240 python3 -m pytest -q tests/gpu > "$OUT/gpu-tests.log" 2>&1; tail -2 "$OUT/gpu-tests.log"
fi
timeout 120 python3 -m flashoverlap demo > "$OUT/demo-gpu.log" 2>&1; tail -3 "$OUT/demo-gpu.log"
gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name().split()[-1].lower())')
for setting in nvlink pcie-like; do
    p2p=""; [[ $setting == pcie-like ]] && p2p="NCCL_P2P_DISABLE=1"
    cmd="$p2p torchrun --nproc-per-node $NGPU -m flashoverlap.bench --interference"
    echo "== $cmd" | tee "$OUT/bench-$setting.log"
    env $p2p FLASHOVERLAP_COMMAND="$cmd" timeout 200 torchrun --nproc-per-node "$NGPU" -m flashoverlap.bench \
        --interference --out "$OUT/${gpu}x$NGPU-$setting.json" >> "$OUT/bench-$setting.log" 2>&1
    grep -A7 "^gemm_all_reduce" "$OUT/bench-$setting.log"
done
kill $SMI 2>/dev/null
