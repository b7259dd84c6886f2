"""Convert checkpoints between megaulysses and Hugging Face transformers.

  to-hf    a checkpoint of ours (saved on any grid: tp/pp/sp/dp/ZeRO; the files hold whole
           tensors) -> a Hugging Face directory: LlamaForCausalLM (RoPE, RMSNorm, SwiGLU)
           or GPT2LMHeadModel (learned positions, LayerNorm, GeLU, biases); model.safetensors,
           config.json, generation_config.json, and tokenizer.json/tokenizer_config.json
           (plus tokenizer.model) built from the run's SentencePiece model, or GPT-2's
           tokenizer files from a GPT2BPETokenizer run's vocab.json and merges.txt.

    python tools/convert_checkpoint.py to-hf --load runs/default/checkpoints --hf-dir hf_out

  from-hf  a Hugging Face directory (Llama or GPT-2: config.json + safetensors or .bin)
           -> a committed model-only checkpoint our trainer loads to continue pretraining
           (fresh optimizer, iteration 0). Prints the pretrain_gpt.py flags to use.

    python tools/convert_checkpoint.py from-hf --hf-dir hf_model --save ckpt/imported

Weight names (ours <-> Hugging Face; i = layer; each linear has .weight and, with
--add-bias-linear, .bias; norms have .weight, and .bias for LayerNorm):

  ours                     LlamaForCausalLM                  GPT2LMHeadModel
  embed.word.weight        model.embed_tokens.weight         transformer.wte.weight
  embed.position.weight    -                                 transformer.wpe.weight
  layers.i.attn_norm       model.layers.i.input_layernorm    transformer.h.i.ln_1
  layers.i.attn.{q,k,v}    ...self_attn.{q,k,v}_proj         ...attn.c_attn (q|k|v fused)
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

  Llama: a plain rename, no tensor changes. Our q, k and v are separate linears and our
  rotary embedding is rotate-half (dimension i pairs with i + d/2), exactly Hugging Face
  Llama's layout, so q/k rows need NO permutation. (Meta's original Llama checkpoints
  rotate interleaved pairs (2i, 2i+1) and Megatron-LM fuses q, k, v into one interleaved
  per-group weight; both need a row permutation that this tool does not do, because we
  use neither layout.)
  GPT-2: Conv1D weights are [in, out], so every linear weight is transposed; c_attn is
  q, k and v concatenated along the output dimension (weights and biases). GPT-2 has no
  grouped-query attention, RoPE, RMSNorm, SwiGLU or bias-free linears: a checkpoint with
  any of them is refused as gpt2. Its GeLU is the tanh approximation ("gelu_new"), as is
  ours. nn.Linear weights (ours, Llama's) are [out, in].

Vocabulary: our embedding has padded_vocab_size rows (the tokenizer's size rounded up to
--make-vocab-size-divisible-by). to-hf keeps every row: config vocab_size = the padded
size, and the tokenizer (smaller) never produces the padding ids; a model's vocabulary
larger than its tokenizer is common on the Hub. from-hf sets our vocab_size to the
tokenizer's size and picks M = --make-vocab-size-divisible-by with ceil(vocab / M) * M
== the Hugging Face vocab_size: 128 or the largest power of two below it that fits,
else the smallest divisor of the Hugging Face vocab_size larger than the padding.

Tokenizer: the exported tokenizer.json reproduces SentencePiece's encoding (BPE merges
or unigram scores, byte fallback, the model's normalization and dummy-prefix rules) and
is checked against SentencePiece on a probe text before anything is written. It adds no
bos/eos (our runs train without them), so AutoTokenizer(text).input_ids equals
SentencePiece's encode(text) with or without add_special_tokens, and "<s>" in text is
text, as in SentencePiece (unigram models only: a control or byte piece's name written
literally in text, like "<s>", becomes that piece). generation_config.json stops at the
end-of-document token (the SentencePiece eos). A GPT2BPETokenizer run exports GPT-2's
tokenizer from its vocab.json and merges.txt (checked against ours on the same probe
text), eos = bos = <|endoftext|>, which in text stays text as in Megatron-LM; from-hf
takes a directory's vocab.json and merges.txt (as GPT-2's repository has them) when it
has no tokenizer.model. A checkpoint without a tokenizer (a NullTokenizer run) exports
without tokenizer files, with a warning.

from-hf records seq_length = max_position_embeddings unless --seq-length is given (our
checkpoints record the training sequence length). Dropout and initializer_range are
training settings, not part of the weights: from-hf drops them; to-hf writes the
training run's --hidden-dropout, --attention-dropout and --init-method-std when the
checkpoint records them, else 0, 0 and 0.02.

Bad input prints one line "error: <flag or file>: <rule>" and exits 2; outputs are
written into a temporary directory next to the target and renamed into place at the
end, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass

try:
    import megaulysses  # noqa: F401
except ImportError:  # run from a checkout without pip install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaulysses.config import (CheckpointError, ConfigError, ModelConfig,  # noqa: E402
                                positive_int)

ARCHES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_MODEL = "tokenizer.model"
GPT2_FILES = ("vocab.json", "merges.txt")  # GPT2BPETokenizer's, in checkpoints and on the Hub
# Reproduced by the exported tokenizer before it is written: spaces (single, double,
# leading, trailing), newlines, tabs, digits, accents, symbols outside any vocabulary;
# BPE models also the names of control and byte pieces, which are plain text.
PROBE_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
              "  Two  spaces,\ttab, 1603 and 42; caf\u00e9 \u00fcber \u2603 \u6f22\u5b57 "
              "\U0001f600 end ")
PROBE_RESERVED = "<s> </s> <unk> <0x41> "


class ConvertError(Exception):
    """Bad input: main() prints "error: <where>: <rule>" as one line and exits 2."""

    def __init__(self, where: str, rule: str):
        super().__init__(f"{where}: {rule}")


def warn(text: str):
    print(f"warning: {text}", file=sys.stderr)


# -- which Hugging Face architecture holds which of our models ----------------------------

def check_exportable(cfg: ModelConfig, arch: str):
    """Raise ConvertError naming every setting of the checkpoint (by the flag that made
    it) that the architecture cannot represent."""
    c = cfg
    if arch == "llama":
        rules = [(c.position_embedding_type == "rope",
                  f"--position-embedding-type {c.position_embedding_type}", "Llama has rope"),
                 (c.normalization == "RMSNorm", f"--normalization {c.normalization}",
                  "Llama has RMSNorm"),
                 (c.swiglu, "--no-swiglu", "Llama has a SwiGLU MLP"),
                 (c.hidden_size % c.num_attention_heads == 0, f"--hidden-size {c.hidden_size}",
                  f"Hugging Face Llama needs it divisible by the {c.num_attention_heads} heads")]
    else:
        rules = [(c.position_embedding_type == "learned_absolute",
                  f"--position-embedding-type {c.position_embedding_type}",
                  "GPT-2 has learned_absolute positions"),
                 (c.normalization == "LayerNorm", f"--normalization {c.normalization}",
                  "GPT-2 has LayerNorm"),
                 (not c.swiglu, "--swiglu", "GPT-2 has a GeLU MLP"),
                 (c.add_bias_linear, "--disable-bias-linear", "GPT-2 has biases on every linear"),
                 (c.num_kv_heads == c.num_attention_heads, f"--num-query-groups {c.num_kv_heads}",
                  f"GPT-2 has no grouped-query attention (kv heads = the "
                  f"{c.num_attention_heads} heads)"),
                 (c.head_dim * c.num_attention_heads == c.hidden_size,
                  f"--kv-channels {c.head_dim}", "GPT-2's head dimension is hidden / heads")]
    broken = [f"{flag}: {rule}" for ok, flag, rule in rules if not ok]
    if broken:  # every reason at once, on one line
        raise ConvertError("--arch", f"{arch}: the checkpoint cannot be a {ARCHES[arch]}: "
                                     + "; ".join(broken))


def pick_arch(cfg: ModelConfig, asked: str) -> str:
    arch = asked
    if asked == "auto":
        arch = "llama" if cfg.position_embedding_type == "rope" else "gpt2"
    check_exportable(cfg, arch)
    return arch


# -- the weight mapping, one table for both directions ------------------------------------

@dataclass(frozen=True)
class Link:
    """One Hugging Face tensor and the parameter(s) of ours it holds.

    kind: "same" (a rename), "t" (GPT-2 Conv1D: transposed), "fused_t" (GPT-2 c_attn
    weight: q, k, v stacked by output rows, then transposed), "fused" (c_attn bias), "1p"
    (a norm weight of an --apply-layernorm-1p model, which stores gamma - 1: gamma is
    weight + 1)."""
    hf: str
    ours: tuple
    kind: str = "same"


def _pair(hf: str, ours: str, kind: str, bias: bool) -> list:
    out = [Link(hf + ".weight", (ours + ".weight",), kind)]
    if bias:
        out.append(Link(hf + ".bias", (ours + ".bias",)))
    return out


def _norm_kind(cfg: ModelConfig) -> str:
    return "1p" if cfg.apply_layernorm_1p else "same"


def llama_links(cfg: ModelConfig) -> list:
    b, norm = cfg.add_bias_linear, _norm_kind(cfg)
    links = [Link("model.embed_tokens.weight", ("embed.word.weight",))]
    for i in range(cfg.num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        links += _pair(hf + "input_layernorm", us + "attn_norm", norm, False)
        for theirs, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "out")):
            links += _pair(f"{hf}self_attn.{theirs}", f"{us}attn.{ours}", "same", b)
        links += _pair(hf + "post_attention_layernorm", us + "mlp_norm", norm, False)
        for theirs, ours in (("gate_proj", "gate"), ("up_proj", "fc1"), ("down_proj", "fc2")):
            links += _pair(f"{hf}mlp.{theirs}", f"{us}mlp.{ours}", "same", b)
    links += _pair("model.norm", "head.norm", norm, False)
    if cfg.untie_embeddings_and_output_weights:
        links.append(Link("lm_head.weight", ("head.output.weight",)))
    return links


def gpt2_links(cfg: ModelConfig) -> list:
    norm = _norm_kind(cfg)
    links = [Link("transformer.wte.weight", ("embed.word.weight",)),
             Link("transformer.wpe.weight", ("embed.position.weight",))]
    for i in range(cfg.num_layers):
        hf, us = f"transformer.h.{i}.", f"layers.{i}."
        qkv = tuple(f"{us}attn.{x}" for x in "qkv")
        links += _pair(hf + "ln_1", us + "attn_norm", norm, True)
        links += [Link(hf + "attn.c_attn.weight", tuple(n + ".weight" for n in qkv), "fused_t"),
                  Link(hf + "attn.c_attn.bias", tuple(n + ".bias" for n in qkv), "fused")]
        links += _pair(hf + "attn.c_proj", us + "attn.out", "t", True)
        links += _pair(hf + "ln_2", us + "mlp_norm", norm, True)
        links += _pair(hf + "mlp.c_fc", us + "mlp.fc1", "t", True)
        links += _pair(hf + "mlp.c_proj", us + "mlp.fc2", "t", True)
    links += _pair("transformer.ln_f", "head.norm", norm, True)
    if cfg.untie_embeddings_and_output_weights:
        links.append(Link("lm_head.weight", ("head.output.weight",)))
    return links


def links_for(cfg: ModelConfig, arch: str) -> list:
    return llama_links(cfg) if arch == "llama" else gpt2_links(cfg)


def to_hf_tensor(link: Link, state: dict):
    import torch
    parts = [state[name] for name in link.ours]
    if link.kind == "same":
        return parts[0]
    if link.kind == "1p":
        return parts[0] + 1.0
    if link.kind == "t":
        return parts[0].t()
    fused = torch.cat(parts, dim=0)
    return fused.t() if link.kind == "fused_t" else fused


def from_hf_tensor(link: Link, tensor, shapes: dict) -> dict:
    """{our name: tensor}; `shapes` (our parameter shapes) give the q/k/v split."""
    if link.kind == "1p":
        return {link.ours[0]: tensor - 1.0}
    if link.kind in ("same", "t"):
        return {link.ours[0]: tensor.t() if link.kind == "t" else tensor}
    rows = [shapes[name][0] for name in link.ours]
    fused = tensor.t() if link.kind == "fused_t" else tensor
    return dict(zip(link.ours, fused.split(rows, dim=0)))


def our_shapes(cfg: ModelConfig) -> dict:
    """{parameter name: shape} of our GPT for cfg, built on the meta device (no memory)."""
    import torch
    from megaulysses.model.gpt import GPT
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(cfg).state_dict().items()}


# -- the tokenizer: SentencePiece -> tokenizer.json ---------------------------------------

SP_NORMAL, SP_USER_DEFINED = 1, 4
SP_UNIGRAM, SP_BPE = 1, 2


def sp_processor(path: str, where: str = None):
    """SentencePieceProcessor, or ConvertError naming `where` (default: the file)."""
    import sentencepiece as spm
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
        raise ConvertError(where or path, f"{path} is not a readable SentencePiece model "
                                          f"({' '.join(str(e).split())})")


def _sp_proto(path: str):
    """The model's protobuf (pieces with types and scores, trainer and normalizer specs)."""
    from sentencepiece import sentencepiece_model_pb2
    sp_processor(path)  # a clear error for a file that is not a model
    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _bpe_model(proto):
    """BPE merges from the pieces: SentencePiece merges the adjacent pair whose joined
    piece scores highest, so every split of a normal piece into two known pieces is a
    merge, ranked by that piece's score (ties: lower id first)."""
    from tokenizers import models
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    ranked = []
    for i, p in enumerate(proto.pieces):
        if p.type != SP_NORMAL:
            continue  # user-defined pieces are matched whole (added tokens); control,
            # unknown, byte and unused pieces never come from text
        for k in range(1, len(p.piece)):
            left, right = p.piece[:k], p.piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-p.score, i, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = proto.pieces[proto.trainer_spec.unk_id].piece
    return models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                      byte_fallback=proto.trainer_spec.byte_fallback)


