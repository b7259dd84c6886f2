"""Invalid flags, exhaustively (issue 15, item 4), and every default against the flags that
constrain it (item 7).

Each row of INVALID is a command line that must stop before any training with exit code
2 and exactly one line on stderr, "error: <flag>: <rule>", naming the flag and no
traceback. Rows run `pretrain_gpt.main` in this process; grid rows add `--dry-run
--dry-run-world-size N`, which checks the N-rank grid exactly as the trainer's start-up
does, in one process. A few cases run real ranks to show every rank exits 2 and only
rank 0 speaks.
"""

import os
import re

import pytest

from helpers import LLAMA, launch, wait_all

# TINY (tests/helpers.py) without its GQA flags and fixed global batch: the smallest valid
# base, whose global batch then follows each grid's dp (micro-batch x dp x pp).
BASE = LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "6",
        "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1",
        "--peak-tflops", "1"]  # no matmul timing at start-up
GQA = ["--group-query-attention", "--num-query-groups"]
NULL_TOK = ["--tokenizer-type", "NullTokenizer", "--vocab-size"]
GPT2_TOK = ["--tokenizer-type", "GPT2BPETokenizer"]
HF_TOK = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
SPARSE = ["--attention-sparsity"]


def row(name, args, flag, words, world=None, needs=None):
    """`args` after BASE; `flag`: what the error line must name; `words`: a piece of the
    rule; `world`: run as a --dry-run of that many ranks. "{tmp}" in args: a fresh
    directory holding a file "afile" and a metrics file "old.jsonl" with a record.
    `needs`: a fix outside config.py that this row waits for (strict xfail until then:
    once fixed it fails as XPASS, and the marker goes)."""
    marks = [pytest.mark.xfail(strict=True, reason=f"needs {needs}")] if needs else []
    return pytest.param(args, flag, words, world, id=name, marks=marks)


