"""The run's settings: plain frozen dataclasses, each field declared once with its flag.

A field's metadata (`option(...)`) says everything the command line needs: the flag, its
help, how its value is checked (`kind`), its choices, any extra flags that set it, and room
for Megatron-LM's name and aliases. `cli.build_parser()` is generated from these fields, so
a default is written in one place only. Values that depend on other flags, the world size
or the tokenizer are left None here and filled by `resolve()`.

Defaults differ from Megatron-LM in one deliberate way: with no flags at all the run is
the bundled default, a small Llama-style model (RoPE, RMSNorm, SwiGLU, no biases) on the
Shakespeare corpus in `data/`. A GPT-2 style model is
`--position-embedding-type learned_absolute --normalization LayerNorm --no-swiglu
--add-bias-linear`; the start-up log prints the architecture either way.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from megaulysses.config.compat import MEGATRON_ATTENTION, CompatConfig
from megaulysses.config.fields import Flag, derived, option

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_DATA = os.path.join(REPO_ROOT, "data", "shakespeare_text_document")
BUNDLED_TOKENIZER = os.path.join(REPO_ROOT, "data", "shakespeare_tok.model")

# The attention backends: model/attention BACKENDS (not imported: the schema needs no torch).
ATTENTION_BACKENDS = ("auto", "math", "block", "sdpa", "flash", "flex")
ATTENTION_SPARSITIES = ("dense", "fixed", "bigbird")
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "gpipe")
TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")
LR_DECAY_STYLES = ("cosine", "linear", "constant")
ZERO_STAGES = (0, 1, 2, 3)
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")

# What the attention may see: not part of a checkpoint's shape (any mask loads any weights).
MASK_FIELDS = ("window_size", "attention_sparsity", "sparse_block_size", "sparse_local_blocks",
               "sparse_global_blocks", "sparse_random_blocks", "sparse_seed")

# The help's groups, in the order --help lists them.
MODEL, MASK, DATA, TRAINING, PARALLEL, MEMORY, LOGGING, COMPAT = (
    "model", "attention mask (causal always; these narrow it)", "data", "training",
    "parallelism (data-parallel size = world / (tp*pp*sp*cp))",
    "activation memory (recomputation, tiling) and the memory plan", "logging",
    "Megatron-LM flags accepted with no effect here (each logged once, with the reason)")
GROUPS = (MODEL, MASK, DATA, TRAINING, PARALLEL, MEMORY, LOGGING, COMPAT)


def _relative(path: str) -> str:
    """A bundled file as the help shows it: relative to the checkout."""
    return os.path.relpath(path, REPO_ROOT)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = option(6, "transformer layers", kind="positive")
    hidden_size: int = option(384, "model width", kind="positive")
    ffn_hidden_size: Optional[int] = option(
        None, "MLP width; default: 4*hidden, or 8*hidden/3 rounded up to 64 with --swiglu",
        kind="positive")
    num_attention_heads: int = option(8, "query heads", kind="positive")
    num_query_groups: Optional[int] = option(  # kv heads; None: = num_attention_heads (MHA)
        None, "key/value heads under --group-query-attention; default: 1 with it (multi-query), "
        "else one per attention head", kind="positive", before=(Flag(
            "grouped-query attention: --num-query-groups key/value heads",
            names=("--group-query-attention",), action="store_true", default=False,
            dest="group_query_attention"),))
    kv_channels: Optional[int] = option(
        None, "head dimension; default: hidden / heads", kind="positive")
    seq_length: int = option(256, "tokens per sample", kind="positive")
    max_position_embeddings: Optional[int] = option(
        None, "longest sequence the positions cover; default: --seq-length", kind="positive")
    position_embedding_type: str = option(
        "rope", "rotary (RoPE) or learned absolute (GPT-2) positions",
        choices=("rope", "learned_absolute"))
    rotary_base: float = option(10000.0, "RoPE base frequency (theta)", kind="number")
    normalization: str = option(
        "RMSNorm", "the norm before attention, before the MLP and at the end",
        choices=("RMSNorm", "LayerNorm"))
    norm_epsilon: float = option(1e-05, "epsilon of the norms", kind="number")
    swiglu: bool = option(True, "SwiGLU MLP; --no-swiglu: GeLU", action="optional")
    add_bias_linear: bool = option(
        False, "biases in the linear layers (GPT-2)", action="store_true", before=(Flag(
            "no biases in the linear layers, as by default (Megatron-LM's flag; "
            "--add-bias-linear adds them)", names=("--disable-bias-linear",),
            action="store_false", default=False),))
    untie_embeddings_and_output_weights: bool = option(
        False, "an output layer of its own instead of the input embedding's weights",
        action="store_true")
    hidden_dropout: float = option(0.0, "dropout after attention and MLP, in [0, 1)", kind="number")
    attention_dropout: float = option(
        0.0, "dropout of the attention probabilities, in [0, 1)", kind="number")
    init_method_std: float = option(
        0.02, "standard deviation of the initial weights", kind="number")
    vocab_size: int = derived(0)  # the tokenizer's; filled by resolve()
    make_vocab_size_divisible_by: int = option(
        128, "pad the vocabulary to a multiple of this", kind="positive")
    attention_backend: str = option(
        "auto", "auto: flash_attn (CUDA, 16-bit) where installed and the mask allows, flex for "
        "other masks on CUDA, SDPA; on CPU the block kernels. Megatron-LM's fused, unfused "
        "and local run as sdpa, math and math",
        choices=ATTENTION_BACKENDS + tuple(MEGATRON_ATTENTION))
    window_size: Optional[int] = option(
        None, "sliding window: each token attends the last W tokens, itself included "
        "(Mistral-style); only blocks inside it are computed; default: none (full causal)",
        kind="positive", group=MASK)
    attention_sparsity: str = option(
        "dense", "block-sparse layout: fixed (DeepSpeed / Sparse Transformer local windows + "
        "summary blocks) or bigbird (local + global + seeded random blocks); only attended "
        "blocks are computed", choices=ATTENTION_SPARSITIES, group=MASK)
    sparse_block_size: int = option(64, "tokens per sparse block", kind="positive", group=MASK)
    sparse_local_blocks: int = option(
        4, "fixed: blocks per local window; bigbird: sliding window in blocks", kind="positive",
        group=MASK)
    sparse_global_blocks: int = option(
        1, "fixed: summary blocks at the end of each window; bigbird: the first blocks, attended "
        "by all", kind="int", group=MASK)
    sparse_random_blocks: int = option(
        1, "bigbird: random earlier blocks per query block", kind="int", group=MASK)
    sparse_seed: int = option(1234, "bigbird: seed of the random blocks", kind="int", group=MASK)


    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def padded_vocab_size(self) -> int:
        # Padding depends on the flag only, never on the grid, so every grid builds the same
        # shapes (and the same initial weights). Grids check divisibility separately.
        m = self.make_vocab_size_divisible_by
        return m * math.ceil(self.vocab_size / m)

    def shape_dict(self) -> dict:
        """What a checkpoint must agree on to be loaded into this model."""
        d = asdict(self)
        for k in ("hidden_dropout", "attention_dropout", "attention_backend", "init_method_std",
                  *MASK_FIELDS):
            d.pop(k)
        d.update(ffn_hidden_size=self.ffn_size, num_query_groups=self.num_kv_heads,
                 kv_channels=self.head_dim, max_position_embeddings=self.max_positions,
                 padded_vocab_size=self.padded_vocab_size)
        return d



@dataclass(frozen=True)
class DataConfig:
    data_path: list = option(
        [BUNDLED_DATA], "PREFIX, PREFIX PREFIX... (equal weights), or W1 PREFIX1 W2 PREFIX2 ... "
        f"of .bin/.idx pairs; default: {_relative(BUNDLED_DATA)} (the bundled corpus)",
        nargs="+")
    split: str = option("969,30,1", "train,valid,test weights over the documents, e.g. 98,2,0")
    mock_data: bool = option(
        False, "random tokens instead of --data-path (benchmarks, tests)", action="store_true")
    data_cache_path: Optional[str] = option(
        None, "where the sample indices are cached; default: <first data prefix>_cache")
    tokenizer_type: str = option(
        "SentencePieceTokenizer", "NullTokenizer: token ids as they are, with --vocab-size",
        choices=TOKENIZER_TYPES)
    tokenizer_model: Optional[str] = option(
        BUNDLED_TOKENIZER, "the SentencePiece model file; default: "
        f"{_relative(BUNDLED_TOKENIZER)} (the bundled one)")
    vocab_size: Optional[int] = option(
        None, "NullTokenizer: ids are below this (the end-of-document id is this one); other "
        "tokenizers set the vocabulary themselves", kind="positive")
    eod_mask_loss: bool = option(
        False, "no loss where the input token is the end-of-document token", action="store_true")
    reset_position_ids: bool = option(
        False, "positions restart at 0 after every end-of-document token", action="store_true")
    reset_attention_mask: bool = option(
        False, "packed documents: tokens attend within their own document only",
        action="store_true")


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = option(8, "samples per forward/backward on a rank", kind="positive")
    global_batch_size: Optional[int] = option(
        None, "samples per iteration over all data-parallel ranks (default: --micro-batch-size x "
        "dp, x pp under a pipeline: no accumulation)", kind="positive")
    train_iters: int = option(200, "iterations (optimizer steps) to train", kind="positive")
    lr: float = option(0.002, "peak learning rate", kind="number")
    min_lr: float = option(
        0.0, "learning rate at the end of the decay, in [0, --lr]", kind="number")
    lr_decay_style: str = option(
        "cosine", "from --lr down to --min-lr after the warmup",
        choices=LR_DECAY_STYLES)
    lr_warmup_iters: Optional[int] = option(
        None, "iterations of linear warmup; default: --lr-warmup-fraction", kind="int")
    lr_warmup_fraction: Optional[float] = option(
        None, "warmup as a fraction of the decay iterations; default 0.1 when --lr-warmup-iters "
        "is not given", kind="number")
    lr_decay_iters: Optional[int] = option(
        None, "iterations over which the learning rate decays (warmup included); default: "
        "--train-iters", kind="positive")
    weight_decay: float = option(0.1, "AdamW weight decay (not on biases and norms)", kind="number")
    adam_beta1: float = option(0.9, "AdamW beta1, in [0, 1)", kind="number")
    adam_beta2: float = option(0.95, "AdamW beta2, in [0, 1)", kind="number")
    adam_eps: float = option(1e-08, "AdamW epsilon, > 0", kind="number")
    clip_grad: float = option(
        1.0, "clip the global gradient norm to this; 0 disables clipping", kind="number")
    bf16: bool = option(False, "bfloat16 autocast (fp32 weights)", action="store_true")
    fp16: bool = option(
        False, "float16 autocast (fp32 weights) with loss scaling", action="store_true")
    loss_scale: Optional[float] = option(
        None, "--fp16: a static loss scale; default: none (dynamic scaling)", kind="number")
    initial_loss_scale: float = option(
        65536.0, "--fp16 dynamic scaling: the scale to start from", kind="number")
    min_loss_scale: float = option(
        1.0, "--fp16 dynamic scaling: the scale never falls below this", kind="number")
    loss_scale_window: int = option(
        1000, "--fp16 dynamic scaling: steps without overflow before the scale doubles",
        kind="positive")
    hysteresis: int = option(
        2, "--fp16 dynamic scaling: overflows tolerated before the scale halves", kind="positive")
    seed: int = option(
        1234, "seed of the initial weights, data order, dropout and sampling", kind="int")
    eval_interval: int = option(
        50, "evaluate on the valid split every this many iterations", kind="positive")
    eval_iters: int = option(5, "global batches per evaluation; 0 disables evaluation", kind="int")
    save: Optional[str] = option(None, "checkpoint directory to save to")
    load: Optional[str] = option(
        None, "checkpoint directory (or iter_XXXXXXX directory) to resume from")
    save_interval: Optional[int] = option(
        None, "with --save: save every this many iterations; default: at the end only",
        kind="positive")
    exit_interval: Optional[int] = option(
        None, "stop after the first iteration divisible by this (saving with --save)",
        kind="positive")
    exit_duration_in_mins: Optional[float] = option(
        None, "save (with --save) and stop once the run has lasted this long", kind="number")
    exit_signal_handler: Optional[bool] = option(  # None: on under SLURM (resolve())
        None, "on SIGTERM or SIGUSR1 every rank finishes the current step, saves (with --save) "
        "and exits 0; default: on under SLURM", action="optional")
    keep_last: Optional[int] = option(
        None, "keep only the newest N committed checkpoints (default: all)", kind="positive")
    save_retain_interval: Optional[int] = option(
        None, "with --save: keep the checkpoints whose iteration is a multiple of this, and "
        "the latest; the others are removed once a newer checkpoint is committed (Megatron-"
        "LM's; with --keep-last, a checkpoint either keeps stays)", kind="positive")
    async_save: bool = option(
        False, "write checkpoints in a background thread while training goes on",
        action="store_true")
    no_load_optim: bool = option(
        False, "load only the model (and RNG) from --load: a fresh optimizer", action="store_true")
    no_load_rng: bool = option(
        False, "do not restore the RNG states saved in --load", action="store_true")
    generate: int = option(
        0, "sample this many tokens from the trained model at the end; 0: off (the run without "
        "flags samples 200)", kind="int")
    check_for_nan_in_loss_and_grad: bool = option(
        True, "a non-finite loss or gradient norm on any rank skips the step on every rank "
        "(counted as skipped); off: the step is taken anyway", action="optional")
    max_consecutive_skipped: int = option(
        10, "stop with an error after this many skipped steps in a row, leaving the last "
        "checkpoint as it was (0: never; with --fp16 dynamic loss scaling, skips while the scale "
        "can still fall do not count)", kind="int")
    deterministic: bool = option(
        False, "CUDA: deterministic kernels only (docs/determinism.md says what it switches on "
        "and costs); CPU runs are bit-identical without it", action="store_true")
    generate_prompt: str = option(
        "", "--generate: the text the sample continues (default: empty, from the end-of-document "
        "token)")
    generate_temperature: float = option(0.8, "--generate: softmax temperature, > 0", kind="number")
    generate_top_k: int = option(
        40, "--generate: sample among the k likeliest tokens; 0: all", kind="int")


@dataclass(frozen=True)
class LogConfig:
    log_interval: int = option(
        10, "log (and write --metrics-jsonl) every this many iterations", kind="positive")
    tensorboard_dir: Optional[str] = option(None, "write TensorBoard scalars here")
    metrics_jsonl: Optional[str] = option(
        None, "write one JSON record per logged iteration and evaluation here")
    peak_tflops: Optional[float] = option(
        None, "peak TFLOP/s per device for MFU; default: known GPU table, or a matmul measured "
        "at start-up on CPU", kind="number")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = option(
        1, "tensor-parallel degree tp (Megatron column/row-parallel layers)", kind="positive")
    tp_sequence_parallel: bool = option(  # Megatron-SP inside the tp group
        False, "Megatron-style sequence parallelism inside the tensor-parallel group",
        action="store_true", names=("--sequence-parallel",))
    ds_sequence_parallel_size: int = option(
        1, "Ulysses sequence-parallel degree U (all-to-all; heads / tp / U heads per rank)",
        kind="positive", names=("--ds-sequence-parallel-size", "--ulysses-degree"))
    context_parallel_size: int = option(
        1, "ring attention degree C over groups of U Ulysses ranks (sequence degree U * C; "
        "zigzag chunks for causal balance)", kind="positive")
    pipeline_model_parallel_size: int = option(
        1, "pipeline stages (layers split into consecutive blocks)", kind="positive")
    pipeline_schedule: Optional[str] = option(
        None, "the order of micro-batch forwards and backwards over the stages; default: 1f1b, "
        "or interleaved-1f1b with --num-layers-per-virtual-pipeline-stage",
        choices=PIPELINE_SCHEDULES)
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "layers per model chunk; each pipeline rank then holds layers / (pp * this) chunks "
        "(interleaved schedules)", kind="positive")
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "layers on the first stage (uneven split; the rest evenly)", kind="int")
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "layers on the last stage (uneven split; the rest evenly)", kind="int")
    zero_stage: int = option(
        0, "ZeRO over the data x sequence-parallel ranks: 1 shards optimizer states, 2 also "
        "gradients, 3 also parameters (see README)", kind="int", choices=ZERO_STAGES)
    use_distributed_optimizer: bool = option(
        False, "Megatron-LM's distributed optimizer: optimizer states sharded over the data x "
        "sequence-parallel ranks, = --zero-stage 1 (a higher --zero-stage shards more and "
        "stays)", action="store_true")
    grad_reduce_dtype: str = option(
        "fp32", "dtype in which gradients are summed over the data x sequence-parallel ranks",
        choices=GRAD_REDUCE_DTYPES, after=(Flag(
            "= --grad-reduce-dtype bf16 (Megatron-LM's)", names=("--grad-reduce-in-bf16",),
            action="store_const", const="bf16"),))
    distributed_timeout_minutes: float = option(
        10.0, "a collective that waits longer than this (a rank died or hangs) fails, and every "
        "rank exits non-zero naming the rank(s) it lost", kind="number")


@dataclass(frozen=True)
class MemoryConfig:
    """Activation memory: recomputation (Megatron-LM's flags) and tiling, and the dry run."""
    recompute_granularity: Optional[str] = option(
        None, "full: recompute whole transformer blocks in backward (only their inputs are kept; "
        "the forward all-to-alls run again); selective: recompute only the attention core "
        "(between the all-to-alls); default: none (no recomputation)",
        choices=RECOMPUTE_GRANULARITIES, after=(Flag(
            "= --recompute-granularity selective", names=("--recompute-activations",),
            action="store_const", const="selective"),))
    recompute_method: Optional[str] = option(
        None, "with --recompute-granularity full: uniform checkpoints groups of "
        "--recompute-num-layers consecutive layers; block checkpoints the first "
        "--recompute-num-layers layers of each pipeline stage and keeps the rest's activations "
        "(default uniform)", choices=RECOMPUTE_METHODS)
    recompute_num_layers: Optional[int] = option(
        None, "with --recompute-granularity full: see --recompute-method (default 1)",
        kind="positive")
    tiled_mlp_chunks: int = option(
        1, "run each MLP over the local sequence in this many chunks, recomputed in backward: "
        "its [tokens, ffn] intermediates exist for one chunk at a time", kind="positive")
    dry_run: bool = option(
        False, "validate every flag, build the model on the meta device, print the per-rank "
        "memory plan and communication bytes, exit 0 without allocating the model or training",
        action="store_true")
    dry_run_world_size: Optional[int] = option(
        None, "with --dry-run on one process: the number of ranks of the grid to plan for "
        "(default: WORLD_SIZE, or 1)", kind="positive")
    dry_run_device: Optional[str] = option(
        None, "with --dry-run: the device to plan for; it picks the attention kernel and the "
        "loss's chunks (default: cuda if available, else cpu)", choices=("cpu", "cuda"))
    dry_run_gpu: Optional[str] = option(
        None, "with --dry-run: plan for cuda and exit 2 unless every stage fits this GPU "
        "(A100-40GB, A100-80GB, H100, H200: tools/plan.py's table) less 4 GiB reserved for the "
        "CUDA context, NCCL and fragmentation", kind="gpu")


@dataclass(frozen=True)
class Config:
    """Every setting of a run, as given (parse_args) or completed (resolve -> RunConfig)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)


# The help group of each section's flags (a field's own `group` overrides it).
SECTIONS = {"model": (ModelConfig, MODEL), "data": (DataConfig, DATA),
            "train": (TrainConfig, TRAINING), "parallel": (ParallelConfig, PARALLEL),
            "memory": (MemoryConfig, MEMORY), "log": (LogConfig, LOGGING),
            "compat": (CompatConfig, COMPAT)}
