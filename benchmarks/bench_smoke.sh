#!/usr/bin/env bash
# A one-GPU smoke of the commands that time on the GPU: the installed `flashoverlap bench ops`, the harness's
# `benchmarks.ops` (with the timeline picture), `tune bandwidth` and `tune plan`, each at a small shape on a one-rank
# NCCL group. Prints each command's exit status and the end of its log; logs, results and the cache in $OUT. Exits
# 2 on a machine without a CUDA GPU (before anything runs), 1 when any command failed (after running the rest).
# Usage (from the repository root): [OUT=dir] [SHAPE=M,N,K] bash benchmarks/bench_smoke.sh
set -u
OUT=${OUT:-/tmp/flashoverlap-smoke}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package, and the harness (benchmarks)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 FLASHOVERLAP_CACHE_DIR=$OUT/cache
source "$(dirname "$0")/steps.sh"; gpus_at_least 1  # and exited, exit_failed
S=${SHAPE:-2048,1024,1024}; OPS=all_reduce,reduce_scatter,all_gather
step() {  # step <name> <timeout> <command...>
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    exited "$name"; tail -"${SHOW:-12}" "$OUT/$name.log"
}
step bench-ops 150 torchrun --nproc-per-node 1 -m flashoverlap bench ops --ops $OPS --shapes $S --iters 3 \
    --out "$OUT/bench.json"
step harness-ops 200 torchrun --nproc-per-node 1 -m benchmarks.ops --ops $OPS --shapes $S --iters 3 \
    --timeline "$OUT/timeline.png" --out "$OUT/harness.json"
step tune-bandwidth 120 torchrun --nproc-per-node 1 -m flashoverlap tune bandwidth --ops all_reduce --max-mib 4
step tune-plan 150 torchrun --nproc-per-node 1 -m flashoverlap tune plan --op all_reduce --shape $S --top 2
exit_failed