INVALID = [
    # ---- model shape
    row("hidden-heads", ["--hidden-size", "66"], "--hidden-size",
        "divisible by --num-attention-heads"),
    row("heads-groups", GQA + ["3"], "--num-attention-heads", "divisible by --num-query-groups"),
    row("groups-more-than-heads", GQA + ["8"], "--num-query-groups", "<= --num-attention-heads"),
    row("groups-without-gqa", ["--num-query-groups", "2"], "--num-query-groups",
        "needs --group-query-attention"),
    row("kv-channels-odd", ["--kv-channels", "15"], "--kv-channels", "even head dimension"),
    row("head-dim-odd", ["--hidden-size", "60", "--num-attention-heads", "4"], "--hidden-size",
        "even head dimension"),
    row("rotary-base", ["--rotary-base", "0"], "--rotary-base", "must be > 0"),
    # ---- RoPE scalings (issue 23)
    row("rope-scaling-learned", ["--position-embedding-type", "learned_absolute",
                                 "--use-rope-scaling"], "--use-rope-scaling",
        "needs --position-embedding-type rope"),
    row("yarn-learned", ["--position-embedding-type", "learned_absolute", "--rope-type",
                         "yarn"], "--rope-type", "needs --position-embedding-type rope"),
    row("two-scalings", ["--use-rope-scaling", "--rope-type", "yarn"], "--use-rope-scaling",
        "at most one RoPE scaling"),
    row("linear-and-yarn", ["--rotary-seq-len-interpolation-factor", "2", "--rope-type",
                            "yarn"], "--rotary-seq-len-interpolation-factor",
        "cannot be combined with --rope-type yarn"),
    row("rope-scaling-factor-0", ["--use-rope-scaling", "--rope-scaling-factor", "0"],
        "--rope-scaling-factor", "must be > 0"),
    row("low-freq-factor-0", ["--use-rope-scaling", "--rope-scaling-low-freq-factor", "0"],
        "--rope-scaling-low-freq-factor", "must be > 0"),
    row("high-freq-below-low", ["--use-rope-scaling", "--rope-scaling-high-freq-factor", "1"],
        "--rope-scaling-high-freq-factor", "must be > --rope-scaling-low-freq-factor"),
    row("rope-scaling-factor-alone", ["--rope-scaling-factor", "4"], "--rope-scaling-factor",
        "needs --use-rope-scaling"),
    row("original-positions-alone", ["--original-max-position-embeddings", "8192"],
        "--original-max-position-embeddings", "needs --use-rope-scaling or --rope-type yarn"),
    row("original-positions-0", ["--use-rope-scaling", "--original-max-position-embeddings",
                                 "0"], "--original-max-position-embeddings", "must be > 0"),
    row("interpolation-0", ["--rotary-seq-len-interpolation-factor", "0"],
        "--rotary-seq-len-interpolation-factor", "must be > 0"),
    row("rope-type-choice", ["--rope-type", "dynamic"], "--rope-type", "invalid choice"),
    row("yarn-factor-below-1", ["--rope-type", "yarn", "--rotary-scaling-factor", "0.5"],
        "--rotary-scaling-factor", "must be >= 1"),
    row("yarn-param-alone", ["--rotary-scaling-factor", "4"], "--rotary-scaling-factor",
        "needs --rope-type yarn"),
    row("yarn-betas", ["--rope-type", "yarn", "--yarn-beta-fast", "0.5"], "--yarn-beta-fast",
        "must be > --yarn-beta-slow"),
    row("yarn-beta-slow-0", ["--rope-type", "yarn", "--yarn-beta-slow", "0"], "--yarn-beta-slow",
        "must be > 0"),
    row("mscale-0", ["--rope-type", "yarn", "--mscale", "0", "--mscale-all-dim", "1"],
        "--mscale", "must be > 0"),
    row("mscale-all-dim-neg", ["--rope-type", "yarn", "--mscale-all-dim", "-1"],
        "--mscale-all-dim", "must be >= 0"),
    row("mscale-without-all-dim", ["--rope-type", "yarn", "--mscale", "0.7"], "--mscale",
        "must be 1 when --mscale-all-dim is 0"),
    row("seq-positions", ["--seq-length", "64", "--max-position-embeddings", "32"],
        "--seq-length", "--max-position-embeddings"),
    row("hidden-dropout-1", ["--hidden-dropout", "1"], "--hidden-dropout", "[0, 1)"),
    row("attention-dropout-neg", ["--attention-dropout", "-0.1"], "--attention-dropout",
        "[0, 1)"),
    row("hidden-dropout-nan", ["--hidden-dropout", "nan"], "--hidden-dropout", "nan"),
    row("norm-eps-0", ["--norm-epsilon", "0"], "--norm-epsilon", "must be > 0"),
    row("norm-eps-inf", ["--norm-epsilon", "inf"], "--norm-epsilon", "finite"),
    row("init-std", ["--init-method-std", "-0.02"], "--init-method-std", "must be > 0"),
    row("layers-not-int", ["--num-layers", "two"], "--num-layers", "must be an integer"),
    row("layers-0", ["--num-layers", "0"], "--num-layers", "must be > 0"),
    row("position-type", ["--position-embedding-type", "alibi"], "--position-embedding-type",
        "invalid choice"),
    row("ffn-0", ["--ffn-hidden-size", "0"], "--ffn-hidden-size", "must be > 0"),
    # ---- attention mask, and backends that cannot run it on CPU
    row("window-0", ["--window-size", "0"], "--window-size", "must be > 0"),
    row("sparse-block-seq", SPARSE + ["fixed", "--sparse-block-size", "12"],
        "--sparse-block-size", "divide --seq-length 32"),
    row("fixed-global-local", SPARSE + ["fixed", "--sparse-block-size", "8",
                                        "--sparse-local-blocks", "2", "--sparse-global-blocks",
                                        "3"], "--sparse-global-blocks", "do not fit"),
    row("global-blocks-neg", SPARSE + ["bigbird", "--sparse-block-size", "8",
                                       "--sparse-global-blocks", "-1"],
        "--sparse-global-blocks", ">= 0"),
    row("random-blocks-neg", SPARSE + ["bigbird", "--sparse-block-size", "8",
                                       "--sparse-random-blocks", "-1"],
        "--sparse-random-blocks", ">= 0"),
    row("window-sdpa", ["--window-size", "8", "--attention-backend", "sdpa"], "--window-size",
        "sdpa attention backend cannot run it"),
    row("documents-sdpa", ["--reset-attention-mask", "--attention-backend", "sdpa"],
        "--reset-attention-mask", "sdpa attention backend cannot run it"),
    row("flash-on-cpu", ["--attention-backend", "flash"], "--attention-backend", "CUDA"),
    row("flex-on-cpu", ["--window-size", "8", "--attention-backend", "flex"],
        "--attention-backend", "needs CUDA"),
    row("window-dropout-1", ["--window-size", "8", "--attention-dropout", "1"],
        "--attention-dropout", "must be in [0, 1), got 1.0"),
    row("backend-choice", ["--attention-backend", "xformers"], "--attention-backend",
        "invalid choice"),
    # ---- data
    row("split-syntax", ["--split", "1,2,x"], "--split", "comma-separated"),
    row("split-four", ["--split", "1,1,1,1"], "--split", "up to 3"),
    row("split-empty-train", ["--split", "0,1,0"], "--split", "train split must not be empty"),
    row("split-dry-run", ["--split", "1,-2", "--dry-run"], "--split", "non-negative"),
    row("data-missing", ["--data-path", "/nonexistent/corpus"], "--data-path", "not found"),
    row("data-weights-odd", ["--data-path", "0.5", "A", "0.5"], "--data-path", "even number"),
    row("data-weight-neg-inf", ["--data-path", "-inf", "A"], "--data-path", "-inf"),
    row("data-path-empty", ["--data-path"], "--data-path", "expected at least one argument"),
    row("null-tokenizer-no-vocab", ["--tokenizer-type", "NullTokenizer"], "--vocab-size",
        "required with NullTokenizer"),
    row("vocab-0", NULL_TOK + ["0"], "--vocab-size", "must be > 0"),
    row("tokenizer-missing", ["--tokenizer-model", "/nonexistent/tok.model"],
        "--tokenizer-model", "file not found"),
    row("tokenizer-unreadable", ["--tokenizer-model", "{tmp}/afile"], "--tokenizer-model",
        "afile is not a readable SentencePiece model"),
    row("tokenizer-type", ["--tokenizer-type", "TikTokenizer"], "--tokenizer-type",
        "invalid choice"),
    # GPT2BPETokenizer's files (issue 28; their contents: tests/data/test_gpt2_bpe.py)
    row("gpt2-no-vocab-file", GPT2_TOK + ["--merge-file", "{tmp}/afile"], "--vocab-file",
        "required with GPT2BPETokenizer"),
    row("gpt2-no-merge-file", GPT2_TOK + ["--vocab-file", "{tmp}/afile"], "--merge-file",
        "required with GPT2BPETokenizer"),
    row("vocab-file-other-type", ["--vocab-file", "{tmp}/afile"], "--vocab-file",
        "only used with --tokenizer-type GPT2BPETokenizer"),
    row("merge-file-other-type", NULL_TOK + ["100", "--merge-file", "{tmp}/afile"],
        "--merge-file", "only used with --tokenizer-type GPT2BPETokenizer"),
    row("vocab-file-missing", GPT2_TOK + ["--vocab-file", "/nonexistent/vocab.json",
                                          "--merge-file", "{tmp}/afile"], "--vocab-file",
        "file not found"),
    row("merge-file-missing", GPT2_TOK + ["--vocab-file", "{tmp}/afile", "--merge-file",
                                          "{tmp}"], "--merge-file", "file not found"),
    row("vocab-file-unreadable", GPT2_TOK + ["--vocab-file", "{tmp}/afile", "--merge-file",
                                             "{tmp}/afile"], "--vocab-file",
        "afile is not a GPT-2 vocab.json"),
    # HuggingFaceTokenizer (issue 23; its files' contents: tests/data/test_hf_tokenizer.py)
    row("hf-no-model", ["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model",
        "required with HuggingFaceTokenizer"),
    row("hf-not-a-tokenizer", HF_TOK + ["{tmp}/afile"], "--tokenizer-model",
        "afile is not a Hugging Face tokenizer.json"),
    row("eod-token-id-neg", HF_TOK + ["{tmp}", "--eod-token-id", "-1"], "--eod-token-id",
        "must be >= 0"),
    row("eod-token-id-other-type", ["--eod-token-id", "2"], "--eod-token-id",
        "only used with --tokenizer-type HuggingFaceTokenizer"),
    row("hf-special-tokens-other-type", ["--tokenizer-hf-include-special-tokens"],
        "--tokenizer-hf-include-special-tokens", "only used with --tokenizer-type "
        "HuggingFaceTokenizer"),
    row("hf-no-special-tokens-other-type", ["--tokenizer-hf-no-include-special-tokens"],
        "--tokenizer-hf-no-include-special-tokens", "only used with --tokenizer-type "
        "HuggingFaceTokenizer"),
    row("vocab-smaller-than-data", NULL_TOK + ["1000"], "--vocab-size", "token id"),
    # ---- training and its schedule
    row("lr-neg", ["--lr", "-1e-3"], "--lr", "must be >= 0"),
    row("lr-inf", ["--lr", "inf"], "--lr", "finite"),
    row("min-lr-above-lr", ["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr", "[0, --lr]"),
    row("warmup-past-train", ["--lr-warmup-iters", "50"], "--lr-warmup-iters",
        "--train-iters = 6"),
    row("warmup-past-decay", ["--lr-warmup-iters", "5", "--lr-decay-iters", "3"],
        "--lr-warmup-iters", "--lr-decay-iters"),
    row("warmup-neg", ["--lr-warmup-iters", "-1"], "--lr-warmup-iters", "got -1"),
    row("warmup-fraction", ["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction", "[0, 1]"),
    row("warmup-init", ["--lr-warmup-init", "inf"], "--lr-warmup-init", "finite"),
    row("warmup-both", ["--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"],
        "--lr-warmup-fraction", "cannot be combined with --lr-warmup-iters"),
    row("decay-style", ["--lr-decay-style", "wsd"], "--lr-decay-style", "invalid choice"),
    # issue 28: schedule (BASE trains --train-iters 6; the sample-based rules' rows are in
    # tests/training/test_schedule.py)
    row("samples-and-iters", ["--train-samples", "64"], "--train-samples",
        "cannot be combined with --train-iters"),
    row("decay-samples-iters", ["--lr-decay-samples", "64"], "--lr-decay-samples",
        "needs --train-samples"),
    row("warmup-samples-iters", ["--lr-warmup-samples", "8"], "--lr-warmup-samples",
        "needs --train-samples"),
    row("rampup-increment-micro", ["--rampup-batch-size", "2", "3", "8",
                                   "--global-batch-size", "8"], "--rampup-batch-size",
        "INCREMENT 3 must be divisible by --micro-batch-size * dp"),
    row("rampup-two-values", ["--rampup-batch-size", "2", "2"], "--rampup-batch-size",
        "expected 3 arguments"),
    row("decoupled-min-alone", ["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr",
        "needs --decoupled-lr"),
    row("decoupled-neg", ["--decoupled-lr", "-1e-3"], "--decoupled-lr", "must be >= 0"),
    row("decoupled-min-above", ["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-2"],
        "--decoupled-min-lr", "in [0, --decoupled-lr]"),
    row("clip-grad-neg", ["--clip-grad", "-1"], "--clip-grad", "must be >= 0"),
    row("weight-decay-neg", ["--weight-decay", "-0.1"], "--weight-decay", "must be >= 0"),
    row("adam-beta1", ["--adam-beta1", "1"], "--adam-beta1", "[0, 1)"),
    row("adam-beta2", ["--adam-beta2", "-0.5"], "--adam-beta2", "[0, 1)"),
    row("adam-eps", ["--adam-eps", "0"], "--adam-eps", "must be > 0"),
    row("eval-iters-neg", ["--eval-iters", "-1"], "--eval-iters", "must be >= 0"),
    row("eval-interval-0", ["--eval-interval", "0"], "--eval-interval", "must be > 0"),
    row("train-iters-0", ["--train-iters", "0"], "--train-iters", "must be > 0"),
    row("micro-batch-0", ["--micro-batch-size", "0"], "--micro-batch-size", "must be > 0"),
    row("batch-divisible", ["--global-batch-size", "5"], "--global-batch-size",
        "divisible by --micro-batch-size"),
    row("generate-neg", ["--generate", "-1"], "--generate", "must be >= 0"),
    row("temperature-0", ["--generate-temperature", "0"], "--generate-temperature",
        "must be > 0"),
    row("top-k-neg", ["--generate-top-k", "-1"], "--generate-top-k", "must be >= 0"),
    row("bf16-fp16", ["--bf16", "--fp16"], "--bf16", "cannot be combined with --fp16"),
    row("loss-scale-0", ["--fp16", "--loss-scale", "0"], "--loss-scale", "must be > 0"),
    row("initial-below-min-scale", ["--fp16", "--initial-loss-scale", "1",
                                    "--min-loss-scale", "2"], "--initial-loss-scale",
        ">= --min-loss-scale"),
    row("min-loss-scale-0", ["--fp16", "--min-loss-scale", "0"], "--min-loss-scale",
        "must be > 0"),
    row("loss-scale-window-0", ["--loss-scale-window", "0"], "--loss-scale-window",
        "must be > 0"),
    row("hysteresis-0", ["--hysteresis", "0"], "--hysteresis", "must be > 0"),
    row("max-skipped-neg", ["--max-consecutive-skipped", "-1"], "--max-consecutive-skipped",
        "must be >= 0"),
    # issue 28: loss, checkpoint and loader (loading without what --no-save-optim/-rng
    # left out: tests/training/test_save_options.py)
    row("num-workers-neg", ["--num-workers", "-1"], "--num-workers", "must be >= 0"),
    row("num-workers-not-int", ["--num-workers", "two"], "--num-workers", "invalid"),
    row("rerun-report-stats", ["--rerun-mode", "report_stats"], "--rerun-mode",
        "report_stats: Megatron-LM's statistics of run-to-run differences"),
    row("dataloader-external", ["--dataloader-type", "external"], "--dataloader-type",
        "not provided here"),
    row("dataloader-choice", ["--dataloader-type", "random"], "--dataloader-type",
        "invalid choice"),
    row("timeout-0", ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes",
        "must be > 0"),
    row("timeout-nan", ["--distributed-timeout-minutes", "nan"],
        "--distributed-timeout-minutes", "nan"),
    row("timeout-inf", ["--distributed-timeout-minutes", "inf"],
        "--distributed-timeout-minutes", "inf"),
    row("peak-tflops-0", ["--peak-tflops", "0"], "--peak-tflops", "must be > 0"),
    row("lr-missing-value", ["--lr"], "--lr", "expected one argument"),
    row("unknown-flag", ["--learning-rate", "1e-3"], "--learning-rate",
        "unrecognized argument"),
    row("ambiguous-abbreviation", ["--seq", "32"], "--seq", "unrecognized argument"),
    row("megatron-impl-choice", ["--transformer-impl", "te"], "--transformer-impl",
        "invalid choice"),
    row("megatron-backend-choice", ["--distributed-backend", "mpi"], "--distributed-backend",
        "invalid choice"),
    # Megatron-LM's flags for what is not provided here (config/megatron_table.py)
    row("megatron-refused", ["--fp8-format", "hybrid"], "--fp8-format", "FP8"),
    row("megatron-refused-value", ["--rotary-percent=0.5"], "--rotary-percent",
        "not provided here"),
    row("megatron-refused-first", ["--hidden-size", "x", "--num-experts", "8"], "--num-experts",
        "mixture of experts"),
    row("megatron-no-effect-choice", ["--ckpt-format", "zip"], "--ckpt-format",
        "invalid choice"),
    row("megatron-no-effect-int", ["--empty-unused-memory-level", "one"],
        "--empty-unused-memory-level", "invalid int value"),
    # ---- checkpoints and stopping
    row("keep-last-no-save", ["--keep-last", "2"], "--keep-last", "needs --save"),
    row("keep-last-zero", ["--keep-last", "0", "--save", "runs/ck"], "--keep-last",
        "must be > 0"),
    row("retain-interval-no-save", ["--save-retain-interval", "2"], "--save-retain-interval",
        "needs --save"),
    row("retain-interval-zero", ["--save-retain-interval", "0", "--save", "runs/ck"],
        "--save-retain-interval", "must be > 0"),
    row("retain-interval-negative", ["--save-retain-interval", "-5", "--save", "runs/ck"],
        "--save-retain-interval", "must be > 0"),
    row("async-save-no-save", ["--async-save"], "--async-save", "needs --save"),
    row("load-nonexistent", ["--load", "{tmp}/none"], "--load", "does not exist"),
    row("exit-duration-0", ["--exit-duration-in-mins", "0"], "--exit-duration-in-mins",
        "must be > 0"),
    row("exit-duration-neg", ["--exit-duration-in-mins", "-5"], "--exit-duration-in-mins",
        "must be > 0"),
    row("save-is-a-file", ["--save", "{tmp}/afile", "--train-iters", "1", "--eval-iters",
                           "0"], "--save", "not a directory"),
    row("exit-interval-0", ["--exit-interval", "0"], "--exit-interval", "must be > 0"),
    # ---- the grid (checked as that many ranks by --dry-run --dry-run-world-size)
    row("tp-world", ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size",
        "world size 4", world=4),
    row("pp-world", ["--pipeline-model-parallel-size", "3", "--num-layers", "3"],
        "--pipeline-model-parallel-size", "world size 4", world=4),
    row("sp-world", ["--ds-sequence-parallel-size", "3"], "--ds-sequence-parallel-size",
        "world size 4", world=4),
    row("cp-world", ["--context-parallel-size", "3"], "--context-parallel-size",
        "world size 4", world=4),
    row("heads-tp", ["--tensor-model-parallel-size", "2", "--num-attention-heads", "5",
                     "--hidden-size", "80"],
        "--tensor-model-parallel-size", "divisible by tp*sp = 2*1", world=2),
    row("heads-tp-sp", ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size",
                        "2", "--num-attention-heads", "6", "--hidden-size", "96"],
        "--ds-sequence-parallel-size", "divisible by tp*sp = 2*2", world=4),
    row("kv-tp", ["--tensor-model-parallel-size", "2"] + GQA + ["1"], "--num-query-groups",
        "--tensor-model-parallel-size 2", world=2),
    row("kv-sp", ["--ds-sequence-parallel-size", "2", "--num-attention-heads", "6",
                  "--hidden-size", "96"] + GQA + ["3"], "--ds-sequence-parallel-size",
        "kv heads per tensor rank (3) and sp = 2", world=2),
    row("vocab-tp", ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                     "1"] + NULL_TOK + ["1000"], "--make-vocab-size-divisible-by",
        "1001 must be divisible by --tensor-model-parallel-size 2", world=2),
    row("ffn-tp", ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "129"],
        "--ffn-hidden-size", "129 must be divisible by --tensor-model-parallel-size 2",
        world=2),
    row("megatron-sp-seq", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--seq-length", "33"], "--sequence-parallel", "tp*sp*cp = 2",
        world=2),
    row("seq-sp", ["--ds-sequence-parallel-size", "4", "--seq-length", "30"],
        "--ds-sequence-parallel-size", "--seq-length 30", world=4),
    row("ring-seq", ["--context-parallel-size", "2", "--seq-length", "34"],
        "--context-parallel-size", "2*cp*sp = 2*2*1", world=2),
    row("ring-sparse-block", ["--context-parallel-size", "2"] + SPARSE + [
        "fixed", "--sparse-block-size", "16"], "--sparse-block-size", "(2*cp) = 8", world=2),
    row("ring-backend", ["--context-parallel-size", "2", "--attention-backend", "sdpa"],
        "--attention-backend", "ring attention (--context-parallel-size > 1)", world=2),
    row("ring-dropout-1", ["--context-parallel-size", "2", "--attention-dropout", "1.5"],
        "--attention-dropout", "must be in [0, 1)", world=2),
    row("batch-dp", ["--ds-sequence-parallel-size", "2", "--global-batch-size", "6"],
        "--global-batch-size", "--micro-batch-size * dp = 2*2", world=4),
    row("tiled-mlp", ["--tiled-mlp-chunks", "3"], "--tiled-mlp-chunks",
        "local sequence of 32 tokens", world=1),
    row("tiled-mlp-sp", ["--ds-sequence-parallel-size", "2", "--tiled-mlp-chunks", "32"],
        "--tiled-mlp-chunks", "local sequence of 16 tokens", world=2),
    row("offload-needs-full", ["--cpu-offloading-num-layers", "1"],
        "--cpu-offloading-num-layers", "needs --recompute-granularity full"),
    row("offload-selective", ["--cpu-offloading-num-layers", "1", "--recompute-activations"],
        "--cpu-offloading-num-layers", "got selective"),
    row("offload-negative", ["--cpu-offloading-num-layers", "-1"],
        "--cpu-offloading-num-layers", "must be >= 0"),
    row("offload-more-than-stage", ["--cpu-offloading-num-layers", "2",
        "--recompute-granularity", "full", "--pipeline-model-parallel-size", "2"],
        "--cpu-offloading-num-layers", "more than the 1 layers of a pipeline stage", world=2),
    row("head-groups", ["--attention-head-groups", "3"], "--attention-head-groups",
        "must divide the 4 query heads"),
    row("head-groups-sp", ["--ds-sequence-parallel-size", "2", "--attention-head-groups", "4"],
        "--attention-head-groups", "must divide the 2 query heads", world=2),
    row("head-groups-kv", GQA + ["2", "--num-attention-heads", "12", "--hidden-size", "96",
        "--attention-head-groups", "3"], "--attention-head-groups", "the 2 kv heads", world=1),
    row("fpdt-chunk-seq", ["--ds-sequence-parallel-fpdt",
                           "--ds-sequence-parallel-fpdt-chunk-size", "12"],
        "--ds-sequence-parallel-fpdt-chunk-size", "12 must divide --seq-length 32"),
    row("fpdt-offloading-alone", ["--ds-sequence-parallel-fpdt-offloading"],
        "--ds-sequence-parallel-fpdt-offloading", "needs --ds-sequence-parallel-fpdt"),
    row("tp-0", ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size",
        "must be > 0"),
    # ---- pipeline
    row("layers-pp", ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
        "--pipeline-model-parallel-size", "--num-layers 3 must be divisible", world=2),
    row("virtual-without-pp", ["--num-layers-per-virtual-pipeline-stage", "1"],
        "--pipeline-model-parallel-size", "need --pipeline-model-parallel-size > 1"),
    row("uneven-without-pp", ["--decoder-first-pipeline-num-layers", "1"],
        "--pipeline-model-parallel-size", "need --pipeline-model-parallel-size > 1"),
    row("virtual-1f1b", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                         "--num-layers-per-virtual-pipeline-stage", "1",
                         "--pipeline-schedule", "1f1b"],
        "--num-layers-per-virtual-pipeline-stage", "1f1b runs one stage per rank", world=2),
    row("virtual-gpipe", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                          "--num-layers-per-virtual-pipeline-stage", "1",
                          "--pipeline-schedule", "gpipe"],
        "--num-layers-per-virtual-pipeline-stage", "gpipe runs one stage per rank", world=2),
    row("interleaved-without-virtual", ["--pipeline-model-parallel-size", "2",
                                        "--pipeline-schedule", "interleaved-1f1b"],
        "--pipeline-schedule", "needs --num-layers-per-virtual-pipeline-stage", world=2),
    row("virtual-not-dividing", ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
                                 "--num-layers-per-virtual-pipeline-stage", "2"],
        "--num-layers-per-virtual-pipeline-stage", "pp * 2 layers per virtual stage = 4",
        world=2),
    row("uneven-and-virtual", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                               "--num-layers-per-virtual-pipeline-stage", "1",
                               "--decoder-first-pipeline-num-layers", "1"],
        "--decoder-first-pipeline-num-layers", "cannot be combined", world=2),
    row("uneven-rest", ["--pipeline-model-parallel-size", "3", "--num-layers", "4",
                        "--decoder-first-pipeline-num-layers", "1"],
        "--decoder-first-pipeline-num-layers", "3 layers left", world=3),
    row("uneven-two-stages", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                              "--decoder-first-pipeline-num-layers", "1",
                              "--decoder-last-pipeline-num-layers", "1"],
        "--decoder-first-pipeline-num-layers", "hold all 4 layers", world=2),
    row("uneven-last-too-many", ["--pipeline-model-parallel-size", "2",
                                 "--decoder-last-pipeline-num-layers", "5"],
        "--decoder-last-pipeline-num-layers", "[0, --num-layers 2]", world=2),
    row("uneven-first-neg", ["--pipeline-model-parallel-size", "2",
                             "--decoder-first-pipeline-num-layers", "-1"],
        "--decoder-first-pipeline-num-layers", "got -1", world=2),
    row("micro-batches-below-pp", ["--pipeline-model-parallel-size", "2",
                                   "--global-batch-size", "2"], "--global-batch-size",
        "1f1b needs at least pp = 2", world=2),
    row("interleaved-multiple", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                 "--num-layers-per-virtual-pipeline-stage", "1",
                                 "--global-batch-size", "6"], "--global-batch-size",
        "interleaved-1f1b needs a multiple of pp = 2", world=2),
    row("zero-bubble-multiple", ["--pipeline-model-parallel-size", "2",
                                 "--pipeline-schedule", "zero-bubble",
                                 "--global-batch-size", "6"], "--global-batch-size",
        "zero-bubble needs a multiple of pp = 2", world=2),
    row("schedule-choice", ["--pipeline-schedule", "dualpipe"], "--pipeline-schedule",
        "invalid choice"),
    # ---- ZeRO
    row("zero-stage-4", ["--zero-stage", "4"], "--zero-stage", "invalid choice: 4"),
    row("zero-stage-neg", ["--zero-stage", "-1"], "--zero-stage", "invalid choice: -1"),
    row("grad-reduce-dtype", ["--grad-reduce-dtype", "fp16"], "--grad-reduce-dtype",
        "invalid choice: 'fp16'"),
    row("accumulate-fp32-grad-bf16", ["--accumulate-allreduce-grads-in-fp32",
        "--grad-reduce-in-bf16", "--bf16"], "--accumulate-allreduce-grads-in-fp32",
        "not with --grad-reduce-in-bf16"),
    row("grad-reduce-bf16-fp16", ["--grad-reduce-in-bf16", "--fp16"], "--grad-reduce-in-bf16",
        "not with --fp16"),
    row("overlap-param-gather-alone", ["--overlap-param-gather"], "--overlap-param-gather",
        "needs the distributed optimizer"),
    row("optimizer-offload-alone", ["--optimizer-cpu-offload", "--bf16"],
        "--optimizer-cpu-offload", "needs --use-distributed-optimizer with --bf16 or --fp16"),
    row("optimizer-offload-fp32", ["--optimizer-cpu-offload", "--use-distributed-optimizer"],
        "--optimizer-cpu-offload", "needs --use-distributed-optimizer with --bf16 or --fp16"),
    row("optimizer-offload-zero3", ["--optimizer-cpu-offload", "--use-distributed-optimizer",
                                    "--bf16", "--zero-stage", "3"],
        "--optimizer-cpu-offload", "and --zero-stage 0 or 1"),
    row("optimizer-offload-fraction-high", ["--optimizer-offload-fraction", "1.5"],
        "--optimizer-offload-fraction", "must be in [0, 1], got 1.5"),
    row("optimizer-offload-fraction-negative", ["--optimizer-offload-fraction", "-0.1"],
        "--optimizer-offload-fraction", "must be in [0, 1], got -0.1"),
    row("overlap-cpu-optimizer-alone", ["--overlap-cpu-optimizer-d2h-h2d"],
        "--overlap-cpu-optimizer-d2h-h2d", "needs --optimizer-cpu-offload"),
    row("zero-param-offload-alone", ["--zero-param-offload"], "--zero-param-offload",
        "needs --zero-stage 3"),
    row("zero-param-offload-dist-opt", ["--zero-param-offload", "--zero-stage", "3",
                                        "--use-distributed-optimizer", "--bf16"],
        "--zero-param-offload", "not with --use-distributed-optimizer"),
    row("zero-param-offload-tp-only", ["--zero-param-offload", "--zero-stage", "3",
                                       "--tensor-model-parallel-size", "2"],
        "--zero-param-offload", "more than one data x sequence-parallel rank", world=2),
    # ---- recomputation
    row("recompute-method-alone", ["--recompute-method", "uniform"], "--recompute-method",
        "needs --recompute-granularity full (got no recomputation)"),
    row("recompute-layers-alone", ["--recompute-num-layers", "1"], "--recompute-num-layers",
        "needs --recompute-granularity full"),
    row("recompute-method-selective", ["--recompute-activations", "--recompute-method",
                                       "block"], "--recompute-method", "(got selective)"),
    row("recompute-layers-too-many", ["--recompute-granularity", "full",
                                      "--recompute-num-layers", "3"],
        "--recompute-num-layers", "more than the 2 layers"),
    row("recompute-layers-per-stage", ["--pipeline-model-parallel-size", "2", "--num-layers",
                                       "4", "--recompute-granularity", "full",
                                       "--recompute-num-layers", "3"],
        "--recompute-num-layers", "more than the 2 layers of a pipeline stage", world=2),
    row("recompute-granularity", ["--recompute-granularity", "block"],
        "--recompute-granularity", "invalid choice"),
    # ---- --dry-run's own flags
    row("dry-run-world-alone", ["--dry-run-world-size", "2"], "--dry-run-world-size",
        "needs --dry-run"),
    row("dry-run-device-alone", ["--dry-run-device", "cpu"], "--dry-run-device",
        "needs --dry-run"),
    row("dry-run-gpu-alone", ["--dry-run-gpu", "H100"], "--dry-run-gpu", "needs --dry-run"),
    row("dry-run-gpu-unknown", ["--dry-run", "--dry-run-gpu", "X100"], "--dry-run-gpu",
        "X100"),
    row("dry-run-gpu-cpu", ["--dry-run", "--dry-run-gpu", "H100", "--dry-run-device", "cpu"],
        "--dry-run-gpu", "drop --dry-run-device cpu"),
    row("dry-run-backend", ["--attention-backend", "flash"], "--attention-backend", "CUDA",
        world=1),
    row("dry-run-gpu-too-small", ["--num-layers", "48", "--hidden-size", "8192",
                                  "--num-attention-heads", "64", "--seq-length", "4096",
                                  "--dry-run-gpu", "A100-40GB"], "--dry-run-gpu",
        "more than the", world=1),
    # ---- outputs a run would overwrite
    row("metrics-exist", ["--metrics-jsonl", "{tmp}/old.jsonl"], "--metrics-jsonl",
        "already holds an earlier run's records"),
    row("metrics-is-a-directory", ["--metrics-jsonl", "{tmp}"], "--metrics-jsonl",
        "is a directory"),
    row("tensorboard-is-a-file", ["--tensorboard-dir", "{tmp}/afile"], "--tensorboard-dir",
        "not a directory"),
    # issue 28: observability (more in tests/training/test_observability.py)
    row("tensorboard-log-interval-0", ["--tensorboard-log-interval", "0"],
        "--tensorboard-log-interval", "must be > 0"),
    row("profile-without-tensorboard", ["--profile"], "--profile", "needs --tensorboard-dir"),
    row("profile-start-negative", ["--profile-step-start", "-1"], "--profile-step-start",
        "must be >= 0"),
    row("profile-end-not-after-start", ["--profile-step-start", "5", "--profile-step-end", "5"],
        "--profile-step-end", "must be > --profile-step-start 5"),
    row("profile-rank-negative", ["--profile-ranks", "0", "-1"], "--profile-ranks",
        "must be >= 0"),
    row("profile-rank-outside-world", ["--profile", "--tensorboard-dir", "{tmp}/tb",
                                       "--profile-ranks", "0", "2"], "--profile-ranks",
        "rank 2 is outside the world of 2 ranks", world=2),
    row("wandb-without-name", ["--wandb-project", "p", "--save", "{tmp}/ck"],
        "--wandb-exp-name", "required with --wandb-project"),
    row("wandb-without-dir", ["--wandb-project", "p", "--wandb-exp-name", "e"],
        "--wandb-save-dir", "required with --wandb-project when there is no --save"),
    row("wandb-dir-is-a-file", ["--wandb-project", "p", "--wandb-exp-name", "e",
                                "--wandb-save-dir", "{tmp}/afile"], "--wandb-save-dir",
        "cannot write to"),
]


