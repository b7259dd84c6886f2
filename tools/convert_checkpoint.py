"""Convert checkpoints between megaulysses, Hugging Face transformers and Megatron-LM.

  from-megatron  a Megatron-LM --save directory or iter_*/release directory, torch_dist
           (megatron-core's keys; common state in common.pt or, from 0.19, inside the DCP
           files) or legacy torch (mp_rank_XX[_YYY]/model_optim_rng.pt), any tensor and
           pipeline sizes -> our checkpoint (the model; iteration, consumed samples and LR
           schedule carried; a fresh optimizer). The model comes from the checkpoint's args
           (unpickled without megatron installed). Prints the pretrain_gpt.py flags.
           pretrain_gpt.py --load takes such a directory directly (converted on the fly).

    python tools/convert_checkpoint.py from-megatron --load megatron_ckpts --save imported

  to-megatron  our checkpoint (or a Megatron-LM one, to re-shard) -> Megatron-LM's
           --ckpt-format torch_dist (default; --megatron-common-pt for megatron-core <= 0.18's
           common.pt) or torch at --tensor-model-parallel-size / --pipeline-model-parallel-size,
           with the args Namespace its --use-checkpoint-args reads; module names of
           --transformer-impl transformer_engine (default) or local for the legacy files.
           Iteration 0 is written as Megatron-LM's "release" (loaded without optimizer and
           RNG state); a later one needs Megatron-LM's --no-load-optim --no-load-rng.

    python tools/convert_checkpoint.py to-megatron --load runs/default/checkpoints --save meg

  Layouts (megaulysses/training/megatron/layout.py): our q, k, v <-> linear_qkv grouped per
  query group [q heads of the group; k; v]; our gate and fc1 <-> SwiGLU's linear_fc1
  [gate; up] (per tensor-parallel rank: [gate_r; up_r]); Megatron-LM pads the vocabulary to
  --make-vocab-size-divisible-by x tp, recorded as our divisor. to-hf accepts a Megatron-LM
  directory too (Megatron-LM -> Hugging Face in one command).

  to-hf    a checkpoint of ours (saved on any grid: tp/pp/sp/dp/ZeRO; the files hold whole
           tensors) -> a Hugging Face directory of one of these families (--arch):

             llama    LlamaForCausalLM     RoPE (any scaling), RMSNorm, SwiGLU, biases on
                                           every linear or none
             mistral  MistralForCausalLM   the same without biases, plus a sliding window
             qwen2    Qwen2ForCausalLM     biases on q, k and v only; a sliding window
             qwen3    Qwen3ForCausalLM     per-head q and k RMSNorm; a sliding window
             gpt2     GPT2LMHeadModel      learned positions, LayerNorm, GeLU, biases

           --arch auto (the default): the family from-hf recorded when it can hold the
           model, else the one its features need: --qk-layernorm qwen3, --add-qkv-bias
           qwen2, --window-size mistral, learned positions gpt2, else llama. --arch NAME
           forces one. A setting the family cannot hold is refused, naming the flag that
           made it, never dropped (--window-size to llama, --qk-layernorm to qwen2,
           block-sparse attention to any family).
           Written: the weights in safetensors (model.safetensors, or when bigger than
           --max-shard-size, default 5GB, shards model-00001-of-0000N.safetensors with
           model.safetensors.index.json, as the Hub stores big models), config.json,
           generation_config.json and the tokenizer's files (below). The dtype is
           --dtype, else the source model's that from-hf recorded, else float32. (What
           from-hf records goes on in every checkpoint a training run saves after
           loading it; a model trained from scratch has none: auto goes by the
           features, the dtype is float32.)

    python tools/convert_checkpoint.py to-hf --load runs/default/checkpoints --hf-dir hf_out

  from-hf  a Hugging Face directory of one of those families (config.json; model.safetensors,
           safetensors shards with their index, or pytorch_model.bin) -> a committed
           model-only checkpoint our trainer loads to continue pretraining (fresh
           optimizer, iteration 0). Prints the pretrain_gpt.py flags to use. Records in
           trainer_state.json ("converted_from") the family, the source dtype (config.json's
           dtype or torch_dtype, else the tensors'), the token ids and the sliding window.

    python tools/convert_checkpoint.py from-hf --hf-dir hf_model --save ckpt/imported

Settings (config.json <-> our flags): num_key_value_heads --num-query-groups; head_dim
--kv-channels; rope_parameters (rope_scaling in older files) --rotary-base and a RoPE
scaling: default (none), linear --rotary-seq-len-interpolation-factor, llama3
--use-rope-scaling and its factors, yarn --rope-type yarn and its settings
(tools/hf_rope.py has the table; dynamic, longrope and other types are refused);
sliding_window --window-size (both: each token attends the last W tokens, itself
included; Qwen's use_sliding_window is written with max_window_layers 0, a window on every
layer, and a window on some layers only is refused); Llama's attention_bias = mlp_bias
--add-bias-linear (different values are refused); Qwen2's q, k, v biases
--disable-bias-linear --add-qkv-bias; Qwen3's q_norm and k_norm --qk-layernorm;
tie_word_embeddings = not --untie-embeddings-and-output-weights.

Weight names (ours <-> Hugging Face; i = layer; each linear has .weight and, with
--add-bias-linear, .bias (q, k, v also with --add-qkv-bias); norms have .weight, and .bias
for LayerNorm):

  ours                     Llama, Mistral, Qwen2, Qwen3      GPT2LMHeadModel
  embed.word.weight        model.embed_tokens.weight         transformer.wte.weight
  embed.position.weight    -                                 transformer.wpe.weight
  layers.i.attn_norm       model.layers.i.input_layernorm    transformer.h.i.ln_1
  layers.i.attn.{q,k,v}    ...self_attn.{q,k,v}_proj         ...attn.c_attn (q|k|v fused)
  layers.i.attn.{q,k}_norm ...self_attn.{q,k}_norm (Qwen3)   -
  layers.i.attn.out        ...self_attn.o_proj               ...attn.c_proj
  layers.i.mlp_norm        ...post_attention_layernorm       ...ln_2
  layers.i.mlp.gate        ...mlp.gate_proj                  -
  layers.i.mlp.fc1         ...mlp.up_proj                    ...mlp.c_fc
  layers.i.mlp.fc2         ...mlp.down_proj                  ...mlp.c_proj
  head.norm                model.norm                        transformer.ln_f
  head.output.weight       lm_head.weight (untied models; tied ones reuse the embedding)

  --apply-layernorm-1p: our norm weights hold gamma - 1; to-hf writes gamma = weight + 1
  (Hugging Face norms hold gamma). from-hf always writes plain gamma (a checkpoint for
  runs without --apply-layernorm-1p; loading it with the flag is refused at --load).

  Llama, Mistral, Qwen: a plain rename, no tensor changes. Our q, k and v are separate
  linears and our rotary embedding is rotate-half (dimension i pairs with i + d/2),
  exactly these models' layout, so q/k rows need NO permutation. (Meta's original Llama
  checkpoints rotate interleaved pairs (2i, 2i+1) and Megatron-LM fuses q, k, v into one
  interleaved per-group weight; both need a row permutation that this tool does not do,
  because we use neither layout.)
  GPT-2: Conv1D weights are [in, out], so every linear weight is transposed; c_attn is
  q, k and v concatenated along the output dimension (weights and biases). GPT-2 has no
  grouped-query attention, RoPE, RMSNorm, SwiGLU or bias-free linears: a checkpoint with
  any of them is refused as gpt2. Its GeLU is the tanh approximation ("gelu_new"), as is
  ours. nn.Linear weights (ours, the RoPE families') are [out, in].

Vocabulary: our embedding has padded_vocab_size rows (the tokenizer's size rounded up to
--make-vocab-size-divisible-by). to-hf keeps every row: config vocab_size = the padded
size, and the tokenizer (smaller) never produces the padding ids; a model's vocabulary
larger than its tokenizer is common on the Hub. from-hf sets our vocab_size to the
tokenizer's size and picks M = --make-vocab-size-divisible-by with ceil(vocab / M) * M
== the Hugging Face vocab_size: 128 or the largest power of two below it that fits,
else the smallest divisor of the Hugging Face vocab_size larger than the padding.

Tokenizer. from-hf takes, in this order: --tokenizer-model (a directory or a .json file:
a Hugging Face tokenizer; another file: a SentencePiece model); the directory's
tokenizer.model (SentencePiece); GPT-2's vocab.json and merges.txt, for a gpt2 model or a
directory without tokenizer.json; tokenizer.json (Llama 3, Qwen, Mistral...: our
HuggingFaceTokenizer); else none (a NullTokenizer checkpoint, with a warning). The
checkpoint stores the files by their names (tokenizer.model; vocab.json and merges.txt;
tokenizer.json, tokenizer_config.json and special_tokens_map.json where present), and
the printed flags point into it (--tokenizer-type HuggingFaceTokenizer --tokenizer-model
<the checkpoint's directory>, plus --eod-token-id where the stored files do not name the
end-of-document id: one that generation_config.json or config.json gave, or from-hf's
--eod-token-id for a tokenizer that names no eos anywhere). A tokenizer with more ids
than the model's vocab_size, an eos outside the vocabulary, or an unreadable file is
refused. to-hf writes them back:
- a HuggingFaceTokenizer run's tokenizer.json and configs as they are (a
  tokenizer_config.json for transformers where the run had a lone tokenizer.json),
  checked: AutoTokenizer loads them and encodes a probe text as our tokenizer does;
- a SentencePiece run: a tokenizer.json that reproduces SentencePiece's encoding (BPE
  merges or unigram scores, byte fallback, the model's normalization and dummy-prefix
  rules), checked against SentencePiece on a probe text before anything is written,
  plus tokenizer.model. It adds no bos/eos (our runs train without them), so
  AutoTokenizer(text).input_ids equals SentencePiece's encode(text) with or without
  add_special_tokens, and "<s>" in text is text, as in SentencePiece (unigram models
  only: a control or byte piece's name written literally in text, like "<s>", becomes
  that piece);
- a GPT2BPETokenizer run: GPT-2's tokenizer from its vocab.json and merges.txt (checked
  against ours on the same probe text), eos = bos = <|endoftext|>, which in text stays
  text as in Megatron-LM;
- a checkpoint without a tokenizer (a NullTokenizer run): no tokenizer files, a warning.
generation_config.json stops at the tokenizer's eos (a Hugging Face tokenizer's own, else
the run's end-of-document id; SentencePiece's eos; GPT-2's <|endoftext|>; without a
tokenizer, the source model's or the NullTokenizer's).

from-hf records seq_length = max_position_embeddings unless --seq-length is given (our
checkpoints record the training sequence length). Dropout and initializer_range are
training settings, not part of the weights: from-hf drops them; to-hf writes the
training run's --hidden-dropout, --attention-dropout and --init-method-std when the
checkpoint records them, else 0, 0 and 0.02.

Bad input (an unknown model_type or rope type, a setting no flag of ours holds, a
tokenizer that does not fit) prints one line "error: <flag or file>: <rule>" and exits 2;
outputs are written into a temporary directory next to the target and renamed into place
at the end, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Optional

try:
    import megaulysses  # noqa: F401
except ImportError:  # run from a checkout without pip install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TOOLS = os.path.dirname(os.path.abspath(__file__))
if _TOOLS not in sys.path:  # the converter's modules beside it (tests load it by path)
    sys.path.append(_TOOLS)

from megaulysses.config import (CheckpointError, ConfigError, ModelConfig,  # noqa: E402
                                positive_int)

from convert_outputs import check_target, staged  # noqa: E402,F401 (megatron_convert's)
from hf_errors import ConvertError, warn  # noqa: E402
from hf_families import (FAMILIES, ROPE_FAMILIES, family_of, hf_config,  # noqa: E402
                         links_for, model_fields_from_hf, pick_arch, read_family_config)
from hf_rope import rope_flags  # noqa: E402
from hf_sentencepiece import hf_tokenizer  # noqa: E402,F401  (tests use it from here)
from hf_tokenizers import (checkpoint_tokenizer, export_tokenizer,  # noqa: E402
                           import_tokenizer, tokenizer_flags, tokenless_ids)
import megatron_convert  # noqa: E402
from hf_weights import (DEFAULT_SHARD_SIZE, DTYPES, read_hf_weights,  # noqa: E402
                        save_weights, shard_size, source_dtype, state_from_hf, to_hf_tensor)


# -- ours -> Hugging Face -------------------------------------------------------------------

def read_ours(load: str):
    """(meta, state, resolved checkpoint directory) of our checkpoint, or of a Megatron-LM
    one converted in memory (Megatron-LM -> Hugging Face in one command)."""
    return megatron_convert.read_any(load)


def run_mask(meta: dict) -> dict:
    """The attention mask settings a checkpoint was trained with (not part of its model
    shape): a training run's flags, else the window from-hf recorded."""
    run = meta.get("args", {}).get("model")
    if run is not None:
        return {k: run.get(k) for k in ("window_size", "attention_sparsity")}
    return {"window_size": meta.get("converted_from", {}).get("window_size")}


