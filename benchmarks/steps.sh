# Sourced by the device scripts: ``has NAME`` (whether STEPS names the step), ``check_words VAR NOUN KNOWN``:
# every word of $VAR is one of KNOWN and there is at least one, else an error naming it before anything runs (a
# misspelt step or setting would otherwise run nothing, or the wrong thing, and exit 0), and ``gpus_at_least N``:
# NGPU set to this machine's CUDA GPUs, else (fewer than N) an error before anything runs (on a CPU machine a
# script's steps used to fail one by one, or fall into a dry run, and the script exited 0), and ``gpu_model``: GPU
# set to the GPU's tag for the results files' names, else an error (they were named ``x2-...``). Then ``exited NAME
# [CODE]``: prints "NAME: exit CODE" (CODE: the status of the command just before it, unless given) and counts a
# non-zero CODE in FAILED, and ``exit_failed``, a script's last line: exit 1 naming the count when any step failed,
# else 0 (the scripts ended in `true` or their last step's status: every step failed and the script exited 0).
has() { [[ " $STEPS " == *" $1 "* ]]; }
check_words() {
    local name=$1 noun=$2 known=$3 word
    local value=${!name}
    if [[ -z "${value// /}" ]]; then
        echo "$(basename "$0"): $name names no $noun (${noun}s: $known)" >&2
        exit 2
    fi
    for word in $value; do
        if [[ " $known " != *" $word "* ]]; then
            echo "$(basename "$0"): unknown $noun '$word' in $name (${noun}s: $known)" >&2
            exit 2
        fi
    done
}
gpus_at_least() {
    NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
    if (( NGPU < $1 )); then
        echo "$(basename "$0"): needs $1 or more CUDA GPUs, this machine has $NGPU" >&2
        exit 2
    fi
}
gpu_model() {  # GPU=the results files' GPU tag (h200, h100: benchmarks.harness.gpu_tag), else an error
    GPU=$(python3 -m benchmarks.harness.gpu_tag) || { echo "$(basename "$0"): cannot tell the GPU's model" >&2; exit 2; }
}
FAILED=0
exited() {
    local code=$?
    (( $# > 1 )) && code=$2
    echo "$1: exit $code"
    (( code == 0 )) || FAILED=$((FAILED + 1))
    return 0
}
exit_failed() {
    if (( FAILED )); then
        echo "$(basename "$0"): $FAILED step(s) failed: their logs in ${OUT:-the output folder} say why, their files are missing or partial" >&2
        exit 1
    fi
    exit 0
}
