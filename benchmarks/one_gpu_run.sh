#!/usr/bin/env bash
# One device call on ONE GPU (the two-GPU kinds withheld): the tests that need one GPU (compiled kernels), the
# ranks of flashoverlap.testing.spawn on a one-rank NCCL group (the forkserver start with CUDA), then the one-GPU
# diagnostics that write the committed results: P2P mechanics and host time (two processes), the expert paths'
# mechanics and an MoE layer's host time (two processes), the sequential plan's host time in parts (one process).
# Logs and JSON land in $OUT.
# Usage: FLASHOVERLAP_COMMIT=$(git rev-parse --short=10 HEAD) [STEPS="tests spawn p2p moe sequential fp8"] \
#        bash benchmarks/one_gpu_run.sh
# Steps not in the default set (each a re-measurement of an open issue's figures; results under $OUT, to be merged
# into benchmarks/results by hand): fp8parts (where an eager fp8 NCCL call's extra host time goes, issue 41), p2p8 (the P2P path's fp8 mechanics and host time, two processes), fp8moe (fp8 MoE layer host time, issue 44), hostbound (the Llama loops, issue 41),
# shared (moe-fp8 mechanics and host time with ranks sharing the GPU, issue 42), fp8tiles (the fp8 grouped GEMM's tile
# sweep, issue 44's block-wise target), soak (10,000 checked calls at each W of SOAK_WORLDS, default 8, which alone
# takes about 9 minutes: then SOAK_WORLDS=2,4 SOAK_BUDGET=320), faults (every fault scenario at W = 4, issue 42),
# torchao (experts converted by torchao's MoE training against torchao's unsharded model, issue 44: torchao is not
# installed on the device; unpack its wheel here first, `pip download --no-deps torchao==0.18.0 -d /tmp/w && unzip -q
# /tmp/w/torchao-*.whl -d .carry/torchao`, and pass `carry: [".carry/torchao"]` to the device call; about 90 s).
# Each step's timeout is its budget: a device call runs 600 s at most, so split them, e.g. STEPS=tests (420 s: a fresh
# machine compiles every kernel first, which took more than 240 s on an H100; a warm one ran it in 67 s), then
# "fp8moe hostbound" (500 s), "fp8tiles" (420 s), "shared" (325 s), "soak" (580 s), "faults" (300 s).
# (FLASHOVERLAP_COMMIT: the commit of the tree sent; the device copy's own git HEAD may be stale.)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
STEPS=${STEPS-tests spawn p2p moe sequential fp8}
KNOWN_STEPS="tests spawn p2p p2p8 moe fp8 sequential fp8moe hostbound fp8parts shared fp8tiles soak faults torchao"
source "$(dirname "$0")/steps.sh"; check_words STEPS step "$KNOWN_STEPS"  # and has
gpus_at_least 1
commit=${FLASHOVERLAP_COMMIT:-unknown}
gpu_model; gpu=${GPU}x1  # the results files' names: h200x1-..., h100x1-...
if has tests; then  # what a single GPU runs of the suite: the compiled kernels' tests and the one-GPU tests (the two-GPU ones skip)
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:randomly tests/kernels tests/gpu > "$OUT/gpu-tests-$commit.log" 2>&1
    exited "tests"; tail -3 "$OUT/gpu-tests-$commit.log"
fi
if has spawn; then  # testing.spawn's ranks (forkserver) reach CUDA: the demo's rank body on a one-rank NCCL group
    timeout 120 python3 -c '
import torch
from flashoverlap.demo import _run_gemm
from flashoverlap.testing import rank_context, spawn
print(rank_context().get_start_method(), spawn(_run_gemm, 1, "nccl", args=("all_reduce", 512, 256, 384, torch.bfloat16, True)))
' > "$OUT/spawn-$commit.log" 2>&1; exited "spawn"; tail -3 "$OUT/spawn-$commit.log"
fi
if has p2p; then
    CUDA_VISIBLE_DEVICES=0 timeout ${P2P_TIMEOUT:-300} torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_one_gpu \
        "$OUT/${gpu}-host.json" > "$OUT/p2p-one-gpu-$commit.log" 2>&1; exited "p2p"
    grep -E "checked|Error|error" "$OUT/p2p-one-gpu-$commit.log" | tail -5
