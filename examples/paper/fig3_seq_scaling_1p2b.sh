#!/usr/bin/env bash
# DeepSpeed-Ulysses paper (arXiv 2309.14509), Fig. 3: sequence length scaling of the 1.2B
# GPT (24 layers, hidden 2048, 16 heads), 32K tokens on 8 GPUs up to 1M on 256, one
# sample a step. Ulysses degree up to 16 (the head count); beyond it the ring
# (--context-parallel-size) multiplies the sequence degree. ZeRO-3, full recompute.
# sbatch runs a spool copy of a batch script: then common.sh is in the submit directory's
here=$(dirname "$0"); [[ -f $here/common.sh ]] || here=examples/paper
source "$here/common.sh"

# NAME GPUS SEQ SP CP [FLAGS...]
seq_run() {
    local name=$1 gpus=$2 seq=$3 sp=$4 cp=$5
    shift 5
    paper_run "$name" "$gpus" "${MODEL_1P2B[@]}" --seq-length "$seq" \
        --ds-sequence-parallel-size "$sp" --context-parallel-size "$cp" \
        --global-batch-size $(( gpus / (sp * cp) )) --zero-stage 3 "${FULL_RECOMPUTE[@]}" "$@"
}

seq_run fig3-1p2b-32k    8    32768  8  1
seq_run fig3-1p2b-128k  32   131072 16  2
seq_run fig3-1p2b-256k  64   262144 16  4
seq_run fig3-1p2b-1m   256  1048576 16 16
paper_done
