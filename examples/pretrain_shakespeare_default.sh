#!/usr/bin/env bash
# The bundled default run with every flag spelled out: `python pretrain_gpt.py` with no
# flags does exactly this (its settings that differ from Megatron-LM's defaults are the
# 'shakespeare' preset of megaulysses/config/presets.py). A 12M-parameter Llama-style GPT
# on Shakespeare, 8 min on 2 CPU cores (AMD EPYC Zen 3).
set -euo pipefail
cd "$(dirname "$0")/.."
python pretrain_gpt.py \
    --data-path data/shakespeare_text_document --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/shakespeare_tok.model \
    --num-layers 6 --hidden-size 384 --num-attention-heads 8 --seq-length 256 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-fraction 0.1 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 \
    --eval-interval 50 --eval-iters 5 --log-interval 10 \
    --save runs/default/checkpoints --tensorboard-dir runs/default/tensorboard \
    --load runs/default/checkpoints --metrics-jsonl runs/default/metrics.jsonl --generate 200 "$@"