def _unigram_model(proto):
    """The pieces and scores as they are. Unlike SentencePiece, Viterbi in `tokenizers`
    also matches control and byte pieces ("<s>", "<0x41>") written literally in text, and
    no score can prevent it (the unknown-character penalty follows the lowest score): the
    one known difference, for unigram models only."""
    from tokenizers import models
    vocab = [(p.piece, p.score) for p in proto.pieces]
    return models.Unigram(vocab, proto.trainer_spec.unk_id, proto.trainer_spec.byte_fallback)


def _whitespace_rules(proto, path: str):
    """(normalizer, decoder) parts for the model's normalization and whitespace rules."""
    from tokenizers import decoders, normalizers
    spec = proto.normalizer_spec
    if spec.remove_extra_whitespaces:
        raise ConvertError(path, "remove_extra_whitespaces is set; tokenizer.json cannot "
                                 "reproduce it exactly (pass --no-tokenizer)")
    if proto.trainer_spec.treat_whitespace_as_suffix or not spec.escape_whitespaces:
        raise ConvertError(path, "only whitespace as a prefix '\u2581' is supported "
                                 "(pass --no-tokenizer)")
    norm = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap \
        else []
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if spec.add_dummy_prefix:  # SentencePiece puts a space before non-empty text
        norm.append(normalizers.Prepend("\u2581"))
        dec.append(decoders.Strip(" ", 1, 0))
    norm.append(normalizers.Replace(" ", "\u2581"))
    return normalizers.Sequence(norm), decoders.Sequence(dec)