def save_config(config, out: str):
    """config.json as the installed transformers writes it, plus the keys transformers 4
    reads instead of 5's (5 reads both): torch_dtype, and the RoPE families' top-level
    rope_theta and rope_scaling."""
    config.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        data = json.load(f)
    data["torch_dtype"] = data["dtype"]
    if config.model_type in ROPE_FAMILIES:
        rope = dict(config.rope_parameters)
        data["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            data["rope_scaling"] = rope
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def export_tensors(cfg: ModelConfig, arch: str, state: dict, dtype: str) -> dict:
    import torch
    links = links_for(cfg, arch)
    unmapped = sorted(set(state) - {name for link in links for name in link.ours})
    if unmapped:  # never drop a parameter silently
        raise ConvertError("--load", f"parameter {unmapped[0]} has no {FAMILIES[arch]} "
                                     "counterpart")
    return {link.hf: to_hf_tensor(link, state).to(getattr(torch, dtype)).contiguous()
            for link in links}


def run_eod(meta: dict) -> Optional[int]:
    """The end-of-document id where a Hugging Face tokenizer's files name no eos: the
    run's --eod-token-id, else the one of the import (from-hf's, or the model's eos)."""
    source = meta.get("converted_from", {})
    eod = meta.get("args", {}).get("data", {}).get("eod_token_id")
    if eod is None:
        eod = source.get("eod_token_id", source.get("token_ids", {}).get("eos"))
    return eod[0] if isinstance(eod, list) and eod else eod


def write_hf(out: str, cfg: ModelConfig, arch: str, meta: dict, found, dtype: str,
             window: Optional[int]):
    """config.json, generation_config.json and the tokenizer into `out`."""
    from transformers import GenerationConfig
    from hf_tokenizers import check_hf_tokenizer
    run = meta.get("args", {})
    ids = (export_tokenizer(found, out, cfg.max_positions, run_eod(meta))
           if found.kind else tokenless_ids(meta, cfg.vocab_size))
    common = dict(architectures=[FAMILIES[arch]], vocab_size=cfg.padded_vocab_size,
                  tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                  bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"),
                  pad_token_id=ids.get("pad"), dtype=dtype,
                  initializer_range=run.get("model", {}).get("init_method_std", 0.02))
    save_config(hf_config(cfg, arch, run.get("model", {}), common, window), out)
    if ids.get("eos") is not None:  # generation stops at the end-of-document token
        GenerationConfig(bos_token_id=ids.get("bos"), eos_token_id=ids["eos"],
                         pad_token_id=ids.get("pad")).save_pretrained(out)
    if found.kind == "hf":  # AutoTokenizer may need config.json: checked last
        check_hf_tokenizer(out, found)


def to_hf(args) -> str:
    from megaulysses.training.checkpoint import model_config
    check_target(args.hf_dir, "--hf-dir", args.force)
    max_bytes = shard_size(args.max_shard_size)
    meta, state, path = read_ours(args.load)
    cfg, mask = model_config(meta["model"]), run_mask(meta)
    source = meta.get("converted_from", {})
    arch = pick_arch(cfg, args.arch, mask, family_of(source.get("architecture")))
    dtype = args.dtype or (source.get("dtype") if source.get("dtype") in DTYPES else "float32")
    tensors = export_tensors(cfg, arch, state, dtype)
    found, warning = checkpoint_tokenizer(meta, path, args.no_tokenizer)
    with staged(args.hf_dir) as out:
        files = save_weights(tensors, out, max_bytes)
        write_hf(out, cfg, arch, meta, found, dtype, mask.get("window_size"))
    if warning:  # only now: a failed conversion says one line, its error
        warn(warning)
    shards = f", {files} safetensors shards" if files > 1 else ""
    print(f"wrote {args.hf_dir}: {FAMILIES[arch]} ({dtype}{shards}) from {path}: "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.padded_vocab_size}"
          f"{', with tokenizer' if found.kind else ', no tokenizer'}")
    return args.hf_dir


