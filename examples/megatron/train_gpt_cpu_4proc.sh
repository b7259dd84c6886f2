#!/bin/bash
# A Megatron-LM-style launch script sized for a CPU: the layout and flags of Megatron-LM's
# examples/gpt3/train_gpt3_175b_distributed.sh (and a few of its Llama scripts' flags), a
# 4-layer GPT on the bundled Shakespeare corpus, on 4 processes (tensor 2 x pipeline 2),
# gloo. About a minute on 2 cores (loss 7.8 at iteration 10, 6.4 at 40). Extra flags are appended: e.g.
# --train-iters 4.
#
#   bash examples/megatron/train_gpt_cpu_4proc.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH]

GPUS_PER_NODE=4  # processes: CPU ranks here
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=1

CHECKPOINT_PATH=${1:-runs/megatron_cpu/checkpoints}
TENSORBOARD_LOGS_PATH=${2:-runs/megatron_cpu/tensorboard}
DATA_PATH=data/shakespeare_text_document
shift $(( $# < 2 ? $# : 2 ))

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl local
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 256
    --max-position-embeddings 256
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 16
    --rampup-batch-size 8 4 64
    --train-iters 40
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --lr 1.0e-3
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --lr-warmup-fraction .1
    --lr-decay-iters 40
    --use-distributed-optimizer
    --overlap-grad-reduce
    --no-gradient-accumulation-fusion
    --calculate-per-token-loss
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type SentencePieceTokenizer
    --tokenizer-model data/shakespeare_tok.model
    --split '949,50,1'
    --num-workers 1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --log-params-norm
    --save-interval 20
    --eval-interval 20
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

cd "$(dirname "$0")/../.."
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "$@"
