#!/usr/bin/env bash
# DeepSpeed-Ulysses paper (arXiv 2309.14509), Fig. 4 (7B, 32 GPUs) and Fig. 5 (30B, 64
# GPUs): dense attention, sequence lengths 8K to 256K, DeepSpeed-Ulysses against the
# Megatron-SP baseline (tensor parallel 8 over the node + sequence parallel).
# Ulysses: sp 8 over the node (the same ranks Megatron-SP spends on tp) x dp over the
# nodes, ZeRO-3 over dp x sp; the baseline: tp 8 x dp, ZeRO-1 (Megatron's distributed
# optimizer). Both: one sample per data-parallel rank a step, full recompute.
# sbatch runs a spool copy of a batch script: then common.sh is in the submit directory's
here=$(dirname "$0"); [[ -f $here/common.sh ]] || here=examples/paper
source "$here/common.sh"
# Planned to exceed 80 GB a GPU (the test holds every other configuration to 80 GB):
# expected OOM (paper: Megatron-LM's sequence parallelism runs out of memory at lengths Ulysses still trains, Fig. 5; plan ~79 GiB a GPU, over the 76 usable of 80 (the planner's 4 GiB reserve): 26 GiB of tp-shard parameters, 28 GiB of kept layer inputs, 19 GiB of a layer's backward with whole-sequence all-gathered inputs): dense-30b-megatron-sp-256k
TAG=dense
ATTENTION=()
sweep_7b_30b
