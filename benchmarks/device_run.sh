#!/usr/bin/env bash
# One device call (2x H200): P2P smoke per op (under FLASHOVERLAP_DEBUG_TIMEOUT: an error, not a hang), the
# nvlink benchmark grid of all three ops (sequential, decomposition, async TP, NCCL path, P2P path, path="auto"),
# the host-time shapes, then the GPU tests; each step under its own timeout. Logs and JSON land in $OUT.
# Usage: FLASHOVERLAP_COMMIT=<sha> [STEPS="smoke sweep bench host profile tests pcie block-nvlink block-pcie-like
#        reliability faults ring-nvlink ring-pcie-like block-profile moe-nvlink moe-pcie-like hf-nvlink hf-pcie-like"]
#        [TESTS_K=<pytest -k>] [BLOCK_ARGS=...]
#        bash benchmarks/device_run.sh
# (FLASHOVERLAP_COMMIT: the commit of the tree sent; the device copy's own git HEAD may be stale.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
STEPS=${STEPS-smoke bench host tests}
KNOWN_STEPS="smoke sweep bench host profile tests pcie block-nvlink block-pcie-like reliability faults ring-nvlink ring-pcie-like block-profile moe-nvlink moe-pcie-like hf-nvlink hf-pcie-like"
source "$(dirname "$0")/steps.sh"; check_words STEPS step "$KNOWN_STEPS"  # and has
gpus_at_least 2  # sets NGPU
gpu_model; gpu=${GPU}x$NGPU
bench() {  # setting, tag, extra args, timeout
    local env=""; [[ $1 == pcie-like ]] && env="NCCL_P2P_DISABLE=1"
    local cmd="$env torchrun --nproc-per-node $NGPU -m benchmarks.ops ${3}"
    echo "== $cmd" | tee "$OUT/bench-$1$2.log"
    env $env FLASHOVERLAP_COMMAND="$cmd" timeout $4 torchrun --nproc-per-node $NGPU -m benchmarks.ops $3 \
        --out "$OUT/$gpu-$1$2.json" >> "$OUT/bench-$1$2.log" 2>&1; exited "bench $1$2"
    sed -n '/^gemm_all_reduce, path\|^gemm_reduce_scatter, path\|^all_gather_gemm, path/,/^$/p' "$OUT/bench-$1$2.log"
    grep -iE "error|Traceback" "$OUT/bench-$1$2.log" | head -5
}
if has smoke; then
    for op in reduce_scatter all_reduce all_gather; do
        FLASHOVERLAP_DEBUG_TIMEOUT=20 timeout ${SMOKE_TIMEOUT:-90} torchrun --nproc-per-node $NGPU \
            -m benchmarks.diagnostics.p2p_smoke $op > "$OUT/smoke-$op.log" 2>&1; exited "smoke $op"
        grep -E "rank 0:|Error|error" "$OUT/smoke-$op.log" | tail -8
    done
fi
if has sweep; then
    timeout ${SWEEP_TIMEOUT:-150} torchrun --nproc-per-node $NGPU -m benchmarks.diagnostics.p2p_sub_bands \
        "$OUT/$gpu-nvlink-sub-bands.json" > "$OUT/sub-bands.log" 2>&1; exited "sweep"
    grep -vE "^W[0-9]|Warning|warn" "$OUT/sub-bands.log" | tail -16
fi
has bench && bench nvlink "" "--ops all_reduce,reduce_scatter,all_gather" ${BENCH_TIMEOUT:-300}
has host && bench nvlink -host "--ops all_reduce,reduce_scatter,all_gather --shapes 16,8192,8192;4096,8192,8192" 120
has pcie && bench pcie-like "" "--ops all_reduce,reduce_scatter,all_gather" ${BENCH_TIMEOUT:-300}
if has profile; then
    timeout 120 torchrun --nproc-per-node $NGPU -m benchmarks.diagnostics.host_profile p2p > "$OUT/host-profile.log" 2>&1
    exited "profile"; grep -E "^==|tottime|^ +[0-9]" "$OUT/host-profile.log" | head -60
fi
for setting in nvlink pcie-like; do
    has block-$setting || continue
    env=""; [[ $setting == pcie-like ]] && env="NCCL_P2P_DISABLE=1"
    cmd="$env torchrun --nproc-per-node $NGPU -m benchmarks.block ${BLOCK_ARGS:-}"
    echo "== $cmd" | tee "$OUT/block-$setting.log"
    env $env FLASHOVERLAP_COMMAND="$cmd" timeout ${BLOCK_TIMEOUT:-300} torchrun --nproc-per-node $NGPU \
        -m benchmarks.block ${BLOCK_ARGS:-} --out "$OUT/$gpu-$setting-block.json" >> "$OUT/block-$setting.log" 2>&1
    exited "block $setting"; grep -E "tokens:|Error|error" "$OUT/block-$setting.log" | tail -8