def hf_tokenizer(path: str):
    """A `tokenizers.Tokenizer` that encodes like SentencePiece(model_file=path)."""
    from tokenizers import AddedToken, Tokenizer
    proto = _sp_proto(path)
    kind = proto.trainer_spec.model_type
    if kind not in (SP_BPE, SP_UNIGRAM):
        raise ConvertError(path, "only BPE and unigram SentencePiece models are supported "
                                 "(pass --no-tokenizer)")
    tok = Tokenizer(_bpe_model(proto) if kind == SP_BPE else _unigram_model(proto))
    tok.normalizer, tok.decoder = _whitespace_rules(proto, path)
    # SentencePiece matches user-defined symbols whole, before its model: added tokens.
    tok.add_tokens([AddedToken(p.piece, normalized=False, special=False)
                    for p in proto.pieces if p.type == SP_USER_DEFINED])
    _check_same_encoding(tok, path, PROBE_TEXT + (PROBE_RESERVED if kind == SP_BPE else ""))
    return tok


def _check_same_encoding(tok, path: str, text: str):
    want = sp_processor(path).encode(text)
    got = tok.encode(text).ids
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got),
                                                                                   len(want)))
        raise ConvertError(path, f"the Hugging Face tokenizer built from it encodes a probe "
                                 f"text differently from SentencePiece (token {at}); pass "
                                 "--no-tokenizer to export without tokenizer files")


