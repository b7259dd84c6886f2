"""A SentencePiece model as a Hugging Face tokenizer.json: to-hf writes it for runs that
trained with --tokenizer-model FILE.model (SentencePieceTokenizer).

The tokenizer.json reproduces SentencePiece's encoding (BPE merges or unigram scores, byte
fallback, the model's normalization and dummy-prefix rules) and is checked against
SentencePiece on a probe text before anything is written. It adds no bos/eos (our runs
train without them).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from hf_errors import ConvertError

TOKENIZER_MODEL = "tokenizer.model"
# Reproduced by the exported tokenizer before it is written: spaces (single, double,
# leading, trailing), newlines, tabs, digits, accents, symbols outside any vocabulary;
# BPE models also the names of control and byte pieces, which are plain text.
PROBE_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
              "  Two  spaces,\ttab, 1603 and 42; caf\u00e9 \u00fcber \u2603 \u6f22\u5b57 "
              "\U0001f600 end ")
PROBE_RESERVED = "<s> </s> <unk> <0x41> "
SP_NORMAL, SP_USER_DEFINED = 1, 4
SP_UNIGRAM, SP_BPE = 1, 2

def sp_processor(path: str, where: Optional[str] = None):
    """SentencePieceProcessor, or ConvertError naming `where` (default: the file)."""
    import sentencepiece as spm
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
        raise ConvertError(where or path, f"{path} is not a readable SentencePiece model "
                                          f"({' '.join(str(e).split())})") from None


def _sp_proto(path: str):
    """The model's protobuf (pieces with types and scores, trainer and normalizer specs)."""
    from sentencepiece import sentencepiece_model_pb2
    sp_processor(path)  # a clear error for a file that is not a model
    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated
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
    norm: list[normalizers.Normalizer] = (
        [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else [])
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
        # strict=False: the encodings may differ in length; the first mismatch is what counts
        pairs = zip(got, want, strict=False)
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(want)))
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