# -- Hugging Face -> ours -------------------------------------------------------------------

def read_hf_config(hf_dir: str) -> tuple:
    """(arch, transformers config, raw config.json) after checking the model type."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConvertError("--hf-dir", f"{hf_dir} is not a directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(path, f"unreadable ({e})") from None
    arch = raw.get("model_type") if isinstance(raw, dict) else None
    if arch not in FAMILIES:
        raise ConvertError(path, f"model_type {arch!r} is not supported (only "
                                 f"{', '.join(FAMILIES)})")
    try:
        return arch, read_family_config(arch, hf_dir), raw
    except Exception as e:  # transformers' own validation of the config
        raise ConvertError(path, " ".join(str(e).split())) from None


def shape_from_hf(arch: str, c, raw: dict, vocab_size: int, seq_length,
                  path: str) -> tuple:
    """(our ModelConfig, the sliding window or None) of the transformers config `c`."""
    rope_key = "rope_scaling" if "rope_scaling" in raw and "rope_parameters" not in raw \
        else "rope_parameters"
    shape, window = model_fields_from_hf(arch, c, path, rope_key)
    cfg = ModelConfig(**shape, seq_length=seq_length or shape["max_position_embeddings"],
                      untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                      vocab_size=vocab_size,
                      make_vocab_size_divisible_by=divisible_by(vocab_size, c.vocab_size))
    return cfg, window


def divisible_by(vocab: int, hf_vocab: int) -> int:
    """M with ceil(vocab / M) * M == hf_vocab (see the module docstring)."""
    for m in (128, 64, 32, 16, 8, 4, 2, 1):
        if math.ceil(vocab / m) * m == hf_vocab:
            return m
    return next(m for m in range(hf_vocab - vocab + 1, hf_vocab + 1)
                if hf_vocab % m == 0)


def trainer_flags(cfg: ModelConfig, window: Optional[int]) -> list:
    """pretrain_gpt.py flags that build exactly this model shape (and window)."""
    m = cfg.shape_dict()
    flags = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"],
             "--ffn-hidden-size", m["ffn_hidden_size"],
             "--num-attention-heads", m["num_attention_heads"]]
    if m["num_query_groups"] != m["num_attention_heads"]:
        flags += ["--group-query-attention", "--num-query-groups", m["num_query_groups"]]
    flags += ["--kv-channels", m["kv_channels"], "--seq-length", m["seq_length"],
              "--max-position-embeddings", m["max_position_embeddings"],
              "--position-embedding-type", m["position_embedding_type"]]
    if m["position_embedding_type"] == "rope":
        flags += ["--rotary-base", repr(m["rotary_base"]), *rope_flags(cfg)]
    flags += ["--normalization", m["normalization"], "--norm-epsilon", repr(m["norm_epsilon"]),
              "--swiglu" if m["swiglu"] else "--no-swiglu",
              "--add-bias-linear" if m["add_bias_linear"] else "--disable-bias-linear"]
    flags += ["--add-qkv-bias"] * cfg.add_qkv_bias + ["--qk-layernorm"] * cfg.qk_layernorm
    if not m["swiglu"] and m["add_bias_linear"] and not m["bias_gelu_fusion"]:
        flags.append("--no-bias-gelu-fusion")  # the exact GeLU
    if m["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--make-vocab-size-divisible-by", m["make_vocab_size_divisible_by"]]
    if window is not None:
        flags += ["--window-size", window]
    # Continued pretraining as the open models were trained: without dropout (Megatron-LM's
    # defaults, which ours are, put 0.1 on both).
    flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    return [str(f) for f in flags]


def check_flags_build(flags: list, cfg: ModelConfig, window: Optional[int]):
    """The printed flags must pass the trainer's own validation and give this shape."""
    from megaulysses.config import parse_args, resolve
    try:  # the trainer's own start: the flags' rules, then resolve on one process
        built = resolve(parse_args(flags), 1, cfg.vocab_size).model
    except ConfigError as e:
        raise ConvertError("config.json", f"our trainer cannot build this model: {e}") from None
    if built.shape_dict() != cfg.shape_dict() or built.window_size != window:
        raise AssertionError(f"flags {flags} build {built.shape_dict()}, not {cfg.shape_dict()}")