def run_main(argv, capfd):
    """pretrain_gpt.main in this process: (exit code, stdout, stderr)."""
    import pretrain_gpt
    capfd.readouterr()
    rc = pretrain_gpt.main(argv)
    out, err = capfd.readouterr()
    return rc, out, err


def assert_one_line_naming(rc, out, err, flag, words):
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, out + err
    assert not re.search(r"iteration +\d+/", out), "a training step ran"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), lines[0]
    # The flag part is before ": "; a rule about two flags names both, "--a/--b".
    named = lines[0][len("error: "):].split(": ", 1)[0].split("/")
    assert flag in named, lines[0]
    assert words in lines[0], lines[0]
    assert f"{flag}:" not in lines[0].split(": ", 2)[-1], f"the flag twice: {lines[0]}"


@pytest.mark.parametrize("args,flag,words,world", INVALID)
def test_invalid_flags(args, flag, words, world, tmp_path, capfd):
    (tmp_path / "old.jsonl").write_text('{"iteration": 1, "loss": 8.0}\n')
    (tmp_path / "afile").write_text("not a directory, not a tokenizer")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    argv = BASE + args + ["--data-cache-path", str(tmp_path / "cache")]
    if world is not None:
        argv += ["--dry-run", "--dry-run-world-size", str(world)]
    assert_one_line_naming(*run_main(argv, capfd), flag, words)


