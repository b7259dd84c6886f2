"""Megatron-LM's `args` Namespace <-> our ModelConfig, and reading its pickles anywhere.

A Megatron-LM checkpoint records its whole command line as an argparse Namespace (`args`,
in common.pt, the DCP common state or model_optim_rng.pt). The model's shape comes from
it; what we do not build (MoE, MLA, Mamba, encoders, partial or interleaved RoPE, ...)
is refused by name. The Namespace pickles objects of megatron's own classes (enums, dtypes
of its own, callables): `load_pickle` reads them without megatron installed, each such
object becoming a placeholder that records what it was.
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
from typing import Any, Optional

import torch

from megaulysses.config import CheckpointError, ModelConfig
from megaulysses.config.schema import megatron_window

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current value: per-group qkv layout


class Placeholder:
    """An object of a class that is not importable here (megatron's): kept as a name."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.state = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> "Placeholder":  # enum values by call
        return type(self)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__}{self.args or ''}>"


class _Unpickler(pickle.Unpickler):
    """pickle.Unpickler whose unknown megatron (and Transformer Engine, apex) classes
    become Placeholder subclasses named after them."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.split(".")[0] not in ("megatron", "transformer_engine", "apex",
                                           "modelopt", "nvidia_resiliency_ext"):
                raise
            return type(name, (Placeholder,), {"__qualname__": f"{module}.{name}"})


class _PickleModule:
    """What torch.load's `pickle_module` needs: our Unpickler, pickle's other names."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    __name__ = "megaulysses_pickle"


def load_pickle(source: Any, what: str) -> Any:
    """torch.load of a Megatron-LM pickle (a path or a file object) on the CPU."""
    try:
        return torch.load(source, map_location="cpu", weights_only=False,
                          pickle_module=_PickleModule)
    except Exception as e:  # a torn or foreign file: one line naming it
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{what}: unreadable as a Megatron-LM checkpoint file "
                              f"({type(e).__name__}: {first})") from e