done
for setting in nvlink pcie-like; do  # the ring over NCCL send/recv beside the NCCL path
    has ring-$setting || continue
    env=""; [[ $setting == pcie-like ]] && env="NCCL_P2P_DISABLE=1"
    env $env timeout ${RING_TIMEOUT:-200} torchrun --nproc-per-node $NGPU -m benchmarks.diagnostics.ring_nccl \
        "$OUT/$gpu-$setting-ring.json" > "$OUT/ring-$setting.log" 2>&1; exited "ring $setting"
    grep -vE "^W[0-9]|Warning|warn" "$OUT/ring-$setting.log" | tail -16
done
if has block-profile; then  # where the block's training step spends GPU time, per implementation
    timeout ${PROFILE_TIMEOUT:-240} torchrun --nproc-per-node $NGPU -m benchmarks.diagnostics.block_profile \
        ${PROFILE_TOKENS:-8192} train > "$OUT/block-profile.log" 2>&1; exited "block-profile"
    grep -E "^==|^ +[0-9.]+ ms" "$OUT/block-profile.log" | head -60
fi
if has reliability; then
    timeout ${RELIABILITY_TIMEOUT:-400} torchrun --nproc-per-node $NGPU benchmarks/reliability.py \
        --calls ${RELIABILITY_CALLS:-10000} --out "$OUT/$gpu-reliability.json" > "$OUT/reliability.log" 2>&1
    exited "reliability"; grep -vE "^W[0-9]|Warning|warn" "$OUT/reliability.log" | tail -30
fi
if has faults; then  # one process per fault scenario (a missing-peer error leaves the GPU busy for good)
    : > "$OUT/faults.log"
    for scenario in $(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import reliability; \
            print(' '.join(':'.join(s) for s in reliability.SCENARIOS))"); do
        timeout ${FAULT_TIMEOUT:-40} torchrun --nproc-per-node $NGPU benchmarks/reliability.py --fault $scenario \
            --fault-timeout 3 --out "$OUT/fault-$scenario.json" >> "$OUT/faults.log" 2>&1
        exited "fault $scenario" >> "$OUT/faults.log"
    done
    grep -E "^\[.*fault|exit" "$OUT/faults.log" | cut -c1-200
fi
for setting in nvlink pcie-like; do  # the MoE layer (issue 22): every config, routing, mode, path, both passes
    has moe-$setting || continue
    env=""; [[ $setting == pcie-like ]] && env="NCCL_P2P_DISABLE=1"
    paths=${MOE_PATHS:-auto nccl p2p}; [[ $setting == pcie-like ]] && paths=${MOE_PATHS:-auto nccl}
    cmd="$env torchrun --nproc-per-node $NGPU -m benchmarks.moe --paths $paths ${MOE_ARGS:-}"
    echo "== $cmd" | tee "$OUT/moe-$setting.log"
    env $env FLASHOVERLAP_COMMAND="$cmd" timeout ${MOE_TIMEOUT:-540} torchrun --nproc-per-node $NGPU \
        -m benchmarks.moe --paths $paths ${MOE_ARGS:-} --out "$OUT/$gpu-$setting-moe.json" \
        >> "$OUT/moe-$setting.log" 2>&1
    exited "moe $setting"; grep -vE "^W[0-9]|Warning|warn" "$OUT/moe-$setting.log" | tail -20
done
for setting in nvlink pcie-like; do  # the Hugging Face Llama example at an 8B shape (issue 22): styles, pass, baselines
    has hf-$setting || continue
    env=""; [[ $setting == pcie-like ]] && env="NCCL_P2P_DISABLE=1"
    cmd="$env torchrun --nproc-per-node $NGPU examples/hf_llama_tp.py ${HF_ARGS:-}"
    echo "== $cmd" | tee "$OUT/hf-$setting.log"
    env $env FLASHOVERLAP_COMMAND="$cmd" timeout ${HF_TIMEOUT:-540} torchrun --nproc-per-node $NGPU \
        examples/hf_llama_tp.py ${HF_ARGS:-} --out "$OUT/$gpu-$setting-hf-llama.json" >> "$OUT/hf-$setting.log" 2>&1
    exited "hf $setting"; grep -vE "^W[0-9]|Warning|warn" "$OUT/hf-$setting.log" | tail -20
done
if has tests; then
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -x -v --durations=0 tests/gpu ${TESTS_K:+-k "$TESTS_K"} \
        > "$OUT/gpu-tests.log" 2>&1
    exited "tests"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-tests.log" | tail -30
fi
exit_failed
