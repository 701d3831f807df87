#!/usr/bin/env bash
# One GPU, one command: scripts/gpu_check.py's parts (default run, engine vs HF generate and the update pause,
# learner tokens/s and MFU, learner + engine on one GPU, several LoRA policies in one batch), each printing FIGURE
# lines that a closing block sums up.
#
#   bash scripts/gpu_check.sh [--device cuda|cpu] [gpu_check.py options...]
#
# --device cuda (default; a GPU machine with torch and transformers but no network): installs the wheels that
#   scripts/gpu_wheels.py put in .whl/ (pyzmq, omegaconf, deepspeed, math-verify, ...) into /tmp/arl-site without
#   touching the machine's own packages, and runs the project from this working tree (PYTHONPATH); sized for
#   10 minutes on one H100.
# --device cpu: the dry run of the same code on this machine's Python (PYTHON, else python3), small sizes.
# The whole output goes to $OUT/gpu-check.log when OUT is set, else to runs/gpu-check-<time>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="${2:?--device needs cuda or cpu}"; shift 2 ;;
        --device=*) DEVICE="${1#--device=}"; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"; LOG="$OUT/gpu-check.log"; OUT_DIR="$OUT"
else
    mkdir -p runs; LOG="runs/gpu-check-$(date -u +%Y%m%d-%H%M%S).log"; OUT_DIR=""
fi
check() {
    echo "gpu-check: --device $DEVICE, log $LOG, $(date -u)"
    PY=${PYTHON:-python3}
    if [ "$DEVICE" = cuda ]; then
        command -v nvidia-smi >/dev/null && nvidia-smi -L
        if ls .whl/*.whl >/dev/null 2>&1; then
            SITE=/tmp/arl-site
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
                || { echo "gpu-check: installing the carried wheels failed"; exit 1; }
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
            echo "gpu-check: installed $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
        else
            echo "gpu-check: no .whl/ here (python scripts/gpu_wheels.py makes it); using the installed packages"
        fi
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    "$PY" scripts/gpu_check.py --device "$DEVICE" --out-dir "$OUT_DIR" "${ARGS[@]}"
    rc=$?
    echo "gpu-check: exit $rc, whole output in $LOG"
    exit $rc
}
check 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