def test_the_table_covers_every_flag_group():
    from megaulysses.config import build_parser
    named = {p.values[1] for p in INVALID}
    for group in build_parser()._action_groups:
        flags = {o for a in group._group_actions for o in a.option_strings} - {"-h", "--help"}
        assert not flags or flags & named, f"no row for the {group.title!r} flags"
    assert len(INVALID) >= 70
    assert sum(1 for p in INVALID if p.values[3] is not None) >= 20  # grid rows


# ---- real ranks: every rank exits 2 on its own, rank 0 alone prints the line


@pytest.mark.parametrize("args,flag,words", [
    # a schedule rule: every rank refuses the flags before any process group
    (["--lr-warmup-iters", "50"], "--lr-warmup-iters", "--train-iters = 6"),
    # a grid rule, checked by every rank once the process group is up
    (["--ds-sequence-parallel-size", "2", "--num-attention-heads", "6", "--hidden-size",
      "96"] + GQA + ["3"], "--ds-sequence-parallel-size", "kv heads per tensor rank"),
    # a data rule: rank 0 opens the data first, the others after a barrier
    (["--data-path", "{tmp}/missing"], "--data-path", "missing.bin/.idx not found"),
], ids=["schedule", "grid", "data"])
def test_every_rank_exits_2_and_rank_0_prints_one_line(tmp_path, args, flag, words):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    argv = BASE + args + ["--data-cache-path", str(tmp_path / "cache")]
    codes = wait_all(launch(argv, 2, str(tmp_path / "run")), timeout=120)  # srun-style
    logs = [(tmp_path / f"run.rank{r}.log").read_text() for r in range(2)]
    assert codes == [2, 2], logs
    assert "Traceback" not in "".join(logs), logs
    errors = [line for log in logs for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] in logs[0], logs
    assert_one_line_naming(2, "", errors[0], flag, words)


