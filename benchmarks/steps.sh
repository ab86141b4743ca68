# Sourced by the device scripts (device_run, head_run, one_gpu_run, tune_run) after they set STEPS and KNOWN_STEPS:
# every name in STEPS must be one of the script's steps (a misspelt step would otherwise run nothing and exit 0),
# and STEPS must name at least one. ``has NAME``: whether STEPS names the step.
has() { [[ " $STEPS " == *" $1 "* ]]; }
check_steps() {
    local step
    if [[ -z "${STEPS// /}" ]]; then
        echo "$(basename "$0"): STEPS names no step (steps: $KNOWN_STEPS)" >&2
        exit 2
    fi
    for step in $STEPS; do
        if [[ " $KNOWN_STEPS " != *" $step "* ]]; then
            echo "$(basename "$0"): unknown step '$step' (steps: $KNOWN_STEPS)" >&2
            exit 2
        fi
    done
}
check_steps
