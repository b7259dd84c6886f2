#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, as written: every flag below is
# Megatron-LM's own, unchanged, except the data arguments. Without a vocabulary, merges and
# data prefix (arguments 3-5, as Megatron-LM's) it trains on the bundled Shakespeare corpus
# and tokenizer. What each flag does here: README.md, "Coming from Megatron-LM".
#
#   DRY_RUN=128 bash examples/megatron/train_gpt3_175b_distributed.sh   # plan 128 GPUs, ~6 s
#   DRY_RUN=128 DRY_RUN_GPU=H100 bash ...   # the same on 128 H100s: exit 2 unless it fits
#   bash examples/megatron/train_gpt3_175b_distributed.sh CKPT TB VOCAB MERGES DATA

# Runs the "175B" parameter model

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=6000
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=${1:-runs/gpt3_175b/checkpoints} #<Specify path>
TENSORBOARD_LOGS_PATH=${2:-runs/gpt3_175b/tensorboard} #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=${5:-data/shakespeare_text_document} #<Specify path and file prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE 
    --nnodes $NUM_NODES 
    --master_addr $MASTER_ADDR 
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 96 
    --hidden-size 12288 
    --num-attention-heads 96 
    --seq-length 2048 
    --max-position-embeddings 2048 
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1 
    --global-batch-size 1536 
    --rampup-batch-size 16 16 5859375 
    --train-iters 500000 
    --weight-decay 0.1 
    --adam-beta1 0.9 
    --adam-beta2 0.95 
    --init-method-std 0.006 
    --clip-grad 1.0 
    --fp16
    --lr 6.0e-5 
    --lr-decay-style cosine 
    --min-lr 6.0e-6
    --lr-warmup-fraction .001 
    --lr-decay-iters 430000 
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 8 
	--pipeline-model-parallel-size 16 
)

# The data arguments: Megatron-LM's GPT-2 files when given, else the bundled tokenizer.
if [[ -n "$VOCAB_FILE" ]]; then
    TOKENIZER_ARGS=(--vocab-file $VOCAB_FILE --merge-file $MERGE_FILE)
else
    TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer
                    --tokenizer-model data/shakespeare_tok.model)
fi
DATA_ARGS=(
    --data-path $DATA_PATH 
    "${TOKENIZER_ARGS[@]}"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000 
    --eval-interval 1000 
    --save $CHECKPOINT_PATH 
    --load $CHECKPOINT_PATH 
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH 
)

# DRY_RUN=N: the memory plan and every check for N GPUs, from one process, nothing allocated.
if [[ -n "$DRY_RUN" ]]; then
    LAUNCH=(python)
    EVAL_AND_LOGGING_ARGS+=(--dry-run --dry-run-world-size $DRY_RUN ${DRY_RUN_GPU:+--dry-run-gpu $DRY_RUN_GPU})
else
    LAUNCH=(torchrun ${DISTRIBUTED_ARGS[@]})
fi
# sbatch runs a spool copy of a batch script: then stay in the submit directory
[[ -f "$(dirname "$0")/../../pretrain_gpt.py" ]] && cd "$(dirname "$0")/../.."
"${LAUNCH[@]}" pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    "${DATA_ARGS[@]}" \
    ${EVAL_AND_LOGGING_ARGS[@]}
