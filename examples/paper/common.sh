#!/usr/bin/env bash
# Shared by the scripts of examples/paper/: the DeepSpeed-Ulysses paper's runs
# (Jacobs et al., arXiv 2309.14509) on A100-80GB nodes of 8 GPUs.
#
# A script sources this file, calls `paper_run NAME GPUS FLAGS...` once per configuration
# and `paper_done` at the end.
#   bash examples/paper/<script>.sh            # sbatch one job per configuration
#   DRY_RUN=1 bash examples/paper/<script>.sh  # validate each one and print its memory
#                                              # plan per GPU (no GPU needed)
#   DRY_RUN=list bash examples/paper/<script>.sh  # print NAME<tab>GPUS<tab>FLAGS lines
#                                              # (benchmarks/paper_plan.py reads them)
# With DRY_RUN=1 every configuration is the same as
#   python pretrain_gpt.py --dry-run --dry-run-world-size GPUS --dry-run-device cuda FLAGS
# but all of a script's configurations run in one python process (dry_run_configs.py), so
# torch is imported once.
#
# Environment: DATA_PATH (a .bin/.idx prefix) and TOKENIZER_MODEL (its sentencepiece
# model) default to the bundled Shakespeare corpus, which is far too small for the long
# sequences: point them at a real corpus for the real runs. GPUS_PER_NODE (8),
# TRAIN_ITERS (100; the convergence script sets its own), RUNS_DIR (runs/paper).
set -euo pipefail
PAPER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$PAPER_DIR/../.."

DATA_PATH=${DATA_PATH:-data/shakespeare_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/shakespeare_tok.model}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-100}
RUNS_DIR=${RUNS_DIR:-runs/paper}
DRY_RUN=${DRY_RUN:-0}

# GPT-2 style, as Megatron-DeepSpeed's GPT: learned positions, LayerNorm, GeLU, biases,
# tied embeddings; bf16; no dropout (the plans below were made without it).
GPT2=(--position-embedding-type learned_absolute --normalization LayerNorm --no-swiglu
      --add-bias-linear --hidden-dropout 0 --attention-dropout 0 --bf16
      --attention-backend auto)
MODEL_1P2B=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16)  # 1.2B / 1.3B
MODEL_7B=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32)
MODEL_30B=(--num-layers 64 --hidden-size 6144 --num-attention-heads 64)
# The paper's block-sparse attention: DeepSpeed's "fixed" layout.
SPARSE=(--attention-sparsity fixed)
# Megatron-LM's sequence parallelism, the paper's baseline: tensor parallel over the node.
MEGATRON_SP=(--tensor-model-parallel-size 8 --sequence-parallel)
FULL_RECOMPUTE=(--recompute-granularity full)

TRAIN=(--micro-batch-size 1 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
       --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 --split 969,30,1
       --log-interval 1 --eval-interval 1000 --eval-iters 1)

if [[ $DRY_RUN == 1 || $DRY_RUN == list ]]; then
    PAPER_CONFIGS=$(mktemp)
    trap 'rm -f "$PAPER_CONFIGS"' EXIT
fi

# paper_run NAME GPUS FLAGS...: one configuration on GPUS GPUs (a multiple of the node).
paper_run() {
    local name=$1 gpus=$2
    shift 2
    local args=(--data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL" "${GPT2[@]}"
                --train-iters "$TRAIN_ITERS" "${TRAIN[@]}" "$@")
    if [[ $DRY_RUN == 1 || $DRY_RUN == list ]]; then
        printf '%s\t%s\t%s\n' "$name" "$gpus" "$(printf '%q ' "${args[@]}")" >> "$PAPER_CONFIGS"
    else
        local nodes=$(( (gpus + GPUS_PER_NODE - 1) / GPUS_PER_NODE ))
        sbatch --nodes "$nodes" --job-name "ulysses-$name" examples/slurm/pretrain_gpt.sbatch \
            "${args[@]}" --metrics-jsonl "$RUNS_DIR/$name/metrics.jsonl" \
            --tensorboard-dir "$RUNS_DIR/$name"
    fi
}

# The 7B/30B grids of Figs. 4-7, on GPUS GPUs, one sample per data-parallel rank a step,
# full recompute. TAG names the run (dense, sparse), ATTENTION holds its mask flags.
# ulysses_run MODEL GPUS SEQ: sp 8 over the node (the ranks Megatron-SP spends on tp) x
# dp over the nodes, ZeRO-3 over dp x sp, the MLP by 4 tiles from 128K.
# megatron_sp_run MODEL GPUS SEQ: tp 8 + sequence parallel x dp, ZeRO-1 (Megatron's
# distributed optimizer).
TAG=dense
ATTENTION=()


ulysses_run() {
    local model=$1 gpus=$2 seq=$3 sp=8 k=$(( $3 / 1024 ))
    local -n flags="MODEL_${model^^}"
    paper_run "$TAG-$model-ulysses-${k}k" "$gpus" "${flags[@]}" "${ATTENTION[@]}" \
        --seq-length "$seq" --ds-sequence-parallel-size "$sp" \
        --global-batch-size $(( gpus / sp )) --zero-stage 3 "${FULL_RECOMPUTE[@]}" \
        $( (( seq >= 131072 )) && echo --tiled-mlp-chunks 4 )
}
megatron_sp_run() {
    local model=$1 gpus=$2 seq=$3 k=$(( $3 / 1024 ))
    local -n flags="MODEL_${model^^}"
    paper_run "$TAG-$model-megatron-sp-${k}k" "$gpus" "${flags[@]}" "${ATTENTION[@]}" \
        --seq-length "$seq" "${MEGATRON_SP[@]}" \
        --global-batch-size $(( gpus / 8 )) --zero-stage 1 "${FULL_RECOMPUTE[@]}"
}


# paper_done: with DRY_RUN=1, dry-run every configuration paper_run collected.
paper_done() {
    if [[ $DRY_RUN == 1 ]]; then
        python "$PAPER_DIR/dry_run_configs.py" "$PAPER_CONFIGS"
    elif [[ $DRY_RUN == list ]]; then
        cat "$PAPER_CONFIGS"
    fi
}

# Figs. 4-7: Ulysses and the Megatron-SP baseline of the 7B (32 GPUs) and 30B (64 GPUs) at
# each length, with the caller's TAG and ATTENTION flags.
sweep_7b_30b() {
    local seq
    for seq in 8192 16384 32768 65536 131072 262144; do
        ulysses_run 7b 32 "$seq"
        megatron_sp_run 7b 32 "$seq"
        ulysses_run 30b 64 "$seq"
        megatron_sp_run 30b 64 "$seq"
    done
    paper_done
}
