"""Command-line flags (Megatron-LM names) and all validation, in one place.

`parse_args(argv)` turns flags into a `Config` of plain dataclasses and validates them;
any inconsistency raises `ConfigError(flag, rule)`, which `pretrain_gpt.py` prints as one
line and turns into exit code 2. Nothing else in the package parses flags.

Defaults differ from Megatron-LM in one deliberate way: with no flags at all the run is
the bundled default, a small Llama-style model (RoPE, RMSNorm, SwiGLU, no biases) on the
Shakespeare corpus in `data/`. A GPT-2 style model is
`--position-embedding-type learned_absolute --normalization LayerNorm --no-swiglu
--add-bias-linear`; the start-up log prints the architecture either way.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_DATA = os.path.join(REPO_ROOT, "data", "shakespeare_text_document")
BUNDLED_TOKENIZER = os.path.join(REPO_ROOT, "data", "shakespeare_tok.model")

# The attention backends: model/attention/backends.py BACKENDS (imported lazily: no torch here).
ATTENTION_BACKENDS = ("auto", "math", "block", "sdpa", "flash", "flex")
ATTENTION_SPARSITIES = ("dense", "fixed", "bigbird")
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "gpipe")
TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")
LR_DECAY_STYLES = ("cosine", "linear", "constant")
ZERO_STAGES = (0, 1, 2, 3)
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


class ConfigError(ValueError):
    """A flag (or file named by a flag) breaks a rule. str() is the one line users see."""

    def __init__(self, flag: str, rule: str):
        super().__init__(f"{flag}: {rule}")
        self.flag = flag


class CheckpointError(ValueError):
    """A --load checkpoint is unreadable or does not fit the model. One line for users.
    (Defined here, with ConfigError, so that the command line imports no torch to report
    either.)"""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. every step skipped for non-finite values): one line,
    exit 1, nothing saved past the last good checkpoint."""


# What the attention may see: not part of a checkpoint's shape (any mask loads any weights).
MASK_FIELDS = ("window_size", "attention_sparsity", "sparse_block_size", "sparse_local_blocks",
               "sparse_global_blocks", "sparse_random_blocks", "sparse_seed")


@dataclass
class ModelConfig:
    num_layers: int = 6
    hidden_size: int = 384
    ffn_hidden_size: Optional[int] = None  # None: 4h (gelu) or 8h/3 rounded up to 64 (swiglu)
    num_attention_heads: int = 8
    num_query_groups: Optional[int] = None  # kv heads; None: = num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # head dim; None: hidden / heads
    seq_length: int = 256
    max_position_embeddings: Optional[int] = None  # None: seq_length
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: float = 10000.0
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    add_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    vocab_size: int = 0  # tokenizer vocabulary; set from the tokenizer
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"
    window_size: Optional[int] = None  # sliding window: each token sees the last W tokens
    attention_sparsity: str = "dense"  # dense | fixed | bigbird (block-sparse layouts)
    sparse_block_size: int = 64
    sparse_local_blocks: int = 4
    sparse_global_blocks: int = 1
    sparse_random_blocks: int = 1  # bigbird only
    sparse_seed: int = 1234  # bigbird's random blocks: the same on every rank and step

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


@dataclass
class DataConfig:
    data_path: list = field(default_factory=lambda: [BUNDLED_DATA])
    split: str = "969,30,1"
    mock_data: bool = False
    data_cache_path: Optional[str] = None  # None: <first data prefix>_cache
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: Optional[str] = BUNDLED_TOKENIZER
    vocab_size: Optional[int] = None  # NullTokenizer / mock data only
    eod_mask_loss: bool = False
    reset_position_ids: bool = False  # positions restart after every EOD
    reset_attention_mask: bool = False  # tokens attend within their own document only


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    global_batch_size: Optional[int] = None  # None: micro_batch_size * dp (Megatron-LM)
    train_iters: int = 200
    lr: float = 2e-3
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: Optional[int] = None  # None: --lr-warmup-fraction of the decay iters
    lr_warmup_fraction: Optional[float] = None  # None (and no iters): 0.1
    lr_decay_iters: Optional[int] = None  # None: train_iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # fp16: static scale; None: dynamic
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    seed: int = 1234
    eval_interval: int = 50
    eval_iters: int = 5
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None  # None: only at the end when --save is given
    exit_interval: Optional[int] = None  # stop (and save) after this iteration
    exit_duration_in_mins: Optional[float] = None  # save and stop before this wall time
    exit_signal_handler: bool = False  # SIGTERM/SIGUSR1: finish the step, save, exit 0
    keep_last: Optional[int] = None  # committed checkpoints kept; None: all
    async_save: bool = False  # write checkpoints in a background thread
    no_load_optim: bool = False
    no_load_rng: bool = False
    check_for_nan_in_loss_and_grad: bool = True  # skip a step whose loss or grad norm is not finite
    max_consecutive_skipped: int = 10  # stop after this many skipped steps in a row; 0: never
    deterministic: bool = False  # CUDA: deterministic kernels (CPU is deterministic anyway)
    generate: int = 0  # tokens sampled from the trained model at the end; 0: off
    generate_prompt: str = ""
    generate_temperature: float = 0.8
    generate_top_k: int = 40


