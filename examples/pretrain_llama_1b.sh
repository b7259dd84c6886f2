#!/usr/bin/env bash
# A Llama-style 1.2B model (the smallest size in the Ulysses paper's runs):
# 24 layers, hidden 2048, 16 heads with 8 kv groups, SwiGLU, RoPE, untied embeddings,
# 8K sequence. Point DATA/TOK at your Megatron-format data and tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:?set DATA to a .bin/.idx prefix}
TOK=${TOK:?set TOK to the sentencepiece model the data was made with}
python pretrain_gpt.py \
    --data-path "$DATA" --tokenizer-model "$TOK" --split 969,30,1 \
    --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 \
    --group-query-attention --num-query-groups 8 --seq-length 8192 \
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 1 --global-batch-size 64 --train-iters 50000 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1000 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --attention-backend auto \
    --eval-interval 1000 --eval-iters 10 --log-interval 10 \
    --save checkpoints/llama_1b --load checkpoints/llama_1b --save-interval 500 \
    --tensorboard-dir runs/llama_1b --metrics-jsonl runs/llama_1b/metrics.jsonl "$@"