def test_under_torchrun_every_worker_exits_2_with_one_line(tmp_path):
    """The same grid rule under torchrun: one error line in all the output and no
    traceback from our code (torchrun prints its own ChildFailedError). Each worker exits 2,
    unless torchrun stopped it first: once one worker fails, torchrun sends SIGTERM to the
    others (its summary then reports -15 for them)."""
    import subprocess
    import sys
    from dist import free_port
    from helpers import REPO
    grid = ["--ds-sequence-parallel-size", "2", "--num-attention-heads", "6", "--hidden-size",
            "96"] + GQA + ["3"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), "pretrain_gpt.py", *BASE,
                           *grid, "--data-cache-path", str(tmp_path / "cache")], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert 'pretrain_gpt.py", line' not in out and "/megaulysses/" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--ds-sequence-parallel-size" in errors[0], out[-3000:]
    codes = re.findall(r"exitcode\s*: (-?\d+)", out)
    assert "2" in codes and set(codes) <= {"2", "-15"}, out[-3000:]


# ---- every flag's default against the flags that constrain it (item 7): each flag with
# a plausible value other than its default, and every other flag at its default, is valid


# flag -> what follows it: its value (none for a switch), then only the flags without
# which it means nothing (e.g. --save-interval needs --save). Every option string of the
# parser must have an entry, so a new flag without one fails test_every_flag_is_tabled.
ALONE = {
    # model
    "--num-layers": ["12"],
    "--hidden-size": ["512"],
    "--ffn-hidden-size": ["1536"],
    "--num-attention-heads": ["4"],
    "--group-query-attention": [],
    "--num-query-groups": ["2", "--group-query-attention"],
    "--kv-channels": ["64"],
    "--seq-length": ["512"],
    "--max-position-embeddings": ["1024"],
    "--position-embedding-type": ["learned_absolute"],
    "--rotary-base": ["500000"],
    "--normalization": ["LayerNorm"],
    "--norm-epsilon": ["1e-6"],
    "--swiglu": [],  # restates the default
    "--no-swiglu": [],
    "--disable-bias-linear": [],  # restates the default (Megatron-LM scripts pass it)
    "--add-bias-linear": [],
    "--untie-embeddings-and-output-weights": [],
    "--fp32-residual-connection": [],  # no effect under fp32, as in Megatron-LM
    "--hidden-dropout": ["0.1"],
    "--attention-dropout": ["0.1"],
    "--init-method-std": ["0.01"],
    "--make-vocab-size-divisible-by": ["64"],
    "--attention-backend": ["block"],
    # issue 23: Qwen2/3 attention, RoPE scalings
    "--add-qkv-bias": [],
    "--qk-layernorm": [],
    "--use-rope-scaling": [],
    "--rope-scaling-factor": ["4", "--use-rope-scaling"],
    "--rope-scaling-low-freq-factor": ["2", "--use-rope-scaling"],
    "--rope-scaling-high-freq-factor": ["8", "--use-rope-scaling"],
    "--original-max-position-embeddings": ["128", "--use-rope-scaling"],
    "--rotary-seq-len-interpolation-factor": ["4"],
    "--rope-type": ["yarn"],
    "--rotary-scaling-factor": ["4", "--rope-type", "yarn"],
    "--yarn-beta-fast": ["16", "--rope-type", "yarn"],
    "--yarn-beta-slow": ["2", "--rope-type", "yarn"],
    "--mscale": ["0.707", "--rope-type", "yarn", "--mscale-all-dim", "0.707"],
    "--mscale-all-dim": ["0.707", "--rope-type", "yarn", "--mscale", "0.707"],
    # attention mask
    "--window-size": ["64"],
    "--attention-sparsity": ["bigbird"],
    "--sparse-block-size": ["32"],
    "--sparse-local-blocks": ["2"],
    "--sparse-global-blocks": ["0"],
    "--sparse-random-blocks": ["2"],
    "--sparse-seed": ["7"],
    # data
    "--data-path": ["data/shakespeare_text_document"],
    "--split": ["98,2,0"],
    "--mock-data": [],
    "--data-cache-path": ["/tmp/megaulysses-cache"],
    "--tokenizer-type": ["NullTokenizer", "--vocab-size", "4095"],
    "--tokenizer-model": ["data/shakespeare_tok.model"],
    "--vocab-size": ["4096"],
    "--eod-mask-loss": [],
    "--reset-position-ids": [],
    "--reset-attention-mask": [],
    # training
    "--micro-batch-size": ["4"],
    "--global-batch-size": ["32"],
    "--train-iters": ["1000"],
    "--lr": ["1e-4"],
    "--min-lr": ["1e-5"],
    "--lr-decay-style": ["linear"],
    "--lr-warmup-iters": ["20"],
    "--lr-warmup-init": ["1e-5"],
    "--lr-warmup-fraction": ["0.05"],
    "--lr-decay-iters": ["150"],
    "--weight-decay": ["0"],
    "--adam-beta1": ["0.8"],
    "--adam-beta2": ["0.999"],
    "--adam-eps": ["1e-6"],
    "--clip-grad": ["0"],
    "--bf16": [],
    "--fp16": [],
    "--loss-scale": ["1024"],
    "--initial-loss-scale": ["4096"],
    "--min-loss-scale": ["2"],
    "--loss-scale-window": ["500"],
    "--hysteresis": ["4"],
    "--seed": ["7"],
    "--eval-interval": ["100"],
    "--eval-iters": ["0"],
    "--save": ["runs/ck"],
    "--load": ["runs/ck"],
    "--save-interval": ["50", "--save", "runs/ck"],
    "--exit-interval": ["100"],
    "--exit-duration-in-mins": ["60"],
    "--exit-signal-handler": [],
    "--no-exit-signal-handler": [],
    "--keep-last": ["2", "--save", "runs/ck"],
    "--save-retain-interval": ["2", "--save", "runs/ck"],
    "--async-save": ["--save", "runs/ck"],
    "--no-load-optim": [],
    "--no-load-rng": [],
    "--exit-on-missing-checkpoint": ["--load", "runs/ck"],
    "--generate": ["100"],
    "--check-for-nan-in-loss-and-grad": [],  # restates the default
    "--no-check-for-nan-in-loss-and-grad": [],
    "--max-consecutive-skipped": ["0"],
    "--deterministic": [],
    "--generate-prompt": ["ROMEO:"],
    "--generate-temperature": ["1.0"],
    "--generate-top-k": ["0"],
    "--torch-compile": [],  # issue 43: compiled blocks
    # parallelism: validated on the smallest world that holds the grid
    "--tensor-model-parallel-size": ["2"],
    "--sequence-parallel": [],
    "--ds-sequence-parallel-size": ["2"],
    "--ulysses-degree": ["4"],
    "--context-parallel-size": ["2"],
    "--pipeline-model-parallel-size": ["2"],
    "--use-distributed-optimizer": [],
    "--grad-reduce-in-bf16": [],
    "--accumulate-allreduce-grads-in-fp32": ["--fp16", "--use-distributed-optimizer"],
    "--optimizer-cpu-offload": ["--use-distributed-optimizer", "--bf16"],
    "--optimizer-offload-fraction": ["0.5", "--optimizer-cpu-offload",
                                     "--use-distributed-optimizer", "--bf16"],
    "--overlap-cpu-optimizer-d2h-h2d": ["--optimizer-cpu-offload",
                                        "--use-distributed-optimizer", "--bf16"],
    "--zero-param-offload": ["--zero-stage", "3", "--ds-sequence-parallel-size", "2"],
    # Megatron-LM's flags with no effect here (logged)
    "--use-mcore-models": [],
    "--transformer-impl": ["local"],
    "--no-masked-softmax-fusion": [],
    "--no-bias-gelu-fusion": [],
    "--no-bias-dropout-fusion": [],
    "--no-gradient-accumulation-fusion": [],
    "--no-persist-layer-norm": [],
    "--cross-entropy-loss-fusion": [],
    "--overlap-grad-reduce": [],
    "--overlap-param-gather": ["--use-distributed-optimizer"],
    "--ddp-bucket-size": ["1000000", "--use-distributed-optimizer"],
    "--ddp-num-buckets": ["4", "--use-distributed-optimizer"],
    "--manual-gc": [],
    "--log-throughput": [],
    "--distributed-backend": ["gloo"],
    "--pipeline-schedule": ["gpipe"],
    "--num-layers-per-virtual-pipeline-stage": ["1", "--pipeline-model-parallel-size", "2"],
    "--decoder-first-pipeline-num-layers": ["2", "--pipeline-model-parallel-size", "2"],
    "--decoder-last-pipeline-num-layers": ["2", "--pipeline-model-parallel-size", "2"],
    "--zero-stage": ["3"],
    "--grad-reduce-dtype": ["bf16"],
    "--distributed-timeout-minutes": ["30"],
    # activation memory and the plan
    "--recompute-granularity": ["full"],
    "--recompute-activations": [],
    "--recompute-method": ["block", "--recompute-granularity", "full"],
    "--recompute-num-layers": ["2", "--recompute-granularity", "full"],
    "--tiled-mlp-chunks": ["4"],
    "--mlp-chunks-for-training": ["4"],  # Megatron-LM's name of it (issue 39)
    "--cpu-offloading-num-layers": ["1", "--recompute-granularity", "full"],
    "--attention-head-groups": ["2"],
    "--ds-sequence-parallel-fpdt": ["--ds-sequence-parallel-size", "2",
                                    "--attention-dropout", "0"],
    "--ds-sequence-parallel-fpdt-chunk-size": ["128", "--ds-sequence-parallel-fpdt",
                                               "--ds-sequence-parallel-size", "2",
                                               "--attention-dropout", "0"],
    "--ds-sequence-parallel-fpdt-offloading": ["--ds-sequence-parallel-fpdt",
                                               "--ds-sequence-parallel-size", "2",
                                               "--attention-dropout", "0"],
    "--dry-run": [],
    "--dry-run-world-size": ["8", "--dry-run"],
    "--dry-run-device": ["cuda", "--dry-run"],
    "--dry-run-gpu": ["H100", "--dry-run"],
    # logging
    "--log-interval": ["1"],
    "--tensorboard-dir": ["runs/tb"],
    "--metrics-jsonl": ["runs/metrics.jsonl"],
    "--peak-tflops": ["100"],
    # issue 28: defaults and refused flags
    "--use-rotary-position-embeddings": [],
    "--persistent-save-interval": ["50", "--save", "runs/ck"],
    "--deterministic-mode": [],
    "--use-torch-fsdp2": [],
    # issue 23: Hugging Face tokenizers
    "--eod-token-id": ["2", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                       "hf/llama3"],
    "--tokenizer-hf-include-special-tokens": ["--tokenizer-type", "HuggingFaceTokenizer",
                                              "--tokenizer-model", "hf/llama3"],
    "--tokenizer-hf-no-include-special-tokens": ["--tokenizer-type", "HuggingFaceTokenizer",
                                                 "--tokenizer-model", "hf/llama3"],
    # issue 28: tokenizer
    "--vocab-file": ["gpt2/vocab.json", "--tokenizer-type", "GPT2BPETokenizer", "--merge-file",
                     "gpt2/merges.txt"],
    "--merge-file": ["gpt2/merges.txt", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                     "gpt2/vocab.json"],
    # issue 28: observability
    "--log-params-norm": [],
    "--log-num-zeros-in-grad": [],
    "--tensorboard-log-interval": ["10", "--tensorboard-dir", "runs/tb"],
    "--log-timers-to-tensorboard": ["--tensorboard-dir", "runs/tb"],
    "--profile": ["--tensorboard-dir", "runs/tb"],
    "--profile-step-start": ["5", "--profile", "--tensorboard-dir", "runs/tb"],
    "--profile-step-end": ["20", "--profile", "--tensorboard-dir", "runs/tb"],
    "--profile-ranks": ["1", "--tensor-model-parallel-size", "2", "--profile",
                        "--tensorboard-dir", "runs/tb"],
    "--use-pytorch-profiler": ["--profile", "--tensorboard-dir", "runs/tb"],
    "--wandb-project": ["p", "--wandb-exp-name", "e", "--save", "runs/ck"],
    "--wandb-exp-name": ["e", "--wandb-project", "p", "--save", "runs/ck"],
    "--wandb-save-dir": ["runs/wandb", "--wandb-project", "p", "--wandb-exp-name", "e"],
    "--wandb-entity": ["team", "--wandb-project", "p", "--wandb-exp-name", "e", "--save",
                       "runs/ck"],
    "--check-for-spiky-loss": [],
    "--check-for-large-grads": [],
    "--rerun-mode": ["disabled"],  # issue 39: a non-finite step exits at once
    "--empty-unused-memory-level": ["2"],
    # issue 28: loss, checkpoint and loader
    "--calculate-per-token-loss": [],
    "--apply-layernorm-1p": [],
    "--no-save-optim": ["--save", "runs/ck"],
    "--no-save-rng": ["--save", "runs/ck"],
    "--num-workers": ["2"],
    "--dataloader-type": ["cyclic"],  # issue 39: Megatron-LM's cyclic sampler
    "--no-data-sharding": ["--dataloader-type", "cyclic"],
    # issue 28: schedule
    "--train-samples": ["64"],
    "--lr-decay-samples": ["48", "--train-samples", "64"],
    "--lr-warmup-samples": ["8", "--train-samples", "64"],
    "--rampup-batch-size": ["8", "8", "64", "--global-batch-size", "32", "--train-samples",
                            "512"],
    "--decoupled-lr": ["1e-3"],
    "--decoupled-min-lr": ["1e-5", "--decoupled-lr", "1e-3"],
}
RESTATE_A_DEFAULT = {"--swiglu", "--disable-bias-linear", "--check-for-nan-in-loss-and-grad",
                     "--use-rotary-position-embeddings"}  # the bundled run's rope
