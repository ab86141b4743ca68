#!/usr/bin/env bash
# Issues 45 and 46: every multi-GPU measurement the scripts hold, at HEAD, on all the GPUs of this machine (W = their
# count: 2 on nvidia-h200-x2, 4 or 8 on the larger kinds), in ONE setting per command, each results file written to
# $OUT as its step ends (<gpus>-<setting>-*.json, with its log). In order:
#   fp8-moe   the MoE layer in fp8 (row-wise and one scale per 128 channels) beside bf16 and the plain fp8 layer
#   moe       the MoE layer (bf16), every config, routing, mode and path
#   host      the host-bound loop (benchmarks/host_bound.py) at W
#   bench     the bf16 grid (sequential, decomposition, async TP, NCCL, P2P, auto) and its host-time shapes
#   tests     the GPU test suite at W
#   block     the transformer block
#   hf        the Hugging Face Llama example
#   fp8       the fp8 grid and the float8 block (benchmarks/fp8_two_gpu_run.sh's steps)
#   reliability, faults   10,000 random calls, then each fault scenario
# One device call holds at most 10 minutes: name the steps that fit with STEPS, and call again for the rest.
# Usage: FLASHOVERLAP_COMMIT=$(git rev-parse --short=10 HEAD) [STEPS="fp8-moe moe ..."] \
#        bash benchmarks/head_run.sh nvlink|pcie-like
# Then commit $OUT's JSON under benchmarks/results/ and run `python benchmarks/readme_tables.py --write`.
set -u
SETTING=${1-}
[[ $SETTING == nvlink || $SETTING == pcie-like ]] || {
    echo "head_run.sh: the setting is nvlink or pcie-like, got '$SETTING' (usage: bash benchmarks/head_run.sh nvlink|pcie-like)" >&2
    exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
[[ $SETTING == pcie-like ]] && export NCCL_P2P_DISABLE=1
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
STEPS=${STEPS-fp8-moe moe host bench tests block hf fp8 reliability faults}
KNOWN_STEPS="fp8-moe moe host bench tests block hf fp8 reliability faults"
source "$(dirname "$0")/steps.sh"; check_words STEPS step "$KNOWN_STEPS"  # and has
gpus_at_least 2  # sets NGPU
gpu_model; gpu=${GPU}x$NGPU
paths="auto nccl p2p"; [[ $SETTING == pcie-like ]] && paths="auto nccl"  # NCCL through host memory: P2P does not apply
run() {  # name, timeout, command...: logged, timed out, its exit printed
    local name=$1 limit=$2; shift 2
    echo "== $*" | tee "$OUT/$name-$SETTING.log"
    FLASHOVERLAP_COMMAND="$*" timeout "$limit" "$@" >> "$OUT/$name-$SETTING.log" 2>&1
    exited "$name $SETTING"; grep -vE "^W[0-9]|Warning|warn" "$OUT/$name-$SETTING.log" | tail -${TAIL:-12}
}
has fp8-moe && run fp8-moe ${FP8_MOE_TIMEOUT:-540} torchrun --nproc-per-node "$NGPU" -m benchmarks.moe \
    --paths $paths --precisions bf16 fp8-row fp8-block --out "$OUT/$gpu-$SETTING-fp8-moe.json"
has moe && run moe ${MOE_TIMEOUT:-540} torchrun --nproc-per-node "$NGPU" -m benchmarks.moe --paths $paths \
    --out "$OUT/$gpu-$SETTING-moe.json"
has host && run host-bound ${HOST_TIMEOUT:-400} torchrun --nproc-per-node "$NGPU" -m benchmarks.host_bound \
    "$OUT/$gpu-$SETTING-host-bound.json"
has bench && run bench ${BENCH_TIMEOUT:-300} torchrun --nproc-per-node "$NGPU" -m benchmarks.ops \
    --ops all_reduce,reduce_scatter,all_gather --out "$OUT/$gpu-$SETTING.json"
has bench && run bench-host 120 torchrun --nproc-per-node "$NGPU" -m benchmarks.ops \
    --ops all_reduce,reduce_scatter,all_gather --shapes "16,8192,8192;4096,8192,8192" --out "$OUT/$gpu-$SETTING-host.json"
has tests && run tests ${TESTS_TIMEOUT:-400} env FLASHOVERLAP_TEST_WORLD_SIZE="$NGPU" python3 -m pytest -x -q tests/gpu
has block && run block ${BLOCK_TIMEOUT:-300} torchrun --nproc-per-node "$NGPU" -m benchmarks.block \
    --out "$OUT/$gpu-$SETTING-block.json"
has hf && run hf ${HF_TIMEOUT:-540} torchrun --nproc-per-node "$NGPU" examples/hf_llama_tp.py \
    --out "$OUT/$gpu-$SETTING-hf-llama.json"
has fp8 && run fp8-ops ${FP8_TIMEOUT:-540} torchrun --nproc-per-node "$NGPU" -m benchmarks.fp8_ops \
    --out "$OUT/$gpu-$SETTING-fp8.json"
has fp8 && run fp8-block ${FP8_TIMEOUT:-540} torchrun --nproc-per-node "$NGPU" -m benchmarks.fp8_block \
    --out "$OUT/$gpu-$SETTING-fp8-block.json"
has reliability && run reliability ${RELIABILITY_TIMEOUT:-400} torchrun --nproc-per-node "$NGPU" \
    benchmarks/reliability.py --calls ${RELIABILITY_CALLS:-10000} --out "$OUT/$gpu-$SETTING-reliability.json"
if has faults; then  # one process group per scenario (a missing peer leaves the GPU busy for good)
    for scenario in $(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import reliability; \
            print(' '.join(':'.join(s) for s in reliability.SCENARIOS))"); do
        TAIL=3 run "fault-$scenario" ${FAULT_TIMEOUT:-40} torchrun --nproc-per-node "$NGPU" benchmarks/reliability.py \
            --fault "$scenario" --fault-timeout 3 --out "$OUT/$gpu-$SETTING-fault-$scenario.json"
    done
fi
exit_failed
