#!/usr/bin/env bash
# The Ulysses paper's convergence study (its Figure 8), on CPU: the bundled model trained
# for 200 steps on 4 ranks with Ulysses sp2 x dp2 under ZeRO 1, 2 and 3, with the
# Megatron-SP baseline (tp2 x dp2 --sequence-parallel), and on one process; then one plot
# of every loss curve (plot.py), which also prints each curve's largest difference from
# the one-process curve. Same data, same seed, same global batch everywhere, so in fp32
# the curves must agree to rounding.
#
#   bash examples/convergence/run.sh [OUT_DIR] [more pretrain_gpt.py flags]
#
# OUT_DIR (default runs/convergence) gets one metrics .jsonl and .log per run and
# convergence.png. Extra flags go to every run (after ours, so they win), e.g.
# `--train-iters 20` for a quick look. About 30 min on 2 cores for the default.
# ZERO_STAGES (default "1 2 3") picks the Ulysses runs' ZeRO stages.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/convergence}
shift || true
mkdir -p "$OUT"
COMMON=(--generate 0 --log-interval 1 "$@")
TORCHRUN=(python -m torch.distributed.run --standalone --nproc-per-node 4)

run() {  # run NAME COMMAND...: the command with the common flags, its metrics in OUT/NAME
  local name=$1
  shift
  echo "== $name: $* ${COMMON[*]}"
  "$@" "${COMMON[@]}" --metrics-jsonl "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1 \
    || { tail -n 20 "$OUT/$name.log"; exit 1; }
}

run one_process python pretrain_gpt.py
for zero in ${ZERO_STAGES:-1 2 3}; do
  run "ulysses_sp2_dp2_zero$zero" "${TORCHRUN[@]}" pretrain_gpt.py \
      --ds-sequence-parallel-size 2 --zero-stage "$zero"
done
run megatron_sp_tp2_dp2 "${TORCHRUN[@]}" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --sequence-parallel
python examples/convergence/plot.py "$OUT"
