#!/usr/bin/env bash
# Issue 36 in one device call on TWO GPUs (nvidia-h200-x2): the fp8 grid (benchmarks/fp8_ops.py) and the float8
# block (benchmarks/fp8_block.py) in each setting, nvlink (NCCL's defaults) and pcie-like (NCCL_P2P_DISABLE=1).
# Results land in $OUT (default /tmp/flashoverlap-out) as <gpus>-<setting>-fp8.json and <gpus>-<setting>-fp8-block.json
# (<gpus>: h200x2 on two H200s, from the GPUs' name and count), with their logs; copy them into benchmarks/results/
# and run `python benchmarks/readme_tables.py --write`.
# Usage: FLASHOVERLAP_COMMIT=$(git rev-parse --short=10 HEAD) [SETTINGS="nvlink pcie-like"] [OUT=DIR] \
#        bash benchmarks/fp8_two_gpu_run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT"
SETTINGS=${SETTINGS-nvlink pcie-like}
source "$(dirname "$0")/steps.sh"; check_words SETTINGS setting "nvlink pcie-like"
gpus_at_least 2  # sets NGPU
commit=${FLASHOVERLAP_COMMIT:?set FLASHOVERLAP_COMMIT to the commit of the tree sent (the results files name it)}
gpu_model; gpu=${GPU}x2
failed=0  # the number of steps that did not exit 0: the script's exit status says whether every file is whole
for setting in $SETTINGS; do
    extra=(); [[ $setting == pcie-like ]] && extra=(env NCCL_P2P_DISABLE=1)
    "${extra[@]}" timeout ${OPS_TIMEOUT:-540} torchrun --nproc-per-node 2 -m benchmarks.fp8_ops \
        --out "$OUT/$gpu-$setting-fp8.json" > "$OUT/fp8-ops-$setting-$commit.log" 2>&1
    code=$?; (( code )) && failed=$((failed + 1)); echo "fp8 ops $setting: exit $code"; tail -4 "$OUT/fp8-ops-$setting-$commit.log"
    "${extra[@]}" timeout ${BLOCK_TIMEOUT:-540} torchrun --nproc-per-node 2 -m benchmarks.fp8_block \
        --out "$OUT/$gpu-$setting-fp8-block.json" > "$OUT/fp8-block-$setting-$commit.log" 2>&1
    code=$?; (( code )) && failed=$((failed + 1)); echo "fp8 block $setting: exit $code"
    tail -4 "$OUT/fp8-block-$setting-$commit.log"
done
(( failed == 0 )) || { echo "fp8_two_gpu_run.sh: $failed step(s) failed: their files are missing or partial" >&2; exit 1; }
