#!/usr/bin/env bash
# The prepared single-GPU check (issue 14, item 3), <= 8 minutes in all:
#
#   bash benchmarks/device_check.sh [OUT_DIR]    # default $OUT/device_check, else device_check_out
#
#   (a) pytest      python -m pytest -q -m cuda: the tests that use CUDA where it exists
#   (b) parity      one training step, CUDA bf16 vs CPU fp32 (tiny model, same seed/weights)
#   (c) throughput  the 1.2B model (Llama style) at 32K tokens, bf16, full recompute:
#                   tokens/s, TFLOP/s, MFU, peak memory vs the memory plan
#   (d) hf          transformers' LlamaForCausalLM of the same shape: the ratio ours/hf
#
# Each part runs in its own process under `timeout` (limits: DC_LIMIT_A..D seconds); a part
# that fails or times out is reported and the next one still runs. The whole is capped at
# DC_TOTAL seconds (default 460): a later part gets what is left. OUT_DIR gets each part's
# log and JSON, parts.tsv, device_check.json and device_check.md (benchmarks/device_check.py
# says what each part measures). Exit status: 0 when every part passed or was skipped.
# Without a CUDA device (b)-(d) are skipped, (a) runs with its tests skipped, and it exits 0.
set -u
cd "$(dirname "$0")/.."

if [ $# -ge 1 ] && [ -n "$1" ]; then
    OUT_DIR=$1
elif [ -n "${OUT:-}" ]; then
    OUT_DIR=$OUT/device_check
else
    OUT_DIR=device_check_out
fi
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python}
TOTAL=${DC_TOTAL:-460}
RESERVE=20  # seconds kept for the report
: > "$OUT_DIR/parts.tsv"
failed=0

# run_part NAME LIMIT CMD...: runs CMD under min(LIMIT, what is left), output to the
# console and NAME.log; appends "NAME<TAB>exit status<TAB>seconds<TAB>limit" to parts.tsv
run_part() {
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL - RESERVE - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "== $name: no time left (total cap ${TOTAL} s)"
        printf '%s\t124\t0\t%s\n' "$name" "$limit" >> "$OUT_DIR/parts.tsv"
        failed=1
        return
    fi
    echo "== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$OUT_DIR/parts.tsv"
    if [ "$rc" -ne 0 ]; then
        failed=1
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            echo "== $name: timed out after ${limit} s"
        else
            echo "== $name: failed (exit status $rc)"
        fi
    fi
}

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    cuda=1
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
else
    cuda=0
    echo "no CUDA device: parts (a)-(d) skipped"
fi

# (a) runs everywhere: without CUDA every test it selects skips
run_part pytest "${DC_LIMIT_A:-150}" "$PY" -m pytest -q -m cuda -p no:cacheprovider
if [ "$cuda" -eq 1 ]; then
    run_part parity "${DC_LIMIT_B:-45}" "$PY" benchmarks/device_check.py parity --out "$OUT_DIR"
    run_part throughput "${DC_LIMIT_C:-140}" "$PY" benchmarks/device_check.py throughput --out "$OUT_DIR"
    run_part hf "${DC_LIMIT_D:-100}" "$PY" benchmarks/device_check.py hf --out "$OUT_DIR"
else
    for name in parity throughput hf; do
        printf '%s\tskipped\t0\t0\n' "$name" >> "$OUT_DIR/parts.tsv"
    done
fi

echo "== report ($OUT_DIR/device_check.json, $OUT_DIR/device_check.md)"
timeout -k 5 "$RESERVE" "$PY" benchmarks/device_check.py report --out "$OUT_DIR" || failed=1
echo "== done in ${SECONDS} s"
exit $failed