fi
if has p2p8; then  # the P2P path's fp8 calls: mechanics (every op x mode, eager and replayed) and host time beside bf16
    CUDA_VISIBLE_DEVICES=0 timeout ${P2P8_TIMEOUT:-240} torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_fp8_one_gpu \
        "$OUT/${gpu}-p2p-fp8.json" > "$OUT/p2p-fp8-one-gpu-$commit.log" 2>&1; exited "p2p8"
    grep -E "checked|Error|error|FAILED|host " "$OUT/p2p-fp8-one-gpu-$commit.log" | tail -8
fi
if has moe; then
    CUDA_VISIBLE_DEVICES=0 timeout ${MOE_TIMEOUT:-300} torchrun --nproc-per-node 2 -m benchmarks.diagnostics.moe_one_gpu \
        "$OUT/${gpu}-moe-host.json" > "$OUT/moe-one-gpu-$commit.log" 2>&1; exited "moe"
    grep -E "checked|Error|error" "$OUT/moe-one-gpu-$commit.log" | tail -5
fi
if has fp8; then  # fp8 calls' host time beside bf16's, same op and path (one process, a one-rank NCCL group)
    CUDA_VISIBLE_DEVICES=0 timeout ${FP8_TIMEOUT:-120} torchrun --nproc-per-node 1 -m benchmarks.diagnostics.fp8_host \
        "$OUT/${gpu}-fp8-host.json" > "$OUT/fp8-host-$commit.log" 2>&1; exited "fp8"
    timeout ${FP8_GEMM_TIMEOUT:-200} python3 benchmarks/diagnostics/fp8_gemm.py "$OUT/${gpu}-fp8-gemm.json" \
        > "$OUT/fp8-gemm-$commit.log" 2>&1; exited "fp8 gemm"; grep "^nccl" "$OUT/fp8-gemm-$commit.log"
fi
if has sequential; then
    timeout ${SEQ_TIMEOUT:-180} torchrun --nproc-per-node 1 -m benchmarks.diagnostics.sequential_host \
        "$OUT/sequential-host-$commit.json" > "$OUT/sequential-host-$commit.log" 2>&1; exited "sequential"
    grep -E "^\{" "$OUT/sequential-host-$commit.log" | cut -c1-400
fi
if has fp8moe; then  # the fp8 MoE layer's host time beside bf16's (issue 44), single calls and loops in parts
    # FP8MOE_ARGS: more options, e.g. "--new-routing" (exact mode with a new routing every call, as in training)
    timeout ${FP8MOE_TIMEOUT:-200} python3 -m benchmarks.diagnostics.fp8_moe_host --out "$OUT" --iters 60 --parts ${FP8MOE_ARGS:-} \
        > "$OUT/fp8-moe-host-$commit.log" 2>&1; exited "fp8moe"; grep -E "ratio|layer" "$OUT/fp8-moe-host-$commit.log" | tail -12
fi
if has hostbound; then  # the host-bound loops at Llama-70B TP = 8 shapes, bf16 and fp8 row-wise (issue 41)
    timeout ${HOSTBOUND_TIMEOUT:-300} python3 -m benchmarks.host_bound "$OUT/host-bound-llama-$commit.json" --shapes=llama \
        > "$OUT/host-bound-$commit.log" 2>&1; exited "hostbound"; tail -3 "$OUT/host-bound-$commit.log"
fi
if has fp8parts; then  # where an eager fp8 NCCL-path call's extra host time goes, beside bf16's (issue 41)
    timeout ${FP8PARTS_TIMEOUT:-200} python3 -m benchmarks.diagnostics.fp8_eager_parts "$OUT/fp8-eager-parts-$commit.json" \
        > "$OUT/fp8-eager-parts-$commit.log" 2>&1; exited "fp8parts"; grep -v "^   " "$OUT/fp8-eager-parts-$commit.log" | tail -6