def special_ids(path: str) -> dict:
    sp = sp_processor(path)
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    return {k: (v if v >= 0 else None) for k, v in ids.items()}


def save_tokenizer(path: str, out: str, max_length: int):
    """tokenizer.json + tokenizer_config.json (+ the SentencePiece model itself)."""
    from transformers import PreTrainedTokenizerFast
    tok, ids, sp = hf_tokenizer(path), special_ids(path), sp_processor(path)
    named = {f"{k}_token": sp.id_to_piece(v) for k, v in ids.items() if v is not None}
    # split_special_tokens: "<s>" written in text stays text, as in SentencePiece.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named,
                                   split_special_tokens=True, model_max_length=max_length,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)
    # The generic fast class by its long-standing name: transformers 4 and 5 both load it.
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False,
                  add_eos_token=False)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    shutil.copyfile(path, os.path.join(out, TOKENIZER_MODEL))
    return ids


def save_gpt2_tokenizer(vocab: str, merges: str, out: str, max_length: int) -> dict:
    """GPT-2's tokenizer files from a GPT2BPETokenizer run's vocab.json and merges.txt,
    checked to encode the probe text as our tokenizer does."""
    from transformers import GPT2Tokenizer
    from megaulysses.data.tokenizer import GPT2_EOD, GPT2BPETokenizer
    ours = GPT2BPETokenizer(vocab, merges)
    # split_special_tokens: "<|endoftext|>" written in text stays text, as in Megatron-LM.
    theirs = GPT2Tokenizer(vocab=vocab, merges=merges, split_special_tokens=True,
                           clean_up_tokenization_spaces=False)
    probe = PROBE_TEXT + GPT2_EOD
    if theirs(probe).input_ids != ours.tokenize(probe):
        raise ConvertError(vocab, "the Hugging Face GPT-2 tokenizer built from it encodes a "
                                  "probe text differently from ours; pass --no-tokenizer")
    theirs.model_max_length = max_length  # after the probe, which may be longer
    theirs.save_pretrained(out)
    # GPT-2's own files too, as its repository has them (slow tokenizers, from-hf).
    for name, path in zip(GPT2_FILES, (vocab, merges)):
        shutil.copyfile(path, os.path.join(out, name))
    return {"bos": ours.eod, "eos": ours.eod, "unk": ours.eod, "pad": None}


def export_tokenizer(files: dict, out: str, max_length: int) -> dict:
    """The checkpoint's tokenizer files ({name: path}) as Hugging Face's; the special ids."""
    if TOKENIZER_MODEL in files:
        return save_tokenizer(files[TOKENIZER_MODEL], out, max_length)
    return save_gpt2_tokenizer(*(files[name] for name in GPT2_FILES), out, max_length)


# -- output directories: written aside, renamed into place --------------------------------