def dumps(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


# -- args -> our model -----------------------------------------------------------------------

# Megatron-LM args that name an architecture we do not build: (attribute, test, what).
# (Not encoder_num_layers or bert_binary_head: Megatron-LM sets them for every GPT too;
# an encoder shows in the tensors, read.py refuses encoder.* names.)
_UNSUPPORTED = (
    ("num_experts", lambda v: v not in (None, 0, 1), "mixture of experts (--num-experts)"),
    ("multi_latent_attention", bool, "multi-latent attention (--multi-latent-attention)"),
    ("is_hybrid_model", bool, "a hybrid Mamba model (--is-hybrid-model)"),
    ("hybrid_override_pattern", bool, "a hybrid Mamba model (--hybrid-override-pattern)"),
    ("rotary_interleaved", bool, "interleaved RoPE (--rotary-interleaved)"),
    ("squared_relu", bool, "squared ReLU (--squared-relu)"),
    ("heterogeneous_layers_config_path", bool, "heterogeneous layers"),
    ("mtp_num_layers", bool, "multi-token prediction (--mtp-num-layers)"),
    ("moe_layer_freq", lambda v: v not in (None, 1), "mixture of experts"),
)


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def check_supported(args: Any, where: str) -> None:
    for name, test, what in _UNSUPPORTED:
        value = _get(args, name)
        if value is not None and test(value):
            raise CheckpointError(f"{where}: {what} is not an architecture this framework "
                                  "builds (a dense GPT only)")
    percent = _get(args, "rotary_percent", 1.0)
    if position_type(args) == "rope" and percent not in (None, 1.0):
        raise CheckpointError(f"{where}: --rotary-percent {percent} (RoPE on part of each "
                              "head) is not built here (only 1.0)")
    if _get(args, "window_size") is not None and _get(args, "window_attn_skip_freq"):
        raise CheckpointError(f"{where}: a sliding window on some layers only "
                              "(--window-attn-skip-freq) is not built here")
    megatron_window_of(args, where)
    if _get(args, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        raise CheckpointError(f"{where}: --normalization {args.normalization} is not built "
                              "here (LayerNorm or RMSNorm)")


def megatron_window_of(args: Any, where: str) -> Optional[int]:
    """Our --window-size of Megatron-LM's args.window_size (left, right), or None."""
    pair = _get(args, "window_size")
    if pair is None:
        return None
    try:
        return megatron_window(*pair)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: --window-size {pair}: {e}") from None


def position_type(args: Any) -> str:
    kind = _get(args, "position_embedding_type") or "learned_absolute"
    if _get(args, "use_rotary_position_embeddings"):  # the older spelling
        kind = "rope"
    return kind


def _rope_fields(args: Any, where: str) -> dict:
    kind = position_type(args)
    if kind not in ("rope", "learned_absolute"):
        raise CheckpointError(f"{where}: --position-embedding-type {kind} is not built here "
                              "(rope or learned_absolute)")
    if kind == "learned_absolute":
        return {"position_embedding_type": kind}
    out = {"position_embedding_type": kind,
           "rotary_base": float(_get(args, "rotary_base", 10000) or 10000)}
    if _get(args, "rotary_seq_len_interpolation_factor"):
        out["rotary_seq_len_interpolation_factor"] = args.rotary_seq_len_interpolation_factor
    if _get(args, "use_rope_scaling"):
        out.update(use_rope_scaling=True,
                   rope_scaling_factor=float(_get(args, "rope_scaling_factor", 8.0)))
    return out


def effective_divisor(args: Any) -> int:
    """Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by
    times the tensor-parallel size; ours pads by the flag alone."""
    return int(_get(args, "make_vocab_size_divisible_by", 128)) * int(
        _get(args, "tensor_model_parallel_size", 1) or 1)


def model_config(args: Any, where: str, padded_vocab: int) -> tuple[ModelConfig, bool]:
    """(our ModelConfig, whether the tokenizer's own vocabulary size is known). Megatron-LM
    records the padded size only (its NullTokenizer runs add --vocab-size)."""
    check_supported(args, where)
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if _get(args, "group_query_attention") else heads
    vocab = _get(args, "vocab_size")
    known = vocab is not None and math.ceil(vocab / effective_divisor(args)) * \
        effective_divisor(args) == padded_vocab
    # Unknown tokenizer size: the padded rows stand for it, with Megatron-LM's effective
    # divisor, so that the printed --make-vocab-size-divisible-by pads a real tokenizer alike.
    divisor = effective_divisor(args) if padded_vocab % effective_divisor(args) == 0 \
        else padded_vocab
    fields = dict(
        num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
        ffn_hidden_size=int(_get(args, "ffn_hidden_size") or 4 * args.hidden_size),
        num_attention_heads=heads, num_query_groups=groups if groups != heads else None,
        kv_channels=int(_get(args, "kv_channels") or args.hidden_size // heads),
        seq_length=int(_get(args, "seq_length") or _get(args, "max_position_embeddings")),
        max_position_embeddings=int(_get(args, "max_position_embeddings") or args.seq_length),
        normalization=_get(args, "normalization", "LayerNorm"),
        norm_epsilon=float(_get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))),
        apply_layernorm_1p=bool(_get(args, "apply_layernorm_1p", False)),
        swiglu=bool(_get(args, "swiglu", False)),
        add_bias_linear=bool(_get(args, "add_bias_linear", True)),
        # its GeLU: the fused bias-GeLU's tanh approximation, else exact (validate_args has
        # already turned the fusion off without biases)
        bias_gelu_fusion=bool(_get(args, "bias_gelu_fusion", True)) and bool(
            _get(args, "add_bias_linear", True)),
        # Megatron-LM sets add_qkv_bias whenever add_bias_linear is on; ours means "q, k, v
        # only", so it stays off where every linear has a bias
        add_qkv_bias=bool(_get(args, "add_qkv_bias", False)) and not bool(
            _get(args, "add_bias_linear", True)),
        qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        untie_embeddings_and_output_weights=bool(
            _get(args, "untie_embeddings_and_output_weights", False)),
        vocab_size=int(vocab) if known else padded_vocab,
        make_vocab_size_divisible_by=divisor, window_size=megatron_window_of(args, where),
        **_rope_fields(args, where))
    for name in ("hidden_dropout", "attention_dropout", "init_method_std"):
        if _get(args, name) is not None:
            fields[name] = float(_get(args, name))
    return ModelConfig(**fields), known


# -- our model -> args -----------------------------------------------------------------------

def _divisor_for(cfg: ModelConfig, tp: int) -> int:
    """--make-vocab-size-divisible-by D that makes Megatron-LM at tensor-parallel `tp` pad
    our vocabulary to our padded size: ceil(V / (D * tp)) * D * tp == padded."""
    padded = cfg.padded_vocab_size
    ours = [cfg.make_vocab_size_divisible_by // tp] if cfg.make_vocab_size_divisible_by % tp \
        == 0 else []  # the run's own divisor where it splits: what its script said
    divisors = sorted({d for d in range(1, padded // tp + 1) if (padded // tp) % d == 0},
                      key=lambda d: (d & (d - 1) != 0 or d > 128, -d))  # 128, 64, ... first
    for d in ours + divisors:
        if math.ceil(cfg.vocab_size / (d * tp)) * d * tp == padded:
            return d
    raise CheckpointError(f"--tensor-model-parallel-size: Megatron-LM at {tp} cannot pad "
                          f"this vocabulary ({cfg.vocab_size} tokens) to the model's "
                          f"{padded} rows (the rows must split evenly across ranks)")


def megatron_args(cfg: ModelConfig, tp: int, pp: int, run: Optional[dict] = None,
                  dtype: str = "float32") -> argparse.Namespace:
    """A Namespace with the model flags Megatron-LM's --use-checkpoint-args reads (and
    check_checkpoint_args compares), plus the run's own settings where we know them."""
    rope = cfg.position_embedding_type == "rope"
    groups = cfg.num_kv_heads != cfg.num_attention_heads
    run = run or {}
    ns = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size, num_attention_heads=cfg.num_attention_heads,
        group_query_attention=groups, num_query_groups=cfg.num_kv_heads if groups else 1,
        kv_channels=cfg.head_dim, seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_positions,
        position_embedding_type=cfg.position_embedding_type, add_position_embedding=not rope,
        use_rotary_position_embeddings=rope, rotary_base=int(cfg.rotary_base)
        if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
        rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
        use_rope_scaling=cfg.use_rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor,
        normalization=cfg.normalization, norm_epsilon=cfg.norm_epsilon,
        apply_layernorm_1p=cfg.apply_layernorm_1p, swiglu=cfg.swiglu,
        add_bias_linear=cfg.add_bias_linear, bias_gelu_fusion=cfg.gelu_approximate == "tanh",
        add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear,  # Megatron-LM keeps them in sync
        qk_layernorm=cfg.qk_layernorm,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        padded_vocab_size=cfg.padded_vocab_size, vocab_size=cfg.vocab_size,
        make_vocab_size_divisible_by=_divisor_for(cfg, tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        num_experts=None, multi_latent_attention=False, is_hybrid_model=False,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, params_dtype=getattr(torch, dtype),
        fp16=dtype == "float16", bf16=dtype == "bfloat16", transformer_impl="local",
        # Megatron-LM's (left, right): keys W-1 back to 0 ahead
        window_size=(cfg.window_size - 1, 0) if cfg.window_size else None,
        ckpt_format="torch_dist", use_dist_ckpt=True)
    for key, value in run.items():  # the training run's own settings, where saved
        if not hasattr(ns, key) and isinstance(value, (int, float, str, bool, type(None))):
            setattr(ns, key, value)
    if getattr(ns, "tokenizer_type", None) in TOKENIZER_NAMES:
        ns.tokenizer_type = TOKENIZER_NAMES[ns.tokenizer_type]
    return ns


# Our --tokenizer-type -> Megatron-LM's of the same encoding (its --use-checkpoint-args
# takes the tokenizer from the checkpoint): its SentencePieceTokenizer adds special tokens
# of its own, its GPTSentencePieceTokenizer is SentencePiece as it is, as ours.
TOKENIZER_NAMES = {"SentencePieceTokenizer": "GPTSentencePieceTokenizer"}
