#!/usr/bin/env bash
# DeepSpeed-Ulysses paper (arXiv 2309.14509), Fig. 8: convergence of the 1.3B GPT (24
# layers, hidden 2048, 16 heads) at 32K tokens on 8 GPUs: Ulysses sp 4 x dp 2 under ZeRO
# stages 1, 2 and 3, and the Megatron-SP baseline (tp 8 + sequence parallel). The same
# data, seed and global batch (16 samples) in every run: the loss curves should overlap.
# sbatch runs a spool copy of a batch script: then common.sh is in the submit directory's
here=$(dirname "$0"); [[ -f $here/common.sh ]] || here=examples/paper
source "$here/common.sh"
TRAIN_ITERS=${CONVERGENCE_ITERS:-5000}
COMMON=("${MODEL_1P2B[@]}" --seq-length 32768 --global-batch-size 16 --seed 1234
        "${FULL_RECOMPUTE[@]}")

for zero in 1 2 3; do
    paper_run "convergence-1p3b-ulysses-zero$zero" 8 "${COMMON[@]}" \
        --ds-sequence-parallel-size 4 --zero-stage "$zero"
done
paper_run convergence-1p3b-megatron-sp 8 "${COMMON[@]}" "${MEGATRON_SP[@]}" --zero-stage 1
paper_done
