"""The run's settings: plain frozen dataclasses, each field declared once with its flag.

A field's metadata (`option(...)`) says everything the command line needs: the flag, its
help, how its value is checked (`kind`), its choices, any extra flags that set it, and room
for Megatron-LM's name and aliases. `cli.build_parser()` is generated from these fields, so
a default is written in one place only. Values that depend on other flags, the world size
or the tokenizer are left None here and filled by `resolve()`.

Defaults are Megatron-LM's (megatron/training/arguments.py at the commit named in
megatron.py, which tests/test_megatron_defaults.py holds them against), so a Megatron-LM
script builds here the model it builds there: a GPT-2 style model (learned absolute
positions, LayerNorm, GeLU, biases, dropout 0.1). Where Megatron-LM has no default (it
requires the flag: sizes, batch, iterations, learning rate, tokenizer) ours is the bundled
run's value. With no --data-path or --mock-data the run is the bundled one, a small
Llama-style model on the Shakespeare corpus in `data/`: presets.SHAKESPEARE, applied in
place of the defaults for every flag not given. The start-up log prints every setting.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from megaulysses.config.compat import MEGATRON_ATTENTION, CompatConfig
from megaulysses.config.fields import Flag, derived, option
from megaulysses.config.groups import (COMPAT, DATA, LOGGING, MASK, MEMORY, MODEL, PARALLEL,
                                       TRAINING)
from megaulysses.config.schema_rope import RopeScalingConfig
from megaulysses.config.schema_run import LogConfig, MemoryConfig, ParallelConfig
from megaulysses.config.schema_train import LR_DECAY_STYLES, TrainConfig  # noqa: F401

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_DATA = os.path.join(REPO_ROOT, "data", "shakespeare_text_document")
BUNDLED_TOKENIZER = os.path.join(REPO_ROOT, "data", "shakespeare_tok.model")

# The attention backends: model/attention BACKENDS (not imported: the schema needs no torch).
ATTENTION_BACKENDS = ("auto", "math", "block", "sdpa", "flash", "flex")
ATTENTION_SPARSITIES = ("dense", "fixed", "bigbird")
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")

# What the attention may see: not part of a checkpoint's shape (any mask loads any weights).
def megatron_window(left: int, right: int) -> Optional[int]:
    """Our --window-size W of Megatron-LM's window_size (left, right): query i attends keys
    i-left..i+right, -1 meaning no bound. ValueError where it is not a causal window."""
    if right != 0:
        raise ValueError(f"({left}, {right}) attends {right} later tokens: only causal "
                         "windows (right side 0) are trained here")
    if left < -1:
        raise ValueError(f"({left}, {right}): the left side must be >= 0, or -1 (no window)")
    return None if left == -1 else left + 1


MASK_FIELDS = ("window_size", "attention_sparsity", "sparse_block_size", "sparse_local_blocks",
               "sparse_global_blocks", "sparse_random_blocks", "sparse_seed")



def _relative(path: str) -> str:
    """A bundled file as the help shows it: relative to the checkout."""
    return os.path.relpath(path, REPO_ROOT)


@dataclass(frozen=True)
class ModelConfig(RopeScalingConfig):  # + the RoPE scalings' fields
    num_layers: int = option(6, "transformer layers", kind="positive")
    hidden_size: int = option(384, "model width", kind="positive")
    ffn_hidden_size: Optional[int] = option(
        None, "MLP width; default: 4*hidden, or 8*hidden/3 rounded down to a multiple of 64 "
        "with --swiglu (Megatron-LM's)",
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
        "learned_absolute", "rotary (RoPE) or learned absolute (GPT-2) positions",
        choices=("rope", "learned_absolute"), after=(Flag(
            "= --position-embedding-type rope (Megatron-LM's older spelling)",
            names=("--use-rotary-position-embeddings",), action="store_const", const="rope"),))
    rotary_base: float = option(10000.0, "RoPE base frequency (theta)", kind="number")
    normalization: str = option(
        "LayerNorm", "the norm before attention, before the MLP and at the end",
        choices=("RMSNorm", "LayerNorm"))
    norm_epsilon: float = option(1e-05, "epsilon of the norms", kind="number")
    apply_layernorm_1p: bool = option(
        False, "zero-centered norm weights: each norm (LayerNorm or RMSNorm) stores gamma - 1, "
        "initialized to 0, and scales by weight + 1 (Megatron-LM's)", action="store_true")
    swiglu: bool = option(False, "SwiGLU MLP instead of GeLU", action="optional")
    add_bias_linear: bool = option(
        True, "biases in the linear layers (GPT-2)", action="store_true", before=(Flag(
            "no biases in the linear layers (Llama)", names=("--disable-bias-linear",),
            action="store_false", default=True),))
    bias_gelu_fusion: bool = option(
        True, "the exact (erf) GeLU instead of the tanh approximation that Megatron-LM's fused "
        "bias-GeLU computes (its default); Megatron-LM's GeLU is exact without biases too "
        "(--disable-bias-linear)", names=("--no-bias-gelu-fusion",), action="store_false")
    add_qkv_bias: bool = option(
        False, "biases on the q, k and v projections only (Qwen2), whatever "
        "--disable-bias-linear says of the other linears", action="store_true")
    qk_layernorm: bool = option(
        False, "normalize each head of q and of k (Qwen3) before RoPE: a --normalization of "
        "the head dimension, weights shared by the heads", action="store_true")
    fp32_residual_connection: bool = option(
        False, "keep the residual stream (the embedding's output, every block's input and "
        "output, pipeline transfers, offloaded activations) in fp32 under --bf16/--fp16; "
        "default: in the compute dtype, as Megatron-LM", action="store_true")
    untie_embeddings_and_output_weights: bool = option(
        False, "an output layer of its own instead of the input embedding's weights",
        action="store_true")
    hidden_dropout: float = option(0.1, "dropout after attention and MLP, in [0, 1)", kind="number")
    attention_dropout: float = option(
        0.1, "dropout of the attention probabilities, in [0, 1)", kind="number")
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
        "(Mistral-style); only blocks inside it are computed; Megatron-LM's L,0 (keys L "
        "back to 0 ahead) is W = L+1, its -1,0 no window; default: none (full causal)",
        kind="window", group=MASK)
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
            return 64 * int(8 * self.hidden_size / 3 / 64)  # Megatron-LM's rounding
        return 4 * self.hidden_size

    @property
    def gelu_approximate(self) -> str:
        """The GeLU's math, as Megatron-LM's: "tanh" where its fused bias-GeLU runs (biases
        on, --bias-gelu-fusion, the default), else "none" (torch's exact erf GeLU)."""
        return "tanh" if self.bias_gelu_fusion and self.add_bias_linear else "none"

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
        if self.swiglu:  # no GeLU: the switch means nothing (older checkpoints lack it)
            d.pop("bias_gelu_fusion")
        d.update(ffn_hidden_size=self.ffn_size, num_query_groups=self.num_kv_heads,
                 kv_channels=self.head_dim, max_position_embeddings=self.max_positions,
                 padded_vocab_size=self.padded_vocab_size, **self.rope_shape_dict())
        return d



@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[list] = option(
        None, "PREFIX, PREFIX PREFIX... (equal weights), or W1 PREFIX1 W2 PREFIX2 ... "
        f"of .bin/.idx pairs; default: the bundled run (presets.py) on {_relative(BUNDLED_DATA)}",
        nargs="+")
    split: str = option("969,30,1", "train,valid,test weights over the documents, e.g. 98,2,0")
    mock_data: bool = option(
        False, "random tokens instead of --data-path (benchmarks, tests)", action="store_true")
    data_cache_path: Optional[str] = option(
        None, "where the sample indices are cached; default: <first data prefix>_cache")
    tokenizer_type: str = option(
        "SentencePieceTokenizer", "GPT2BPETokenizer: GPT-2's byte-level BPE, with --vocab-file "
        "and --merge-file; HuggingFaceTokenizer: a Hugging Face tokenizer.json (Llama 3, Qwen, "
        "Mistral, ...) with --tokenizer-model; NullTokenizer: token ids as they are, with "
        "--vocab-size", choices=TOKENIZER_TYPES)
    tokenizer_model: Optional[str] = option(
        BUNDLED_TOKENIZER, "the SentencePiece model file, or for HuggingFaceTokenizer a "
        "directory holding tokenizer.json (a model's, with its tokenizer_config.json) or the "
        f"tokenizer.json file; default: {_relative(BUNDLED_TOKENIZER)} (the bundled one)")
    vocab_file: Optional[str] = option(
        None, "GPT2BPETokenizer: GPT-2's vocab.json (token -> id; its <|endoftext|> ends "
        "documents)")
    merge_file: Optional[str] = option(None, "GPT2BPETokenizer: GPT-2's merges.txt (BPE merges)")
    eod_token_id: Optional[int] = option(
        None, "HuggingFaceTokenizer: the end-of-document id; default: the tokenizer's eos "
        "token (tokenizer_config.json's eos_token)", kind="int")
    tokenizer_hf_include_special_tokens: Optional[bool] = option(  # None: not given
        None, "HuggingFaceTokenizer: tokenize with the tokenizer's special tokens (its "
        "post-processor's, e.g. Llama 3's <|begin_of_text|> before every document): the "
        "default, as Megatron-LM's", action="store_const", const=True, after=(Flag(
            "HuggingFaceTokenizer: the text's ids only, without the tokenizer's special "
            "tokens (default: with them)", names=("--tokenizer-hf-no-include-special-tokens",),
            action="store_const", const=False),))
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
    num_workers: int = option(
        0, "worker processes that build the training batches ahead of the steps (0: built in "
        "the training process); the batches are the same either way", kind="int")
    dataloader_type: str = option(
        "single", "single: samples in the dataset's order (its own shuffle); cyclic: "
        "Megatron-LM's random sampler, every epoch of the dataset reshuffled with the epoch "
        "number as seed (resumes exactly mid-epoch); external is Megatron-LM's pass-through "
        "of a user's loader, not provided", choices=("single", "cyclic", "external"))
    data_sharding: bool = option(
        True, "--dataloader-type cyclic: one permutation over all samples, each data-parallel "
        "rank taking every dp-th (default: each rank shuffles its own contiguous shard, as "
        "Megatron-LM)", names=("--no-data-sharding",), action="store_false")


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
    preset: Optional[str] = None  # presets.py: the preset applied in place of defaults


# The help group of each section's flags (a field's own `group` overrides it).
SECTIONS = {"model": (ModelConfig, MODEL), "data": (DataConfig, DATA),
            "train": (TrainConfig, TRAINING), "parallel": (ParallelConfig, PARALLEL),
            "memory": (MemoryConfig, MEMORY), "log": (LogConfig, LOGGING),
            "compat": (CompatConfig, COMPAT)}
