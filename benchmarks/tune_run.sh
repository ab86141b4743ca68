#!/usr/bin/env bash
# The device call behind the committed model checks, one setting per call: per path, the bandwidth curves and
# slowdowns (`tune bandwidth`), then the model check (`-m benchmarks.model_check`: every candidate timed at each
# grid shape, in the model's order; it leaves each shape's best plan in the cache), then the benchmark with that
# cache in place (the "tuned" results, with a timeline picture showing the model's predicted group times), then
# `tune plan --path auto` at the shapes in AUTO_SHAPES, then the GPU tests named in TESTS. Results and a tarball of
# logs and cache in $OUT.
# Usage: FLASHOVERLAP_COMMIT=<sha> SETTING=nvlink|pcie-like [PATHS="nccl p2p"] [OPS=...] [STEPS="bw validate
#        bench auto tests"] [AUTO_SHAPES="op:M,N,K ..."] [TESTS="pytest args"] [VALIDATE_TIMEOUT=s] [DEADLINE=s]
#        bash benchmarks/tune_run.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package, and the harness (benchmarks)
OUT=${OUT:-/tmp/flashoverlap-out}; mkdir -p "$OUT/logs"
export FLASHOVERLAP_CACHE_DIR=$OUT/logs/cache
SETTING=${SETTING:-nvlink}; OPS=${OPS-all_reduce,reduce_scatter,all_gather}
[[ $SETTING == nvlink || $SETTING == pcie-like ]] || {
    echo "tune_run.sh: SETTING is nvlink or pcie-like, got '$SETTING'" >&2; exit 2; }
[[ $SETTING == pcie-like ]] && PATHS=${PATHS:-nccl} || PATHS=${PATHS:-nccl p2p}
STEPS=${STEPS-bw validate bench auto tests}; AUTO_SHAPES=${AUTO_SHAPES-}; TESTS=${TESTS-}
KNOWN_STEPS="bw validate bench auto tests"
source "$(dirname "$0")/steps.sh"; check_words STEPS step "$KNOWN_STEPS"  # and has
check_words PATHS path "nccl p2p"  # PATHS=" " or a misspelt path would skip bw and validate, or fail in each
[[ $SETTING == pcie-like ]] && export NCCL_P2P_DISABLE=1 || unset NCCL_P2P_DISABLE
prefix=""; [[ $SETTING == pcie-like ]] && prefix="NCCL_P2P_DISABLE=1 "
gpus_at_least 2  # sets NGPU
gpu_model; gpu=$GPU
t="torchrun --nproc-per-node $NGPU -m flashoverlap"
v="torchrun --nproc-per-node $NGPU -m benchmarks.model_check"  # the model check (the harness's)
DEADLINE=${DEADLINE:-570}  # seconds: later steps are cut short or skipped to end within the device call's limit
run() {  # run <timeout> <log> <command...>: the command, its exit status and the last lines that matter
    local limit=$1 log=$2; shift 2
    local start=$SECONDS
    (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
    (( limit < 10 )) && { echo "skipped (deadline): $*"; FAILED=$((FAILED + 1)); return; }  # its file is missing
    echo "== $*" > "$log"; timeout "$limit" "$@" >> "$log" 2>&1
    local code=$?; (( code == 0 )) || FAILED=$((FAILED + 1))
    echo "exit $code after $((SECONDS - start)) s (limit ${limit}s): $*"
    grep -E "predicted .* measured .*pick|model error|stored|^ +[0-9]+x|Error|Plan\(|^ +\[[0-9]+/[0-9]+\] " "$log" \
        | tail -"${SHOW:-20}"
}
for path in $PATHS; do
    has bw && run 60 "$OUT/logs/bandwidth-$SETTING-$path.log" $t tune bandwidth --max-mib 256 --ops "$OPS" --path "$path"
done
for path in $PATHS; do
    name=$SETTING; [[ $path == p2p ]] && name=p2p
    has validate && FLASHOVERLAP_COMMAND="${prefix}$v --ops $OPS --path $path" \
        run "${VALIDATE_TIMEOUT:-240}" "$OUT/logs/validate-$SETTING-$path.log" \
        $v --ops "$OPS" --path "$path" --out "$OUT/${gpu}x$NGPU-$name-model.json"
done
if has bench; then
    shape=16384,8192,4096; [[ $SETTING == pcie-like ]] && shape=8192,8192,8192
    FLASHOVERLAP_COMMAND="${prefix}FLASHOVERLAP_CACHE_DIR=<tuned> torchrun --nproc-per-node $NGPU -m benchmarks.ops --ops $OPS" \
        run 150 "$OUT/logs/bench-tuned-$SETTING.log" torchrun --nproc-per-node "$NGPU" -m benchmarks.ops \
        --ops "$OPS" --out "$OUT/${gpu}x$NGPU-$SETTING-tuned.json"
    FLASHOVERLAP_COMMAND="${prefix}FLASHOVERLAP_CACHE_DIR=<tuned> torchrun --nproc-per-node $NGPU -m benchmarks.ops --shapes $shape --iters 10 --timeline" \
        run 60 "$OUT/logs/timeline-$SETTING.log" torchrun --nproc-per-node "$NGPU" -m benchmarks.ops \
        --shapes "$shape" --iters 10 --timeline "$OUT/timeline-$SETTING.png" --out "$OUT/logs/timeline-$SETTING.json"
fi
has auto && [[ -z ${AUTO_SHAPES// /} ]] && echo "auto: no AUTO_SHAPES given (op:M,N,K ...), nothing planned"
has tests && [[ -z ${TESTS// /} ]] && echo "tests: no TESTS given (pytest arguments), none run"
if has auto; then
    for item in $AUTO_SHAPES; do
        SHOW=8 run 60 "$OUT/logs/plan-auto-$SETTING-${item%%:*}-${item#*:}.log" \
            $t tune plan --path auto --op "${item%%:*}" --shape "${item#*:}"
    done
fi
if has tests && [[ -n $TESTS ]] && (( SECONDS < DEADLINE - 60 )); then
    start=$SECONDS
    FLASHOVERLAP_CACHE_DIR=$(mktemp -d) timeout $((DEADLINE - SECONDS)) python3 -m pytest -q -p no:cacheprovider $TESTS \
        > "$OUT/logs/gpu-tests-$SETTING.log" 2>&1
    code=$?; (( code == 0 )) || FAILED=$((FAILED + 1))
    echo "tests exit $code after $((SECONDS - start)) s"; tail -5 "$OUT/logs/gpu-tests-$SETTING.log"
fi
for log in "$OUT"/logs/*.log; do sed -i 's/.*\r//' "$log"; done  # progress bars: keep each line's last state
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit_failed