def check_token_ids(hf, path: str):
    """The model's own special ids must be embedding rows."""
    for kind in ("bos", "eos", "pad"):
        ids = getattr(hf, f"{kind}_token_id", None)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None and not 0 <= i < hf.vocab_size:
                raise ConvertError(path, f"{kind}_token_id {i} is outside the vocabulary "
                                         f"[0, {hf.vocab_size})")


def converted_from(hf_dir: str, arch: str, hf, dtype: str, window: Optional[int],
                   eod: Optional[int]) -> dict:
    """Recorded in trainer_state.json: to-hf's default family and dtype; the token ids
    serve an export without tokenizer, the end-of-document id one whose tokenizer files
    name no eos; the window, a mask setting, is no model shape."""
    ids = {k: getattr(hf, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    return {"hf_dir": os.path.abspath(hf_dir), "architecture": FAMILIES[arch],
            "token_ids": ids, "dtype": dtype, "window_size": window, "eod_token_id": eod}


def from_hf(args) -> str:
    from megaulysses.training.checkpoint import iteration_dir
    from megaulysses.training.saver import write_model_checkpoint
    check_target(args.save, "--save", args.force)
    arch, hf, raw = read_hf_config(args.hf_dir)
    config_path = os.path.join(args.hf_dir, "config.json")
    check_token_ids(hf, config_path)
    found, warning = import_tokenizer(args.hf_dir, args.tokenizer_model, arch, hf.vocab_size,
                                      args.eod_token_id)
    cfg, window = shape_from_hf(arch, hf, raw, found.vocab_size, args.seq_length, config_path)
    if cfg.seq_length > cfg.max_positions:
        raise ConvertError("--seq-length", f"must be <= the model's max_position_embeddings "
                                           f"{cfg.max_positions}, got {cfg.seq_length}")
    flags = trainer_flags(cfg, window)
    check_flags_build(flags, cfg, window)
    weights = read_hf_weights(args.hf_dir)
    dtype = source_dtype(raw, weights)
    state = state_from_hf(cfg, arch, weights, args.hf_dir)
    del weights
    with staged(args.save) as out:
        write_model_checkpoint(out, state, cfg.shape_dict(), tokenizer=found.files or None,
                               extra={"converted_from": converted_from(
                                   args.hf_dir, arch, hf, dtype, window, found.eod)})
    if warning:  # only now: a failed conversion says one line, its error
        warn(warning)
    tok_flags = tokenizer_flags(found, iteration_dir(args.save, 0))
    print(f"wrote {args.save}: {FAMILIES[arch]} ({dtype}) from {args.hf_dir}, "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} "
          f"(padded {cfg.padded_vocab_size})")
    print("continue pretraining with these flags (plus --data-path tokenized with this "
          "tokenizer, batch and schedule flags):")
    print(shlex.join(["python", "pretrain_gpt.py", *flags, "--load", args.save, *tok_flags]))
    return args.save


# -- command line ---------------------------------------------------------------------------

DIRECTIONS = "{to-hf,from-hf,from-megatron,to-megatron}"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (raised as ConvertError)."""

    def error(self, message):
        if message.startswith("argument ") and ": " in message:
            flag, rule = message[len("argument "):].split(": ", 1)
            raise ConvertError("direction" if flag.startswith("{") else flag.split("/")[0],
                               rule)
        if DIRECTIONS in message:  # no direction given
            raise ConvertError("direction", "required: to-hf, from-hf, from-megatron or "
                                            "to-megatron (see --help)")
        required = "the following arguments are required: "
        if message.startswith(required):
            raise ConvertError(message[len(required):].split(",")[0].split("/")[0], "required")
        raise ConvertError("convert_checkpoint.py", message)


def _to_hf_parser(sub):
    a = sub.add_parser("to-hf", help="our checkpoint -> Hugging Face directory",
                       description="Our checkpoint (any grid) -> a Hugging Face directory.\n\n"
                       "  python tools/convert_checkpoint.py to-hf --load runs/default/"
                       "checkpoints --hf-dir hf_out",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--load", required=True,
                   help="a --save directory (its latest committed checkpoint) or iter_XXXXXXX")
    a.add_argument("--hf-dir", required=True, help="output directory (must be new or empty)")
    a.add_argument("--arch", choices=("auto", *FAMILIES), default="auto",
                   help="auto: the family from-hf recorded if it holds the model, else "
                        "qwen3 for --qk-layernorm, qwen2 for --add-qkv-bias, mistral for "
                        "--window-size, gpt2 for learned positions, else llama")
    a.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the exported weights and config.json (default: the "
                        "source model's that from-hf recorded, else float32)")
    a.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                   help="largest safetensors file before the weights are split into "
                        "shards with an index, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    a.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    a.add_argument("--force", action="store_true", help="replace a non-empty --hf-dir")


def _from_hf_parser(sub):
    b = sub.add_parser("from-hf", help="Hugging Face directory -> our checkpoint",
                       description="A Hugging Face Llama, Mistral, Qwen2, Qwen3 or GPT-2 "
                       "directory -> a checkpoint our trainer continues from.\n\n"
                       "  python tools/convert_checkpoint.py from-hf --hf-dir hf_model "
                       "--save ckpt/imported",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or "
                                                   "shards with an index, or .bin)")
    b.add_argument("--save", required=True, help="output --load directory (new or empty)")
    b.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer to train with: a SentencePiece model, or a directory "
                        "or tokenizer.json of a Hugging Face tokenizer (default: HF_DIR's, "
                        "see --help of the tool)")
    b.add_argument("--eod-token-id", type=int, default=None,
                   help="a Hugging Face tokenizer's end-of-document id, where its files name "
                        "no eos (default: its eos)")
    b.add_argument("--seq-length", type=positive_int("--seq-length"), default=None,
                   help="training sequence length recorded in the checkpoint "
                        "(default: max_position_embeddings)")
    b.add_argument("--force", action="store_true", help="replace a non-empty --save")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="convert_checkpoint.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True, metavar=DIRECTIONS,
                           parser_class=_Parser)
    _to_hf_parser(sub)
    _from_hf_parser(sub)
    megatron_convert.add_parsers(sub)
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.direction == "to-hf":
            to_hf(args)
        elif args.direction == "from-hf":
            from_hf(args)
        elif args.direction == "from-megatron":
            megatron_convert.from_megatron(args, trainer_flags)
        else:
            megatron_convert.to_megatron(args)
    except (ConvertError, CheckpointError, ConfigError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
