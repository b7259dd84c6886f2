#!/usr/bin/env bash
# DeepSpeed-Ulysses paper (arXiv 2309.14509), Fig. 6 (7B, 32 GPUs) and Fig. 7 (30B, 64
# GPUs): block-sparse attention (DeepSpeed's "fixed" layout, --attention-sparsity fixed),
# sequence lengths 8K to 256K, DeepSpeed-Ulysses against the Megatron-SP baseline; the
# grids of fig4_5_dense_7b_30b.sh (ulysses_run, megatron_sp_run in common.sh).
# sbatch runs a spool copy of a batch script: then common.sh is in the submit directory's
here=$(dirname "$0"); [[ -f $here/common.sh ]] || here=examples/paper
source "$here/common.sh"
# Planned to exceed 80 GB a GPU (the test holds every other configuration to 80 GB):
# expected OOM (paper: Megatron-LM's sequence parallelism runs out of memory at lengths Ulysses still trains, Fig. 7; plan ~79 GiB a GPU, over the 76 usable of 80 (the planner's 4 GiB reserve): 26 GiB of tp-shard parameters, 28 GiB of kept layer inputs, 19 GiB of a layer's backward with whole-sequence all-gathered inputs; the sparse layout saves compute, not these activations): sparse-30b-megatron-sp-256k
TAG=sparse
ATTENTION=("${SPARSE[@]}")
sweep_7b_30b