@dataclass
class LogConfig:
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None
    metrics_jsonl: Optional[str] = None
    peak_tflops: Optional[float] = None  # per device; None: table (GPU) or measured (CPU)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False  # Megatron-style SP inside the tp group
    ds_sequence_parallel_size: int = 1  # Ulysses degree U
    context_parallel_size: int = 1  # ring attention degree C (sequence degree U * C)
    pipeline_model_parallel_size: int = 1
    pipeline_schedule: Optional[str] = None  # None: 1f1b, or interleaved-1f1b with virtual stages
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    zero_stage: int = 0  # ZeRO over dp x sp: 1 optimizer states, 2 + grads, 3 + params
    grad_reduce_dtype: str = "fp32"  # dtype gradients are summed in over dp x sp
    distributed_timeout_minutes: float = 10.0  # a collective waiting longer fails the job


@dataclass
class MemoryConfig:
    """Activation memory: recomputation (Megatron-LM's flags) and tiling."""
    recompute_granularity: Optional[str] = None  # None | full | selective
    recompute_method: Optional[str] = None  # full only: uniform | block (default uniform)
    recompute_num_layers: Optional[int] = None  # full only: layers per group / recomputed
    tiled_mlp_chunks: int = 1  # the MLP over the local sequence in N chunks, recomputed
    dry_run: bool = False  # validate, print the memory plan, exit 0 without training
    dry_run_world_size: Optional[int] = None  # the grid's world for --dry-run on one process
    dry_run_device: Optional[str] = None  # the device --dry-run plans for (None: this one's)
    dry_run_gpu: Optional[str] = None  # --dry-run checks the plan fits this GPU (planner table)


@dataclass
class Config:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    log: LogConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are ConfigErrors: one line naming the flag, exit 2, printed by
    rank 0 only."""

    def error(self, message):
        if message.startswith("argument ") and ": " in message:
            flag, rule = message[len("argument "):].split(": ", 1)
            raise ConfigError(flag.split("/")[0], rule)
        if message.startswith("unrecognized arguments: "):
            first = message.split(": ", 1)[1].split()[0]
            raise ConfigError(first, "unrecognized argument" + self._did_you_mean(first))
        raise ConfigError("pretrain_gpt.py", message)

    def _did_you_mean(self, word: str) -> str:
        if not word.startswith("--"):
            return " (pretrain_gpt.py takes flags only)"
        names = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        # Abbreviations are refused (as in Megatron-LM): name the flags it abbreviates.
        close = [n for n in names if n.startswith(word)] or difflib.get_close_matches(
            word, names, n=3, cutoff=0.7)
        return f"; did you mean {' or '.join(close)}?" if close else ""

    def _parse_optional(self, arg_string):
        # argparse reads "-inf", "-1e-3" as unknown options (its negative-number test knows
        # only forms like -1 and -.5); as values they reach the flag's own check, which
        # names the flag.
        if _is_number(arg_string):
            return None
        return super()._parse_optional(arg_string)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, said once: " (default: X)" is appended
    unless the text already says it in words (e.g. "default: 4*hidden"); switches show
    on/off, and None shows as "none"."""

    def _get_help_string(self, action):
        # Python < 3.12 has BooleanOptionalAction add its own "(default: ...)": ours instead.
        text = (action.help or "").removesuffix(" (default: %(default)s)")
        if action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.nargs == 0:  # a switch: store_true/false/const, --x/--no-x
            given = action.default not in (None, False) and (
                isinstance(action, argparse.BooleanOptionalAction)
                or action.default == getattr(action, "const", object()))
            return f"{text} (default: {'on' if given else 'off'})"
        if action.default is None:
            return f"{text} (default: none)"
        return text + " (default: %(default)s)"


