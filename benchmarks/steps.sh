# Sourced by the device scripts: ``has NAME`` (whether STEPS names the step), and ``check_words VAR NOUN KNOWN``:
# every word of $VAR is one of KNOWN and there is at least one, else an error naming it before anything runs (a
# misspelt step or setting would otherwise run nothing, or the wrong thing, and exit 0).
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
