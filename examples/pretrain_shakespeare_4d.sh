#!/usr/bin/env bash
# The bundled default model on all four axes at once: 8 processes (gloo on CPU, NCCL on
# GPUs), pipeline 2 x tensor 2 x Ulysses sequence 2 (dp = 8 / (2*2*2) = 1). The loss
# curve is the one-process run's (tests/parallel/test_pipeline.py proves it on a small
# model). On a 2-core machine this is slow: pass --train-iters 20 for a look.
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nproc-per-node 8 pretrain_gpt.py \
    --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b \
    --tensor-model-parallel-size 2 --ds-sequence-parallel-size 2 \
    --global-batch-size 16 --min-lr 2e-4 "$@"  # the default run's schedule