def positive_int(name):
    """argparse type: an integer > 0 (`name` is the flag, for callers' readability)."""
    def check(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
        return v
    return check


def finite_float(text: str) -> float:
    """argparse type: a finite number. nan and inf pass every `x > 0` check and then poison
    a run (an inf learning rate or epsilon trains NaNs), so no flag takes them."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def _relative(path: str) -> str:
    """A bundled file as the help shows it: relative to the checkout."""
    return os.path.relpath(path, REPO_ROOT)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False as in Megatron-LM: "--hidden 64" is an error, not --hidden-size.
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT (Megatron-LM flag names). "
                "Without any flag: the bundled default run (small Llama-style model on the "
                "Shakespeare corpus in data/).", formatter_class=_HelpFormatter,
                allow_abbrev=False)
    m, d, t, lg = ModelConfig(), DataConfig(), TrainConfig(), LogConfig()
    par, mem = ParallelConfig(), MemoryConfig()
    pos, num = positive_int, finite_float

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=pos("--num-layers"), default=m.num_layers,
                   help="transformer layers")
    g.add_argument("--hidden-size", type=pos("--hidden-size"), default=m.hidden_size,
                   help="model width")
    g.add_argument("--ffn-hidden-size", type=pos("--ffn-hidden-size"), default=None,
                   help="MLP width; default: 4*hidden, or 8*hidden/3 rounded up to 64 with "
                        "--swiglu")
    g.add_argument("--num-attention-heads", type=pos("--num-attention-heads"),
                   default=m.num_attention_heads, help="query heads")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention: --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=pos("--num-query-groups"), default=None,
                   help="key/value heads under --group-query-attention; default: 1 with it "
                        "(multi-query), else one per attention head")
    g.add_argument("--kv-channels", type=pos("--kv-channels"), default=None,
                   help="head dimension; default: hidden / heads")
    g.add_argument("--seq-length", type=pos("--seq-length"), default=m.seq_length,
                   help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=pos("--max-position-embeddings"),
                   default=None, help="longest sequence the positions cover; default: "
                                      "--seq-length")
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"),
                   default=m.position_embedding_type,
                   help="rotary (RoPE) or learned absolute (GPT-2) positions")
    g.add_argument("--rotary-base", type=num, default=m.rotary_base,
                   help="RoPE base frequency (theta)")
    g.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default=m.normalization,
                   help="the norm before attention, before the MLP and at the end")
    g.add_argument("--norm-epsilon", type=num, default=m.norm_epsilon,
                   help="epsilon of the norms")
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=m.swiglu,
                   help="SwiGLU MLP; --no-swiglu: GeLU")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   default=m.add_bias_linear,
                   help="no biases in the linear layers, as by default (Megatron-LM's "
                        "flag; --add-bias-linear adds them)")
    g.add_argument("--add-bias-linear", dest="add_bias_linear", action="store_true",
                   help="biases in the linear layers (GPT-2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own instead of the input embedding's weights")
    g.add_argument("--hidden-dropout", type=num, default=m.hidden_dropout,
                   help="dropout after attention and MLP, in [0, 1)")
    g.add_argument("--attention-dropout", type=num, default=m.attention_dropout,
                   help="dropout of the attention probabilities, in [0, 1)")
    g.add_argument("--init-method-std", type=num, default=m.init_method_std,
                   help="standard deviation of the initial weights")
    g.add_argument("--make-vocab-size-divisible-by", type=pos("--make-vocab-size-divisible-by"),
                   default=m.make_vocab_size_divisible_by,
                   help="pad the vocabulary to a multiple of this")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=m.attention_backend,
                   help="auto: flash_attn (CUDA, 16-bit) where installed and the mask allows, "
                        "flex for other masks on CUDA, SDPA; on CPU the block kernels")

    g = p.add_argument_group("attention mask (causal always; these narrow it)")
    g.add_argument("--window-size", type=pos("--window-size"), default=None,
                   help="sliding window: each token attends the last W tokens, itself "
                        "included (Mistral-style); only blocks inside it are computed; "
                        "default: none (full causal)")
    g.add_argument("--attention-sparsity", choices=ATTENTION_SPARSITIES,
                   default=m.attention_sparsity,
                   help="block-sparse layout: fixed (DeepSpeed / Sparse Transformer "
                        "local windows + summary blocks) or bigbird (local + global + "
                        "seeded random blocks); only attended blocks are computed")
    g.add_argument("--sparse-block-size", type=pos("--sparse-block-size"),
                   default=m.sparse_block_size, help="tokens per sparse block")
    g.add_argument("--sparse-local-blocks", type=pos("--sparse-local-blocks"),
                   default=m.sparse_local_blocks,
                   help="fixed: blocks per local window; bigbird: sliding window in blocks")
    g.add_argument("--sparse-global-blocks", type=int, default=m.sparse_global_blocks,
                   help="fixed: summary blocks at the end of each window; bigbird: the "
                        "first blocks, attended by all")
    g.add_argument("--sparse-random-blocks", type=int, default=m.sparse_random_blocks,
                   help="bigbird: random earlier blocks per query block")
    g.add_argument("--sparse-seed", type=int, default=m.sparse_seed,
                   help="bigbird: seed of the random blocks")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=d.data_path,
                   help="PREFIX, PREFIX PREFIX... (equal weights), or W1 PREFIX1 W2 PREFIX2 "
                        "... of .bin/.idx pairs; default: "
                        f"{_relative(BUNDLED_DATA)} (the bundled corpus)")
    g.add_argument("--split", default=d.split,
                   help="train,valid,test weights over the documents, e.g. 98,2,0")
    g.add_argument("--mock-data", action="store_true",
                   help="random tokens instead of --data-path (benchmarks, tests)")
    g.add_argument("--data-cache-path", default=None,
                   help="where the sample indices are cached; default: <first data "
                        "prefix>_cache")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=d.tokenizer_type,
                   help="NullTokenizer: token ids as they are, with --vocab-size")
    g.add_argument("--tokenizer-model", default=d.tokenizer_model,
                   help="the SentencePiece model file; default: "
                        f"{_relative(BUNDLED_TOKENIZER)} (the bundled one)")
    g.add_argument("--vocab-size", type=pos("--vocab-size"), default=None,
                   help="NullTokenizer: ids are below this (the end-of-document id is this "
                        "one); other tokenizers set the vocabulary themselves")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the end-of-document token")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions restart at 0 after every end-of-document token")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="packed documents: tokens attend within their own document only")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=pos("--micro-batch-size"),
                   default=t.micro_batch_size, help="samples per forward/backward on a rank")
    g.add_argument("--global-batch-size", type=pos("--global-batch-size"),
                   default=t.global_batch_size,
                   help="samples per iteration over all data-parallel ranks (default: "
                        "--micro-batch-size x dp, x pp under a pipeline: no accumulation)")
    g.add_argument("--train-iters", type=pos("--train-iters"), default=t.train_iters,
                   help="iterations (optimizer steps) to train")
    g.add_argument("--lr", type=num, default=t.lr, help="peak learning rate")
    g.add_argument("--min-lr", type=num, default=t.min_lr,
                   help="learning rate at the end of the decay, in [0, --lr]")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default=t.lr_decay_style,
                   help="from --lr down to --min-lr after the warmup")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="iterations of linear warmup; default: --lr-warmup-fraction")
    g.add_argument("--lr-warmup-fraction", type=num, default=None,
                   help="warmup as a fraction of the decay iterations; default 0.1 when "
                        "--lr-warmup-iters is not given")
    g.add_argument("--lr-decay-iters", type=pos("--lr-decay-iters"), default=None,
                   help="iterations over which the learning rate decays (warmup "
                        "included); default: --train-iters")
    g.add_argument("--weight-decay", type=num, default=t.weight_decay,
                   help="AdamW weight decay (not on biases and norms)")
    g.add_argument("--adam-beta1", type=num, default=t.adam_beta1, help="AdamW beta1, in [0, 1)")
    g.add_argument("--adam-beta2", type=num, default=t.adam_beta2, help="AdamW beta2, in [0, 1)")
    g.add_argument("--adam-eps", type=num, default=t.adam_eps, help="AdamW epsilon, > 0")
    g.add_argument("--clip-grad", type=num, default=t.clip_grad,
                   help="clip the global gradient norm to this; 0 disables clipping")
    g.add_argument("--bf16", action="store_true", help="bfloat16 autocast (fp32 weights)")
    g.add_argument("--fp16", action="store_true",
                   help="float16 autocast (fp32 weights) with loss scaling")
    g.add_argument("--loss-scale", type=num, default=None,
                   help="--fp16: a static loss scale; default: none (dynamic scaling)")
    g.add_argument("--initial-loss-scale", type=num, default=t.initial_loss_scale,
                   help="--fp16 dynamic scaling: the scale to start from")
    g.add_argument("--min-loss-scale", type=num, default=t.min_loss_scale,
                   help="--fp16 dynamic scaling: the scale never falls below this")
    g.add_argument("--loss-scale-window", type=pos("--loss-scale-window"),
                   default=t.loss_scale_window,
                   help="--fp16 dynamic scaling: steps without overflow before the scale "
                        "doubles")
    g.add_argument("--hysteresis", type=pos("--hysteresis"), default=t.hysteresis,
                   help="--fp16 dynamic scaling: overflows tolerated before the scale halves")
    g.add_argument("--seed", type=int, default=t.seed,
                   help="seed of the initial weights, data order, dropout and sampling")
    g.add_argument("--eval-interval", type=pos("--eval-interval"), default=t.eval_interval,
                   help="evaluate on the valid split every this many iterations")
    g.add_argument("--eval-iters", type=int, default=t.eval_iters,
                   help="global batches per evaluation; 0 disables evaluation")
    g.add_argument("--save", default=None, help="checkpoint directory to save to")
    g.add_argument("--load", default=None,
                   help="checkpoint directory (or iter_XXXXXXX directory) to resume from")
    g.add_argument("--save-interval", type=pos("--save-interval"), default=None,
                   help="with --save: save every this many iterations; default: at the "
                        "end only")
    g.add_argument("--exit-interval", type=pos("--exit-interval"), default=None,
                   help="stop after the first iteration divisible by this (saving with --save)")
    g.add_argument("--exit-duration-in-mins", type=num, default=None,
                   help="save (with --save) and stop once the run has lasted this long")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction,
                   default=None, help="on SIGTERM or SIGUSR1 every rank finishes the current "
                   "step, saves (with --save) and exits 0; default: on under SLURM")
    g.add_argument("--keep-last", type=pos("--keep-last"), default=None,
                   help="keep only the newest N committed checkpoints (default: all)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread while training goes on")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load only the model (and RNG) from --load: a fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true",
                   help="do not restore the RNG states saved in --load")
    g.add_argument("--generate", type=int, default=t.generate,
                   help="sample this many tokens from the trained model at the end; 0: off "
                        "(the run without flags samples 200)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction,
                   default=t.check_for_nan_in_loss_and_grad,
                   help="a non-finite loss or gradient norm on any rank skips the step on "
                        "every rank (counted as skipped); off: the step is taken anyway")
    g.add_argument("--max-consecutive-skipped", type=int, default=t.max_consecutive_skipped,
                   help="stop with an error after this many skipped steps in a row, leaving "
                        "the last checkpoint as it was (0: never; with --fp16 dynamic loss "
                        "scaling, skips while the scale can still fall do not count)")
    g.add_argument("--deterministic", action="store_true",
                   help="CUDA: deterministic kernels only (docs/determinism.md says what "
                        "it switches on and costs); CPU runs are bit-identical without it")
    g.add_argument("--generate-prompt", default=t.generate_prompt,
                   help="--generate: the text the sample continues (default: empty, from "
                        "the end-of-document token)")
    g.add_argument("--generate-temperature", type=num, default=t.generate_temperature,
                   help="--generate: softmax temperature, > 0")
    g.add_argument("--generate-top-k", type=int, default=t.generate_top_k,
                   help="--generate: sample among the k likeliest tokens; 0: all")

    g = p.add_argument_group("parallelism (data-parallel size = world / (tp*pp*sp*cp))")
    g.add_argument("--tensor-model-parallel-size", type=pos("--tensor-model-parallel-size"),
                   default=par.tensor_model_parallel_size,
                   help="tensor-parallel degree tp (Megatron column/row-parallel layers)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron-style sequence parallelism inside the tensor-parallel group")
    g.add_argument("--ds-sequence-parallel-size", "--ulysses-degree",
                   dest="ds_sequence_parallel_size",
                   type=pos("--ds-sequence-parallel-size"), default=par.ds_sequence_parallel_size,
                   help="Ulysses sequence-parallel degree U (all-to-all; heads / tp / U "
                        "heads per rank)")
    g.add_argument("--context-parallel-size", type=pos("--context-parallel-size"),
                   default=par.context_parallel_size,
                   help="ring attention degree C over groups of U Ulysses ranks (sequence "
                        "degree U * C; zigzag chunks for causal balance)")
    g.add_argument("--pipeline-model-parallel-size", type=pos("--pipeline-model-parallel-size"),
                   default=par.pipeline_model_parallel_size,
                   help="pipeline stages (layers split into consecutive blocks)")
    g.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default=None,
                   help="the order of micro-batch forwards and backwards over the stages; "
                        "default: 1f1b, or interleaved-1f1b with "
                        "--num-layers-per-virtual-pipeline-stage")
    g.add_argument("--num-layers-per-virtual-pipeline-stage",
                   type=pos("--num-layers-per-virtual-pipeline-stage"), default=None,
                   help="layers per model chunk; each pipeline rank then holds "
                        "layers / (pp * this) chunks (interleaved schedules)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first stage (uneven split; the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last stage (uneven split; the rest evenly)")
    g.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=par.zero_stage,
                   help="ZeRO over the data x sequence-parallel ranks: 1 shards optimizer "
                        "states, 2 also gradients, 3 also parameters (see README)")
    g.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES,
                   default=par.grad_reduce_dtype,
                   help="dtype in which gradients are summed over the data x sequence-"
                        "parallel ranks")
    g.add_argument("--distributed-timeout-minutes", type=num,
                   default=par.distributed_timeout_minutes,
                   help="a collective that waits longer than this (a rank died or hangs) "
                        "fails, and every rank exits non-zero naming the rank(s) it lost")

    g = p.add_argument_group("activation memory (recomputation, tiling) and the memory plan")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="full: recompute whole transformer blocks in backward (only their "
                        "inputs are kept; the forward all-to-alls run again); selective: "
                        "recompute only the attention core (between the all-to-alls); "
                        "default: none (no recomputation)")
    g.add_argument("--recompute-activations", dest="recompute_granularity",
                   action="store_const", const="selective",
                   help="= --recompute-granularity selective")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="with --recompute-granularity full: uniform checkpoints groups of "
                        "--recompute-num-layers consecutive layers; block checkpoints the "
                        "first --recompute-num-layers layers of each pipeline stage and "
                        "keeps the rest's activations (default uniform)")
    g.add_argument("--recompute-num-layers", type=pos("--recompute-num-layers"), default=None,
                   help="with --recompute-granularity full: see --recompute-method "
                        "(default 1)")
    g.add_argument("--tiled-mlp-chunks", type=pos("--tiled-mlp-chunks"),
                   default=mem.tiled_mlp_chunks,
                   help="run each MLP over the local sequence in this many chunks, "
                        "recomputed in backward: its [tokens, ffn] intermediates exist for "
                        "one chunk at a time")
    g.add_argument("--dry-run", action="store_true",
                   help="validate every flag, build the model on the meta device, print "
                        "the per-rank memory plan and communication bytes, exit 0 without "
                        "allocating the model or training")
    g.add_argument("--dry-run-world-size", type=pos("--dry-run-world-size"), default=None,
                   help="with --dry-run on one process: the number of ranks of the grid to "
                        "plan for (default: WORLD_SIZE, or 1)")
    g.add_argument("--dry-run-device", choices=["cpu", "cuda"], default=None,
                   help="with --dry-run: the device to plan for; it picks the attention "
                        "kernel and the loss's chunks (default: cuda if available, else cpu)")
    g.add_argument("--dry-run-gpu", type=_gpu_name, default=None,
                   help="with --dry-run: plan for cuda and exit 2 unless every stage fits "
                        "this GPU (A100-40GB, A100-80GB, H100, H200: tools/plan.py's table) "
                        "less 4 GiB reserved for the CUDA context, NCCL and fragmentation")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=pos("--log-interval"), default=lg.log_interval,
                   help="log (and write --metrics-jsonl) every this many iterations")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars here")
    g.add_argument("--metrics-jsonl", default=None,
                   help="write one JSON record per logged iteration and evaluation here")
    g.add_argument("--peak-tflops", type=num, default=None,
                   help="peak TFLOP/s per device for MFU; default: known GPU table, or a "
                        "matmul measured at start-up on CPU")
    return p


def _gpu_name(text: str) -> str:
    """argparse type: a GPU of the planner's table (megaulysses/hardware.py)."""
    from megaulysses.hardware import UnknownGPU, gpu_spec
    try:
        return gpu_spec(text).name
    except UnknownGPU as e:
        raise argparse.ArgumentTypeError(str(e))


def _pick(cls, ns):
    return cls(**{k: getattr(ns, k) for k in cls.__dataclass_fields__ if hasattr(ns, k)})


def parse_args(argv=None) -> Config:
    ns = build_parser().parse_args(argv)
    if ns.num_query_groups is not None and not ns.group_query_attention:
        raise ConfigError("--num-query-groups", "needs --group-query-attention")
    if ns.group_query_attention and ns.num_query_groups is None:
        ns.num_query_groups = 1  # Megatron's default: multi-query attention
    cfg = Config(model=_pick(ModelConfig, ns), data=_pick(DataConfig, ns),
                 train=_pick(TrainConfig, ns), log=_pick(LogConfig, ns),
                 parallel=_pick(ParallelConfig, ns), memory=_pick(MemoryConfig, ns))
    validate(cfg)
    return cfg


def _require(ok: bool, flag: str, rule: str):
    if not ok:
        raise ConfigError(flag, rule)


def validate(cfg: Config):
    """Every cross-flag rule. Files are checked later, where they are opened."""
    _validate_model(cfg.model)
    _validate_attention_mask(cfg.model)
    _validate_train(cfg.train, cfg.model)
    _validate_data(cfg.data)
    _require(cfg.log.peak_tflops is None or cfg.log.peak_tflops > 0, "--peak-tflops",
             f"must be > 0, got {cfg.log.peak_tflops}")
    _validate_pipeline(cfg.parallel)
    backend = cfg.model.attention_backend
    # Needs no device, so --dry-run refuses it too (the trainer checks the rest: which
    # backend this device runs, for the mask).
    _require(cfg.parallel.context_parallel_size == 1 or backend in ("auto", "block"),
             "--attention-backend", f"{backend}: ring attention (--context-parallel-size > 1) "
             "runs its own block kernel; use auto or block")
    timeout = cfg.parallel.distributed_timeout_minutes
    _require(math.isfinite(timeout) and timeout > 0, "--distributed-timeout-minutes",
             f"must be > 0, got {timeout}")
    layout = pipeline_layout(cfg.model.num_layers, cfg.parallel)  # raises if it does not fit
    _validate_memory(cfg.memory, layout)


def _validate_model(m: ModelConfig):
    if m.kv_channels is None:
        _require(m.hidden_size % m.num_attention_heads == 0, "--hidden-size",
                 f"must be divisible by --num-attention-heads "
                 f"({m.hidden_size} % {m.num_attention_heads} != 0)")
    # More groups than heads first: the divisibility rule below would blame the heads.
    _require(m.num_kv_heads <= m.num_attention_heads, "--num-query-groups",
             f"must be <= --num-attention-heads ({m.num_kv_heads} > {m.num_attention_heads})")
    _require(m.num_attention_heads % m.num_kv_heads == 0, "--num-attention-heads",
             f"must be divisible by --num-query-groups "
             f"({m.num_attention_heads} % {m.num_kv_heads} != 0)")
    if m.position_embedding_type == "rope":
        # Name the flag the user gave: the head dimension is --kv-channels or hidden/heads.
        _require(m.head_dim % 2 == 0, "--kv-channels" if m.kv_channels else "--hidden-size",
                 f"rope needs an even head dimension, got {m.head_dim}" + (
                     "" if m.kv_channels else f" = {m.hidden_size} / {m.num_attention_heads} "
                     "heads (or set --kv-channels)"))
        _require(m.rotary_base > 0, "--rotary-base", f"must be > 0, got {m.rotary_base}")
    _require(m.seq_length <= m.max_positions, "--seq-length",
             f"must be <= --max-position-embeddings ({m.seq_length} > {m.max_positions})")
    for flag, p in (("--hidden-dropout", m.hidden_dropout),
                    ("--attention-dropout", m.attention_dropout)):
        _require(0.0 <= p < 1.0, flag, f"must be in [0, 1), got {p}")
    _require(m.norm_epsilon > 0, "--norm-epsilon", f"must be > 0, got {m.norm_epsilon}")
    _require(m.init_method_std > 0, "--init-method-std", f"must be > 0, got {m.init_method_std}")


def _validate_attention_mask(m: ModelConfig):
    """The mask's own rules; which backend runs it, and the sequence slices each rank sees,
    are checked where the device and the grid are known (attention.select_backend,
    ParallelDims.validate)."""
    if m.attention_sparsity == "dense":
        return
    flag = "--sparse-block-size"
    _require(m.seq_length % m.sparse_block_size == 0, flag,
             f"{m.sparse_block_size} must divide --seq-length {m.seq_length}")
    _require(m.sparse_global_blocks >= 0, "--sparse-global-blocks",
             f"must be >= 0, got {m.sparse_global_blocks}")
    _require(m.sparse_random_blocks >= 0, "--sparse-random-blocks",
             f"must be >= 0, got {m.sparse_random_blocks}")
    if m.attention_sparsity == "fixed":
        _require(m.sparse_global_blocks <= m.sparse_local_blocks, "--sparse-global-blocks",
                 f"{m.sparse_global_blocks} summary blocks do not fit in a window of "
                 f"--sparse-local-blocks {m.sparse_local_blocks}")


def _validate_train(t: TrainConfig, m: ModelConfig):
    gbs = t.global_batch_size
    _require(gbs is None or gbs % t.micro_batch_size == 0, "--global-batch-size",
             f"must be divisible by --micro-batch-size ({gbs} % {t.micro_batch_size} != 0)")
    _require(not (t.bf16 and t.fp16), "--bf16", "cannot be combined with --fp16")
    _require(t.lr >= 0, "--lr", f"must be >= 0, got {t.lr}")
    _require(0 <= t.min_lr <= t.lr, "--min-lr", f"must be in [0, --lr], got {t.min_lr}")
    _require(t.lr_warmup_iters is None or t.lr_warmup_fraction is None, "--lr-warmup-fraction",
             "cannot be combined with --lr-warmup-iters")
    decay = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_iters is None:
        frac = 0.1 if t.lr_warmup_fraction is None else t.lr_warmup_fraction
        _require(0 <= frac <= 1, "--lr-warmup-fraction", f"must be in [0, 1], got {frac}")
        t.lr_warmup_iters = int(frac * decay)
        t.lr_warmup_fraction = None  # resolved into lr_warmup_iters, the one the code reads
    _require(0 <= t.lr_warmup_iters <= decay, "--lr-warmup-iters",
             f"must be in [0, --lr-decay-iters or --train-iters = {decay}], "
             f"got {t.lr_warmup_iters}")
    _require(t.weight_decay >= 0, "--weight-decay", f"must be >= 0, got {t.weight_decay}")
    for flag, beta in (("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)):
        _require(0 <= beta < 1, flag, f"must be in [0, 1), got {beta}")  # else AdamW raises
    _require(t.adam_eps > 0, "--adam-eps", f"must be > 0, got {t.adam_eps}")
    _require(t.clip_grad >= 0, "--clip-grad", f"must be >= 0, got {t.clip_grad}")
    _require(t.eval_iters >= 0, "--eval-iters", f"must be >= 0, got {t.eval_iters}")
    _require(t.generate >= 0, "--generate", f"must be >= 0, got {t.generate}")
    _require(t.max_consecutive_skipped >= 0, "--max-consecutive-skipped",
             f"must be >= 0, got {t.max_consecutive_skipped}")
    _require(t.generate_temperature > 0, "--generate-temperature",
             f"must be > 0, got {t.generate_temperature}")
    _require(t.generate_top_k >= 0, "--generate-top-k",
             f"must be >= 0 (0: all tokens), got {t.generate_top_k}")
    _require(t.loss_scale is None or t.loss_scale > 0, "--loss-scale",
             f"must be > 0, got {t.loss_scale}")
    _require(t.min_loss_scale > 0, "--min-loss-scale", f"must be > 0, got {t.min_loss_scale}")
    _require(t.initial_loss_scale >= t.min_loss_scale, "--initial-loss-scale",
             f"must be >= --min-loss-scale ({t.initial_loss_scale} < {t.min_loss_scale})")
    for flag, value in (("--save-interval", t.save_interval), ("--keep-last", t.keep_last),
                        ("--async-save", t.async_save)):
        _require(not value or t.save is not None, flag, "needs --save DIR")
    _require(t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
             "--exit-duration-in-mins", f"must be > 0, got {t.exit_duration_in_mins}")
    if t.exit_signal_handler is None:  # SLURM sends SIGTERM before it kills a job
        t.exit_signal_handler = "SLURM_JOB_ID" in os.environ


def _validate_pipeline(par: ParallelConfig):
    pp, vl = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    uneven = (par.decoder_first_pipeline_num_layers is not None
              or par.decoder_last_pipeline_num_layers is not None)
    if par.pipeline_schedule is None:
        par.pipeline_schedule = "interleaved-1f1b" if vl else "1f1b"
    if pp == 1:
        _require(vl is None and not uneven, "--pipeline-model-parallel-size",
                 "virtual stages and uneven stage splits need --pipeline-model-parallel-size > 1")
        return
    if par.pipeline_schedule in ("1f1b", "gpipe"):
        _require(vl is None, "--num-layers-per-virtual-pipeline-stage",
                 f"--pipeline-schedule {par.pipeline_schedule} runs one stage per rank; use "
                 "interleaved-1f1b or zero-bubble with virtual stages")
    if par.pipeline_schedule == "interleaved-1f1b":
        _require(vl is not None, "--pipeline-schedule",
                 "interleaved-1f1b needs --num-layers-per-virtual-pipeline-stage")
    _require(not (uneven and vl), "--decoder-first-pipeline-num-layers",
             "uneven stage splits cannot be combined with "
             "--num-layers-per-virtual-pipeline-stage")


def _validate_memory(mem: MemoryConfig, layout: list[list[int]]):
    """Recompute flags (Megatron-LM's rules). The tiled MLP's rule needs the grid: it is
    checked in ParallelDims.validate."""
    _require(mem.dry_run_world_size is None or mem.dry_run, "--dry-run-world-size",
             "needs --dry-run")
    _require(mem.dry_run_device is None or mem.dry_run, "--dry-run-device", "needs --dry-run")
    _require(mem.dry_run_gpu is None or mem.dry_run, "--dry-run-gpu", "needs --dry-run")
    _require(mem.dry_run_gpu is None or mem.dry_run_device != "cpu", "--dry-run-gpu",
             "plans for cuda; drop --dry-run-device cpu")
    full = mem.recompute_granularity == "full"
    for flag, value in (("--recompute-method", mem.recompute_method),
                        ("--recompute-num-layers", mem.recompute_num_layers)):
        _require(value is None or full, flag, "needs --recompute-granularity full "
                 f"(got {mem.recompute_granularity or 'no recomputation'})")
    if not full:
        return
    mem.recompute_method = mem.recompute_method or "uniform"
    mem.recompute_num_layers = mem.recompute_num_layers or 1
    fewest = min(len(stage) for stage in layout if stage)
    _require(mem.recompute_num_layers <= fewest, "--recompute-num-layers",
             f"{mem.recompute_num_layers} is more than the {fewest} layers of a pipeline "
             "stage (it counts layers per stage)")


def pipeline_layout(num_layers: int, par: ParallelConfig) -> list[list[int]]:
    """Layer indices of each pipeline stage, stage 0 first (pp * virtual stages in all).

    Stage s runs on pipeline rank s % pp (the loop order of the interleaved schedules), so
    with v virtual stages rank r holds stages r, r + pp, ... Even split by default; with
    --decoder-first/last-pipeline-num-layers those stages get what they ask for and the
    stages between share the rest evenly. Raises ConfigError when it does not divide.
    """
    pp, vl = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    if vl is not None:
        _require(num_layers % (pp * vl) == 0, "--num-layers-per-virtual-pipeline-stage",
                 f"--num-layers {num_layers} must be divisible by pp * "
                 f"{vl} layers per virtual stage = {pp * vl}")
        sizes = [vl] * (num_layers // vl)
    elif first is None and last is None:
        _require(num_layers % pp == 0, "--pipeline-model-parallel-size",
                 f"--num-layers {num_layers} must be divisible by the {pp} pipeline stages "
                 "(or set --decoder-first/last-pipeline-num-layers)")
        sizes = [num_layers // pp] * pp
    else:
        sizes = _uneven_sizes(num_layers, pp, first, last)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]


def _uneven_sizes(num_layers: int, pp: int, first: Optional[int], last: Optional[int]):
    for flag, n in (("--decoder-first-pipeline-num-layers", first),
                    ("--decoder-last-pipeline-num-layers", last)):
        _require(n is None or 0 <= n <= num_layers, flag,
                 f"must be in [0, --num-layers {num_layers}], got {n}")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle == 0:
        _require(rest == 0, "--decoder-first-pipeline-num-layers",
                 f"with {pp} stages the first and last stage must hold all {num_layers} "
                 f"layers, got {first} + {last}")
        return [first, last]
    _require(rest >= middle and rest % middle == 0, "--decoder-first-pipeline-num-layers",
             f"the {rest} layers left after the first/last stage must split evenly, at least "
             f"one each, over the other {middle} stages")
    each = rest // middle
    return ([first] if first is not None else []) + [each] * middle + (
        [last] if last is not None else [])


def _validate_data(d: DataConfig):
    """The flags' own syntax; the files are checked where they are opened (data/build.py).
    Checked here too so that --dry-run, which opens no data, refuses what training would."""
    from megaulysses.data.gpt_dataset import parse_data_path, parse_split  # numpy, no torch
    try:
        weights = parse_split(d.split)
    except ValueError as e:
        raise ConfigError("--split", str(e).removeprefix("--split:").strip()) from None
    _require(weights[0] > 0, "--split", f"the train split must not be empty, got {d.split}")
    if not d.mock_data:
        try:
            parse_data_path(d.data_path)
        except ValueError as e:
            raise ConfigError("--data-path", str(e).removeprefix("--data-path:").strip()) from None
    if d.tokenizer_type == "NullTokenizer":
        _require(d.vocab_size is not None, "--vocab-size", "required with NullTokenizer")
    else:  # mock data too: the tokenizer sets the vocabulary
        _require(d.tokenizer_model is not None, "--tokenizer-model",
                 f"required with {d.tokenizer_type}")
