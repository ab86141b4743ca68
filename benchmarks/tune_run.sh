#!/usr/bin/env bash
# The device call behind the committed model checks: per setting, the bandwidth curves, `tune validate` (the
# model's pick and every candidate timed at each grid shape; it leaves each shape's best plan in the cache), then
# the benchmark with that cache in place (the "tuned" results). Logs and the cache come back as one tarball.
# Usage: FLASHOVERLAP_COMMIT=<sha> [SETTINGS="nvlink pcie-like"] [OPS=...] [VALIDATE_TIMEOUT_<setting>=s]
#        bash benchmarks/tune_run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT/logs"
export FLASHOVERLAP_CACHE_DIR=$OUT/logs/cache
SETTINGS=${SETTINGS-nvlink pcie-like}; OPS=${OPS-all_reduce,reduce_scatter,all_gather}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name().split()[-1].lower())')
run() {  # run <timeout> <log> <command...>: the command, its exit status and the last lines that matter
    local limit=$1 log=$2; shift 2
    echo "== $*" > "$log"; timeout "$limit" "$@" >> "$log" 2>&1; echo "exit $? after <= ${limit}s: $*"
    grep -E "predicted .* measured .*pick|model error|stored|^ +[0-9]+x|Error" "$log" | tail -20
}
for setting in $SETTINGS; do
    [[ $setting == pcie-like ]] && export NCCL_P2P_DISABLE=1 || unset NCCL_P2P_DISABLE
    t="torchrun --nproc-per-node $NGPU -m flashoverlap"
    run 30 "$OUT/logs/bandwidth-$setting.log" $t tune bandwidth --max-mib 256 --ops "$OPS"
    cmd="$t tune validate --ops $OPS"; [[ $setting == pcie-like ]] && cmd="NCCL_P2P_DISABLE=1 $cmd"
    FLASHOVERLAP_COMMAND="$cmd" run "$(eval echo \${VALIDATE_TIMEOUT_${setting/-/_}:-420})" \
        "$OUT/logs/validate-$setting.log" $t tune validate --ops "$OPS" --out "$OUT/${gpu}x$NGPU-$setting-model.json"
    cmd="FLASHOVERLAP_CACHE_DIR=<tuned> $t.bench --ops $OPS"; [[ $setting == pcie-like ]] && cmd="NCCL_P2P_DISABLE=1 $cmd"
    FLASHOVERLAP_COMMAND="$cmd" run 60 "$OUT/logs/bench-tuned-$setting.log" \
        torchrun --nproc-per-node "$NGPU" -m flashoverlap.bench --ops "$OPS" --out "$OUT/${gpu}x$NGPU-$setting-tuned.json"
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
