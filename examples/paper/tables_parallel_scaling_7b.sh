#!/usr/bin/env bash
# DeepSpeed-Ulysses paper (arXiv 2309.14509), parallel scaling study of the 7B GPT (the
# strong and weak scaling tables of its evaluation): strong scaling, 128K tokens on 64,
# 128 and 256 GPUs; weak scaling, 64K on 64, 128K on 128, 256K on 256 (1K tokens a GPU).
# One sample a step, the whole world on its sequence: Ulysses over 32 ranks (the head
# count) x the ring (--context-parallel-size) over the rest; ZeRO-3, full recompute.
# sbatch runs a spool copy of a batch script: then common.sh is in the submit directory's
here=$(dirname "$0"); [[ -f $here/common.sh ]] || here=examples/paper
source "$here/common.sh"

# NAME GPUS SEQ
scaling_run() {
    local name=$1 gpus=$2 seq=$3 sp=32
    paper_run "$name" "$gpus" "${MODEL_7B[@]}" --seq-length "$seq" \
        --ds-sequence-parallel-size "$sp" --context-parallel-size $(( gpus / sp )) \
        --global-batch-size 1 --zero-stage 3 "${FULL_RECOMPUTE[@]}"
}

scaling_run strong-7b-128k-64gpu   64 131072
scaling_run strong-7b-128k-128gpu 128 131072
scaling_run strong-7b-128k-256gpu 256 131072
scaling_run weak-7b-64k-64gpu      64  65536
scaling_run weak-7b-128k-128gpu   128 131072
scaling_run weak-7b-256k-256gpu   256 262144
paper_done