NOT_A_RUN = {"-h", "--help"}  # prints the help and exits 0 (tests/test_help.py)
# Reads the model flags of a real --load checkpoint: tests/tools/test_megatron_bad_input.py
# (a flag that contradicts it) and test_megatron_checkpoints.py (a run from Megatron-LM's).
NEEDS_A_CHECKPOINT = {"--use-checkpoint-args"}


def test_every_flag_is_tabled():
    """Every flag the schema declares. Megatron-LM's hidden flags, generated from
    config/megatron_table.py, are each parsed by tests/test_megatron_compat.py instead."""
    import argparse

    from megaulysses.config import build_parser
    options = {o for a in build_parser()._actions if a.help is not argparse.SUPPRESS
               for o in a.option_strings}
    assert set(ALONE) | NOT_A_RUN | NEEDS_A_CHECKPOINT == options, (
        f"missing: {sorted(options - set(ALONE) - NOT_A_RUN - NEEDS_A_CHECKPOINT)}, "
        f"not flags: {sorted(set(ALONE) - options)}")


@pytest.mark.parametrize("flag", sorted(ALONE))
def test_one_flag_alone_is_valid(flag):
    """parse_args and every start-up check that needs no files: the grid's rules on the
    smallest world that holds it (the vocabulary as the bundled tokenizer sets it), and
    the attention backend for the mask on this CPU."""
    import dataclasses

    import torch

    from megaulysses.config import parse_args, resolve
    from megaulysses.training.run import attention_backend, compute_dtype
    cfg = parse_args([flag] + ALONE[flag])
    par = cfg.parallel
    world = (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
             * par.ds_sequence_parallel_size * par.context_parallel_size)
    vocab = 4096 if cfg.data.tokenizer_type != "NullTokenizer" else \
        cfg.data.vocab_size + 1  # + the end-of-document token
    run_cfg = resolve(cfg, world, vocab)
    attention_backend(run_cfg, torch.device("cpu"), compute_dtype(cfg))
    changed = dataclasses.asdict(cfg) != dataclasses.asdict(parse_args([]))
    assert changed or flag in RESTATE_A_DEFAULT, f"{flag} {ALONE[flag]} changes nothing"
