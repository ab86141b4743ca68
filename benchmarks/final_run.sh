#!/usr/bin/env bash
# The device call that produces the committed results: GPU tests, the GPU demo, then the benchmark of every op in
# each setting (nvlink, pcie-like) with a timeline picture, nvidia-smi sampling clocks and power throughout.
# Logs, JSON and PNGs land in $OUT.
# Usage: FLASHOVERLAP_COMMIT=<sha> [SMOKE="all_reduce reduce_scatter all_gather"] [TESTS="tests/gpu/..."|TESTS=] [DEMO=] [SETTINGS="nvlink pcie-like"]
#        [OPS=all_reduce,reduce_scatter,all_gather] [BENCH_ARGS=--interference] [BENCH_ARGS_nvlink=--movers] [TIMELINE=] [TAG=-sweep]
#        [BENCH_TIMEOUT=240] [BENCH_TIMEOUT_nvlink=...] [BENCH_TIMEOUT_pcie_like=...] bash benchmarks/final_run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package, and the harness (benchmarks)
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
TESTS=${TESTS-tests/gpu}; DEMO=${DEMO-1}; SETTINGS=${SETTINGS-nvlink pcie-like}
source "$(dirname "$0")/steps.sh"; check_words SETTINGS setting "nvlink pcie-like"
OPS=${OPS-all_reduce,reduce_scatter,all_gather}; BENCH_ARGS=${BENCH_ARGS-}; TIMELINE=${TIMELINE-1}; TAG=${TAG-}
gpus_at_least 2  # sets NGPU
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 250 > "$OUT/smi.csv" 2>&1 &
SMI=$!
for op in ${SMOKE-}; do  # the P2P path's first contact, one op at a time (benchmarks.diagnostics.p2p_smoke)
    timeout ${SMOKE_TIMEOUT:-80} torchrun --nproc-per-node "$NGPU" -m benchmarks.diagnostics.p2p_smoke $op \
        > "$OUT/smoke-$op.log" 2>&1; exited "smoke $op"
    grep -E "rank 0:|Error|error" "$OUT/smoke-$op.log" | tail -14
done
if [[ -n $TESTS ]]; then
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -v --durations=0 $TESTS > "$OUT/gpu-tests.log" 2>&1; exited tests
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | tail -25
fi
if [[ -n $DEMO ]]; then
    timeout 120 python3 -m flashoverlap demo > "$OUT/demo-gpu.log" 2>&1; exited demo; tail -3 "$OUT/demo-gpu.log"
fi
gpu_model; gpu=$GPU
for setting in $SETTINGS; do
    p2p=""; [[ $setting == pcie-like ]] && p2p="NCCL_P2P_DISABLE=1"
    args="--ops $OPS $BENCH_ARGS $(eval echo \${BENCH_ARGS_${setting/-/_}:-})"; [[ -n $TIMELINE ]] && args="$args --timeline $OUT/timeline-$setting.png"
    cmd="$p2p torchrun --nproc-per-node $NGPU -m benchmarks.ops $args"
    echo "== $cmd" | tee "$OUT/bench-$setting$TAG.log"
    env $p2p FLASHOVERLAP_COMMAND="$cmd" timeout $(eval echo \${BENCH_TIMEOUT_${setting/-/_}:-${BENCH_TIMEOUT:-240}}) torchrun --nproc-per-node "$NGPU" \
        -m benchmarks.ops $args --out "$OUT/${gpu}x$NGPU-$setting$TAG.json" >> "$OUT/bench-$setting$TAG.log" 2>&1
    exited "bench $setting$TAG"
    sed -n '/^gemm_all_reduce, path\|^gemm_reduce_scatter, path\|^all_gather_gemm, path/,/^$/p' "$OUT/bench-$setting$TAG.log"
    grep -iE "error|Traceback" "$OUT/bench-$setting$TAG.log" | head -5
done
kill $SMI 2>/dev/null
exit_failed