fi
if has shared; then  # ranks sharing the GPU (issue 42), W = 2, 4, 8: the expert families' mechanics and the tensor-parallel
    # smoke (every repeated call replayed: both P2P paths' graphs wait with the wait kernel), then host time per call
    timeout ${SHARED_TIMEOUT:-110} python3 -m benchmarks.shared_ranks --step mechanics --worlds 2,4,8 \
        --families moe,moe-fp8,models --budget 105 --out "$OUT/mech" > "$OUT/shared-mech-$commit.log" 2>&1
    exited "shared mechanics"; tail -3 "$OUT/shared-mech-$commit.log"
    timeout 55 python3 -m benchmarks.shared_ranks --step mechanics --worlds 2,4,8 --families tp --quick --budget 50 \
        --out "$OUT/mech-tp" > "$OUT/shared-mech-tp-$commit.log" 2>&1; exited "shared tp smoke"
    timeout ${SHARED_HOST_TIMEOUT:-150} python3 -m benchmarks.shared_ranks --step host --worlds 8,4,2 --budget 145 \
        --out "$OUT/shared" > "$OUT/shared-host-$commit.log" 2>&1; exited "shared host"
fi
if has fp8tiles; then  # the fp8 grouped GEMM's tiles, block- and row-wise, beside bf16 _grouped_mm (issue 44)
    # FP8TILES_ARGS: options of the sweep, e.g. "--scalings block" (word-split: options only, no spaces in values)
    timeout ${FP8TILES_TIMEOUT:-420} python3 -m benchmarks.diagnostics.fp8_grouped_tiles ${FP8TILES_ARGS:-} \
        --out "$OUT/${gpu}-fp8-grouped-tiles-$commit.json" > "$OUT/fp8-grouped-tiles-$commit.log" 2>&1
    exited "fp8tiles"; grep -E "^\[" "$OUT/fp8-grouped-tiles-$commit.log" | cut -c1-200
fi
if has soak; then  # the soak (issue 42): at least 10,000 random calls per W, each checked, memory sampled
    timeout $(( ${SOAK_BUDGET:-540} + 40 )) python3 -m benchmarks.shared_ranks --step soak --worlds "${SOAK_WORLDS:-8}" \
        --calls 10000 --budget "${SOAK_BUDGET:-540}" --out "$OUT/soak" > "$OUT/soak-$commit.log" 2>&1
    exited "soak"; grep -E "^soak W=" "$OUT/soak-$commit.log" | cut -c1-300
fi
if has faults; then  # every fault scenario at W = 4 (issue 42): each surviving rank must name the op, group and rank
    timeout ${FAULTS_TIMEOUT:-300} python3 -m benchmarks.shared_ranks --step faults --worlds 4 --timeout 4 --budget $(( ${FAULTS_TIMEOUT:-300} - 20 )) \
        --out "$OUT/faults" > "$OUT/faults-$commit.log" 2>&1; exited "faults"; tail -4 "$OUT/faults-$commit.log"
fi
if has torchao; then  # torchao-converted experts on one GPU: ours against torchao's unsharded model (issue 44)
    if [[ -d .carry/torchao/torchao ]]; then
        PYTHONPATH=$PWD/.carry/torchao:$PYTHONPATH timeout ${TORCHAO_TIMEOUT:-200} python3 -m pytest -q -s -p no:randomly \
            tests/moe/test_fp8_torchao.py -k one_gpu > "$OUT/torchao-converted-one-gpu-$commit.log" 2>&1
        exited "torchao"; grep -E "ours|passed|failed|skipped" "$OUT/torchao-converted-one-gpu-$commit.log" | tail -8
    else
        echo "torchao: .carry/torchao/torchao missing: unpack torchao's wheel there and carry it (see the top)"; exited "torchao" 1
    fi
fi
exit_failed