def check_target(path: str, flag: str, force: bool):
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConvertError(flag, f"{path} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise ConvertError(flag, f"{path} exists and is not empty (pass --force to replace it)")


@contextlib.contextmanager
def staged(path: str):
    """Yield a temporary directory next to `path`; on success it replaces `path`."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-",
                           dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would stay on the output
        yield tmp
        old = None
        if os.path.exists(path):  # empty, or --force: keep it until the new one is in place
            old = tempfile.mkdtemp(prefix=".old-", dir=parent)
            os.replace(path, os.path.join(old, "x"))
        os.replace(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- ours -> Hugging Face -------------------------------------------------------------------

def read_ours(load: str):
    """(meta, state, resolved checkpoint directory)."""
    if not os.path.exists(load):  # before importing torch: a typo answers at once
        raise ConvertError("--load", f"{load} does not exist")
    from megaulysses.training.checkpoint import find_checkpoint, read_model_checkpoint
    path = find_checkpoint(load)
    meta, state = read_model_checkpoint(path)
    return meta, state, path


def hf_config(cfg: ModelConfig, arch: str, meta: dict, ids: dict, dtype: str):
    from transformers import GPT2Config, LlamaConfig
    run = meta.get("args", {}).get("model", {})  # the run's flags, if it was a training run
    common = dict(architectures=[ARCHES[arch]], vocab_size=cfg.padded_vocab_size,
                  tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                  bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"),
                  pad_token_id=ids.get("pad"), dtype=dtype,
                  initializer_range=run.get("init_method_std", 0.02))
    if arch == "llama":
        return LlamaConfig(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
            max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_epsilon,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
            attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
            attention_dropout=run.get("attention_dropout", 0.0), **common)
    dropout = run.get("hidden_dropout", 0.0)
    return GPT2Config(
        n_embd=cfg.hidden_size, n_inner=cfg.ffn_size, n_layer=cfg.num_layers,
        n_head=cfg.num_attention_heads, n_positions=cfg.max_positions,
        activation_function="gelu_new", layer_norm_epsilon=cfg.norm_epsilon,
        resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=run.get("attention_dropout", 0.0), **common)


def save_config(config, out: str):
    """config.json as the installed transformers writes it, plus the keys transformers 4
    reads instead of 5's (5 reads both): torch_dtype, and Llama's top-level rope_theta."""
    config.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        data = json.load(f)
    data["torch_dtype"] = data["dtype"]
    if config.model_type == "llama":
        data["rope_theta"] = config.rope_parameters["rope_theta"]
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def checkpoint_tokenizer(meta: dict, path: str, skip: bool) -> tuple:
    """(the run's tokenizer files inside the checkpoint, {name: path}, or None: its
    SentencePiece model or GPT-2's vocab.json and merges.txt; a warning or None)."""
    if skip:
        return None, None
    for names in ((TOKENIZER_MODEL,), GPT2_FILES):
        files = {name: os.path.join(path, name) for name in names}
        if all(map(os.path.isfile, files.values())):
            return files, None
    kind = (meta.get("tokenizer") or {}).get("type")
    why = "a NullTokenizer run" if kind == "NullTokenizer" else (
        f"no {TOKENIZER_MODEL} (or {' and '.join(GPT2_FILES)}) in it")
    return None, f"{path}: {why}: exported without tokenizer files"


def tokenless_ids(meta: dict, cfg: ModelConfig) -> dict:
    """Special token ids without a SentencePiece model: those of the Hugging Face model
    this checkpoint was imported from, or a NullTokenizer's eod (the id right after the
    given vocabulary), else none."""
    if "token_ids" in meta.get("converted_from", {}):
        return meta["converted_from"]["token_ids"]
    if (meta.get("tokenizer") or {}).get("type") == "NullTokenizer":
        return {"eos": cfg.vocab_size - 1}
    return {}


def to_hf(args) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from megaulysses.training.checkpoint import model_config
    check_target(args.hf_dir, "--hf-dir", args.force)
    meta, state, path = read_ours(args.load)
    cfg = model_config(meta["model"])
    arch = pick_arch(cfg, args.arch)
    dtype, links = getattr(torch, args.dtype), links_for(cfg, arch)
    unmapped = sorted(set(state) - {name for link in links for name in link.ours})
    if unmapped:  # never drop a parameter silently
        raise ConvertError("--load", f"parameter {unmapped[0]} has no {ARCHES[arch]} "
                                     "counterpart")
    tensors = {link.hf: to_hf_tensor(link, state).to(dtype).contiguous() for link in links}
    tok, warning = checkpoint_tokenizer(meta, path, args.no_tokenizer)
    with staged(args.hf_dir) as out:
        ids = export_tokenizer(tok, out, cfg.max_positions) if tok else tokenless_ids(meta,
                                                                                     cfg)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        save_config(hf_config(cfg, arch, meta, ids, args.dtype), out)
        if ids.get("eos") is not None:  # generation stops at the end-of-document token
            GenerationConfig(bos_token_id=ids.get("bos"), eos_token_id=ids["eos"],
                             pad_token_id=ids.get("pad")).save_pretrained(out)
    if warning:  # only now: a failed conversion says one line, its error
        warn(warning)
    print(f"wrote {args.hf_dir}: {ARCHES[arch]} ({args.dtype}) from {path}: "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.padded_vocab_size}"
          f"{', with tokenizer' if tok else ', no tokenizer'}")
    return args.hf_dir


# -- Hugging Face -> ours -------------------------------------------------------------------

def read_hf_config(hf_dir: str):
    """(arch, transformers config) after checking the model type."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConvertError("--hf-dir", f"{hf_dir} is not a directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(path, f"unreadable ({e})")
    arch = raw.get("model_type") if isinstance(raw, dict) else None
    if arch not in ARCHES:
        raise ConvertError(path, f"model_type {arch!r} is not supported (only "
                                 f"{' and '.join(ARCHES)})")
    from transformers import GPT2Config, LlamaConfig
    try:
        return arch, (LlamaConfig if arch == "llama" else GPT2Config).from_pretrained(hf_dir)
    except Exception as e:  # transformers' own validation of the config
        raise ConvertError(path, " ".join(str(e).split()))


def _llama_rules(c) -> list:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    return [(c.hidden_act == "silu", "hidden_act", f"{c.hidden_act!r}: only silu (SwiGLU)"),
            (rope.get("rope_type", "default") == "default", "rope_scaling",
             f"{rope.get('rope_type')!r} scaling is not supported (plain RoPE only)"),
            (c.attention_bias == c.mlp_bias, "mlp_bias",
             f"{c.mlp_bias} differs from attention_bias {c.attention_bias}: our linears "
             "have biases all or none (--add-bias-linear)")]


def _gpt2_rules(c) -> list:
    act = c.activation_function
    return [(act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), "activation_function",
             f"{act!r}: only the tanh GeLU (gelu_new)"),
            (c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx,
             "scale_attn_weights", "only 1/sqrt(head_dim) attention scaling"),
            (not c.add_cross_attention, "add_cross_attention", "not a decoder-only model")]


def shape_from_hf(arch: str, c, vocab_size: int, seq_length, path: str) -> ModelConfig:
    for ok, key, rule in _llama_rules(c) if arch == "llama" else _gpt2_rules(c):
        if not ok:
            raise ConvertError(path, f"{key}: {rule}")
    if arch == "llama":
        shape = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                     ffn_hidden_size=c.intermediate_size,
                     num_attention_heads=c.num_attention_heads,
                     num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim,
                     max_position_embeddings=c.max_position_embeddings,
                     position_embedding_type="rope",
                     rotary_base=float(c.rope_parameters["rope_theta"]),
                     normalization="RMSNorm", norm_epsilon=c.rms_norm_eps, swiglu=True,
                     add_bias_linear=c.attention_bias)
    else:
        shape = dict(num_layers=c.n_layer, hidden_size=c.n_embd,
                     ffn_hidden_size=c.n_inner or 4 * c.n_embd, num_attention_heads=c.n_head,
                     num_query_groups=c.n_head, kv_channels=c.n_embd // c.n_head,
                     max_position_embeddings=c.n_positions,
                     position_embedding_type="learned_absolute", normalization="LayerNorm",
                     norm_epsilon=c.layer_norm_epsilon, swiglu=False, add_bias_linear=True)
    return ModelConfig(**shape, seq_length=seq_length or shape["max_position_embeddings"],
                       untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                       vocab_size=vocab_size,
                       make_vocab_size_divisible_by=divisible_by(vocab_size, c.vocab_size))


def divisible_by(vocab: int, hf_vocab: int) -> int:
    """M with ceil(vocab / M) * M == hf_vocab (see the module docstring)."""
    for m in (128, 64, 32, 16, 8, 4, 2, 1):
        if math.ceil(vocab / m) * m == hf_vocab:
            return m
    return next(m for m in range(hf_vocab - vocab + 1, hf_vocab + 1)
                if hf_vocab % m == 0)


def _weight_files(hf_dir: str) -> list:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(hf_dir, index)
        if os.path.exists(path):
            try:
                with open(path) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError) as e:
                raise ConvertError(path, f"unreadable ({e})")
            return [os.path.join(hf_dir, s) for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(hf_dir, name)):
            return [os.path.join(hf_dir, name)]
    raise ConvertError("--hf-dir", f"{hf_dir} has no model.safetensors or pytorch_model.bin")


def read_hf_weights(hf_dir: str) -> dict:
    import torch
    from safetensors.torch import load_file
    weights = {}
    for path in _weight_files(hf_dir):
        try:
            weights.update(load_file(path) if path.endswith(".safetensors") else
                           torch.load(path, map_location="cpu", weights_only=True))
        except Exception as e:  # SafetensorError, unpickling errors, missing shards
            raise ConvertError(path, f"unreadable ({' '.join(str(e).split())})")
    return weights


# Buffers some checkpoints carry that are not parameters (old transformers versions).
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def canonical_names(arch: str, weights: dict, tied: bool) -> dict:
    """Names as *ForCausalLM saves them: add the base-model prefix where a bare base model
    was saved, drop non-parameter buffers and the duplicate lm_head of a tied model."""
    prefix = "model." if arch == "llama" else "transformer."
    out = {}
    for name, t in weights.items():
        if name.endswith(_BUFFERS) or (tied and name == "lm_head.weight"):
            continue
        if not name.startswith(prefix) and name != "lm_head.weight":
            name = prefix + name
        out[name] = t
    return out


def state_from_hf(cfg: ModelConfig, arch: str, weights: dict, where: str) -> dict:
    import torch
    links = links_for(cfg, arch)
    weights = canonical_names(arch, weights, not cfg.untie_embeddings_and_output_weights)
    extra = sorted(set(weights) - {link.hf for link in links})
    if extra:
        raise ConvertError(where, f"unexpected tensor {extra[0]} (not a parameter of "
                                  f"{ARCHES[arch]} with this config.json)")
    shapes, state = our_shapes(cfg), {}
    for link in links:
        if link.hf not in weights:
            raise ConvertError(where, f"missing tensor {link.hf}")
        tensor = weights[link.hf]
        want = [list(shapes[name]) for name in link.ours]
        try:
            parts = from_hf_tensor(link, tensor, shapes)
        except RuntimeError:  # a fused tensor that does not split, a 1-D "weight"
            parts = {}
        if [list(parts.get(name, torch.empty(0)).shape) for name in link.ours] != want:
            raise ConvertError(where, f"{link.hf} has shape {list(tensor.shape)}, config.json "
                                      f"implies {' + '.join(map(str, want))} for our "
                                      f"{', '.join(link.ours)}")
        for name, t in parts.items():
            state[name] = t.float().contiguous()  # fp32 master weights, like the trainer's
    return state


def import_tokenizer(args, hf_vocab: int) -> tuple:
    """(the tokenizer files to copy, {name: path}, or None; our vocab_size; a warning or
    None): the SentencePiece model, else GPT-2's vocab.json and merges.txt."""
    path = args.tokenizer_model or os.path.join(args.hf_dir, TOKENIZER_MODEL)
    gpt2 = {name: os.path.join(args.hf_dir, name) for name in GPT2_FILES}
    if args.tokenizer_model is None and not os.path.isfile(path):
        if all(map(os.path.isfile, gpt2.values())):
            return gpt2, _gpt2_vocab_size(gpt2, hf_vocab), None
        return None, hf_vocab, (
            f"{args.hf_dir} has no SentencePiece {TOKENIZER_MODEL} (nor GPT-2's "
            f"{' and '.join(GPT2_FILES)}): the checkpoint is for --tokenizer-type "
            f"NullTokenizer --vocab-size {hf_vocab - 1} (or pass --tokenizer-model)")
    flag = "--tokenizer-model" if args.tokenizer_model else path
    size = sp_processor(path, flag).get_piece_size()
    if size > hf_vocab:
        raise ConvertError(flag, f"{size} pieces, more than the model's vocab_size {hf_vocab}")
    return {TOKENIZER_MODEL: path}, size, None


def _gpt2_vocab_size(files: dict, hf_vocab: int) -> int:
    """Our GPT2BPETokenizer's vocabulary from the files (ConvertError naming the file)."""
    from megaulysses.data.tokenizer import GPT2BPETokenizer
    try:
        size = GPT2BPETokenizer(*files.values()).vocab_size
    except ValueError as e:
        flag, _, rule = str(e).partition(": ")
        raise ConvertError(files["vocab.json" if flag == "--vocab-file" else "merges.txt"],
                           rule) from None
    if size > hf_vocab:
        raise ConvertError(files["vocab.json"], f"{size} tokens, more than the model's "
                                                f"vocab_size {hf_vocab}")
    return size


def _tokenizer_flags(files, save: str, vocab: int) -> list:
    """pretrain_gpt.py's flags for the tokenizer copied into the checkpoint at `save`."""
    from megaulysses.training.checkpoint import iteration_dir
    inside = {name: os.path.join(iteration_dir(save, 0), name) for name in files or ()}
    if TOKENIZER_MODEL in inside:
        return ["--tokenizer-model", inside[TOKENIZER_MODEL]]
    if inside:
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", inside["vocab.json"],
                "--merge-file", inside["merges.txt"]]
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1)]


