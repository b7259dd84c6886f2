#!/usr/bin/env bash
# GPT-2 small (124M) in Megatron-LM's style: learned positions, LayerNorm, GeLU, biases,
# tied embeddings. Point DATA at a Megatron-format prefix and TOK at its tokenizer.
# One process as written; under torchrun add the grid's flags (docs/guides/grid.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to a .bin/.idx prefix, e.g. corpus_text_document}
TOK=${TOK:?set TOK to the sentencepiece model the data was made with}
python pretrain_gpt.py \
    --data-path "$DATA" --tokenizer-model "$TOK" --split 969,30,1 \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --position-embedding-type learned_absolute --normalization LayerNorm --no-swiglu \
    --add-bias-linear --hidden-dropout 0.1 --attention-dropout 0.1 \
    --micro-batch-size 8 --global-batch-size 256 --train-iters 100000 \
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --eval-interval 1000 --eval-iters 20 --log-interval 10 \
    --save checkpoints/gpt2_124m --load checkpoints/gpt2_124m --save-interval 1000 \
    --tensorboard-dir runs/gpt2_124m --metrics-jsonl runs/gpt2_124m/metrics.jsonl "$@"