def trainer_flags(cfg: ModelConfig) -> list:
    """pretrain_gpt.py flags that build exactly this model shape."""
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
        flags += ["--rotary-base", repr(m["rotary_base"])]
    flags += ["--normalization", m["normalization"], "--norm-epsilon", repr(m["norm_epsilon"]),
              "--swiglu" if m["swiglu"] else "--no-swiglu",
              "--add-bias-linear" if m["add_bias_linear"] else "--disable-bias-linear"]
    if m["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--make-vocab-size-divisible-by", m["make_vocab_size_divisible_by"]]
    return [str(f) for f in flags]


def check_flags_build(flags: list, cfg: ModelConfig):
    """The printed flags must pass the trainer's own validation and give this shape."""
    from megaulysses.config import parse_args, resolve
    try:  # the trainer's own start: the flags' rules, then resolve on one process
        built = resolve(parse_args(flags), 1, cfg.vocab_size).model
    except ConfigError as e:
        raise ConvertError("config.json", f"our trainer cannot build this model: {e}")
    if built.shape_dict() != cfg.shape_dict():
        raise AssertionError(f"flags {flags} build {built.shape_dict()}, not {cfg.shape_dict()}")


def converted_from(hf_dir: str, arch: str, hf) -> dict:
    """Recorded in trainer_state.json; the token ids serve an export without tokenizer."""
    ids = {k: getattr(hf, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    return {"hf_dir": os.path.abspath(hf_dir), "architecture": ARCHES[arch], "token_ids": ids}


def from_hf(args) -> str:
    from megaulysses.training.saver import write_model_checkpoint
    check_target(args.save, "--save", args.force)
    arch, hf = read_hf_config(args.hf_dir)
    tok, vocab, warning = import_tokenizer(args, hf.vocab_size)
    cfg = shape_from_hf(arch, hf, vocab, args.seq_length, os.path.join(args.hf_dir,
                                                                          "config.json"))
    if cfg.seq_length > cfg.max_positions:
        raise ConvertError("--seq-length", f"must be <= the model's max_position_embeddings "
                                           f"{cfg.max_positions}, got {cfg.seq_length}")
    flags = trainer_flags(cfg)
    check_flags_build(flags, cfg)
    state = state_from_hf(cfg, arch, read_hf_weights(args.hf_dir), args.hf_dir)
    with staged(args.save) as out:
        write_model_checkpoint(out, state, cfg.shape_dict(), tokenizer=tok,
                               extra={"converted_from": converted_from(args.hf_dir, arch, hf)})
    if warning:  # only now: a failed conversion says one line, its error
        warn(warning)
    tok_flags = _tokenizer_flags(tok, args.save, vocab)
    print(f"wrote {args.save}: {ARCHES[arch]} from {args.hf_dir}, {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size} (padded {cfg.padded_vocab_size})")
    print("continue pretraining with these flags (plus --data-path tokenized with this "
          "tokenizer, batch and schedule flags):")
    print(shlex.join(["python", "pretrain_gpt.py", *flags, "--load", args.save, *tok_flags]))
    return args.save


# -- command line ---------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (raised as ConvertError)."""

    def error(self, message):
        if message.startswith("argument ") and ": " in message:
            flag, rule = message[len("argument "):].split(": ", 1)
            raise ConvertError("direction" if flag.startswith("{") else flag.split("/")[0],
                               rule)
        if "{to-hf,from-hf}" in message:  # no direction given
            raise ConvertError("direction", "required: to-hf or from-hf (see --help)")
        required = "the following arguments are required: "
        if message.startswith(required):
            raise ConvertError(message[len(required):].split(",")[0].split("/")[0], "required")
        raise ConvertError("convert_checkpoint.py", message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="convert_checkpoint.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True, metavar="{to-hf,from-hf}",
                           parser_class=_Parser)
    a = sub.add_parser("to-hf", help="our checkpoint -> Hugging Face directory",
                       description="Our checkpoint (any grid) -> a Hugging Face directory.\n\n"
                       "  python tools/convert_checkpoint.py to-hf --load runs/default/"
                       "checkpoints --hf-dir hf_out",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--load", required=True,
                   help="a --save directory (its latest committed checkpoint) or iter_XXXXXXX")
    a.add_argument("--hf-dir", required=True, help="output directory (must be new or empty)")
    a.add_argument("--arch", choices=("auto", *ARCHES), default="auto",
                   help="auto: llama for RoPE models, gpt2 for learned positions")
    a.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the exported weights and config.json")
    a.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    a.add_argument("--force", action="store_true", help="replace a non-empty --hf-dir")
    b = sub.add_parser("from-hf", help="Hugging Face directory -> our checkpoint",
                       description="A Hugging Face Llama or GPT-2 directory -> a checkpoint "
                       "our trainer continues from.\n\n  python tools/convert_checkpoint.py "
                       "from-hf --hf-dir hf_model --save ckpt/imported",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or .bin)")
    b.add_argument("--save", required=True, help="output --load directory (new or empty)")
    b.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model to train with (default: HF_DIR/tokenizer.model)")
    b.add_argument("--seq-length", type=positive_int("--seq-length"), default=None,
                   help="training sequence length recorded in the checkpoint "
                        "(default: max_position_embeddings)")
    b.add_argument("--force", action="store_true", help="replace a non-empty --save")
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.direction == "to-hf":
            to_hf(args)
        else:
            from_hf(args)
    except (ConvertError, CheckpointError, ConfigError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
